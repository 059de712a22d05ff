# grpo_lab — `make help` lists every target.
PY := .venv/bin/python
export WANDB_SILENT := true
export TOKENIZERS_PARALLELISM := false
export VLLM_ALLOW_INSECURE_SERIALIZATION := 1

.DEFAULT_GOAL := help
.PHONY: help venv run test test-slow test-all bench clean

help: ## List every target with one line each
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-18s %s\n", $$1, $$2}'

venv: ## Create .venv from requirements.txt (+ lock) if missing or out of date
	@bash scripts/setup_env.sh

run: venv ## Default experiment: build tiny model, warm-up SFT (cached), GRPO with vLLM, before/after table
	$(PY) -m grpo_lab.train $(ARGS)

test: venv ## Offline test suite (CPU, well under 20 minutes; excludes tests marked slow)
	$(PY) -m pytest -m "not slow" -q $(ARGS)

test-slow: venv ## Only the slow tests (longer end-to-end runs)
	$(PY) -m pytest -m slow -q $(ARGS)

test-all: venv ## Every test, slow ones included
	$(PY) -m pytest -q $(ARGS)

bench: venv ## Peak memory and step time of ppo (with critic) vs grpo, same model and batch, ratios (ARGS: see --help)
	$(PY) scripts/bench_algorithms.py $(ARGS)

clean: ## Remove outputs/, multirun/ and the model cache (keeps .venv)
	rm -rf outputs multirun .cache
