# grpo_lab — `make help` lists every target.
PY := .venv/bin/python
export WANDB_SILENT := true
export TOKENIZERS_PARALLELISM := false
export VLLM_ALLOW_INSECURE_SERIALIZATION := 1

.DEFAULT_GOAL := help
.PHONY: help venv run train-rm run-fsdp run-smollm2 resume test test-slow test-gpu test-all bench bench-refusal bench-trl-smollm2 bench-trl-tiny bench-sync bench-algorithms bench-algorithms-smollm2 clean

help: ## List every target with one line each
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-18s %s\n", $$1, $$2}'

venv: ## Create .venv if missing or out of date: cuda stack with an NVIDIA GPU, else cpu (STACK=cpu|cuda forces one)
	@$(if $(STACK),GRPO_LAB_STACK=$(STACK) )bash scripts/setup_env.sh

run: venv ## Default experiment: build tiny model, warm-up SFT (cached), GRPO with vLLM, before/after table
	$(PY) -m grpo_lab.train $(ARGS)

train-rm: venv ## Train a reward model (cached by content): make train-rm ARGS="experiment=rlhf_tiny reward_model.data.label_noise=0.2"
	$(PY) -m grpo_lab.train_reward_model $(ARGS)

NPROC ?= 2
run-fsdp: venv ## Learner sharded with FSDP2 over NPROC processes (torchrun; gloo on CPU, NCCL on GPU; learner.num_devices must equal NPROC): make run-fsdp NPROC=2 ARGS="learner.num_devices=2 ..."
	.venv/bin/torchrun --nproc_per_node $(NPROC) -m grpo_lab.train learner.strategy=fsdp2 $(ARGS)

run-smollm2: venv ## SmolLM2-135M-Instruct, chat template, chain_sum questions, vLLM rollouts, LoRA (conf/experiment/smollm2_chain_sum.yaml; ARGS: seed=1 ...)
	$(PY) -m grpo_lab.train experiment=smollm2_chain_sum $(ARGS)

resume: venv ## Continue a killed run from its newest checkpoint: make resume RUN=outputs/runs/<dir> (needs trainer.checkpoint_every)
	@test -n "$(RUN)" || { echo "usage: make resume RUN=<run dir> [ARGS=extra overrides]"; exit 2; }
	$(PY) -m grpo_lab.resume $(RUN) $(ARGS)

test: venv ## Offline test suite on two workers (CPU, well under 20 minutes; excludes tests marked slow)
	$(PY) -m pytest -m "not slow" -n 2 -q --durations=25 $(ARGS)

test-slow: venv ## Only the slow tests (longer end-to-end runs)
	$(PY) -m pytest -m slow -q $(ARGS)

test-gpu: venv ## Only the GPU tests (tests/test_gpu.py: learner, cuda_ipc push, runs, FSDP2 over NCCL); skipped without CUDA
	$(PY) -m pytest -m gpu -v $(ARGS)

test-all: venv ## Every test, slow ones included
	$(PY) -m pytest -q $(ARGS)

bench: venv ## Speed, A/B interleaved in one run: rollout vs raw vLLM, learner vs plain torch, sync share, overlap, vs TRL (ARGS: see --help)
	PYTHONPATH=. $(PY) scripts/bench.py $(ARGS)

bench-refusal: venv ## Time to refuse a bad config (value vs registry name) against `python -c "import torch"`, interleaved
	PYTHONPATH=. $(PY) scripts/bench_refusal.py $(ARGS)

bench-trl-smollm2: venv ## The lab vs TRL GRPOTrainer on the SmolLM2 recipe (LoRA, bf16, chat template), 8 steps each (~40 min)
	PYTHONPATH=. $(PY) scripts/bench.py --skip phases overlap --steps 8 $(ARGS) experiment=smollm2_chain_sum

bench-trl-tiny: venv ## The lab's fastest tiny-model settings (experiment=tiny_cpu_fast) vs TRL GRPOTrainer, 150 steps each (~5 min)
	PYTHONPATH=. $(PY) scripts/bench.py --skip phases overlap skip_rows shared_prompts $(ARGS) experiment=tiny_cpu_fast

bench-sync: venv ## Weight-sync time, old (pickled) vs new (shm buckets), as a share of the step: tiny model and SmolLM2-135M
	PYTHONPATH=. $(PY) scripts/bench_sync.py $(ARGS)

bench-algorithms: venv ## Peak memory and step time of ppo (with critic) vs grpo, same model and batch, ratios (ARGS: see --help)
	$(PY) scripts/bench_algorithms.py $(ARGS)

bench-algorithms-smollm2: venv ## ppo (critic) vs grpo, rloo, gspo on the SmolLM2 recipe (LoRA, bf16, vLLM, see tables/notes/critic_costs.md): whole-tree peak memory, step time, ratios to ppo
	PYTHONPATH=. $(PY) scripts/bench_algorithms.py --algorithms ppo grpo rloo gspo --baseline ppo --engine recipe --steps 3 --warmup 1 $(ARGS) experiment=smollm2_chain_sum

# Paper tables (scripts/make_table.py, conf/table/<name>.yaml): runs under outputs/tables/<name>,
# table in tables/<name>.md|csv|png. SMOKE=1: one seed, two steps (outputs/smoke/). LAUNCHER=joblib
# JOBS=2: parallel jobs. SCALE=full: the conf/experiment GPU recipe. ARGS: e.g. --report-only.
# A table stopped mid-way (killed, machine off) continues when its command runs again: finished runs
# are kept, interrupted ones resume from their newest checkpoint (the table's checkpoint_every).
.PHONY: table-group-size table-dapo table-algorithms table-losses table-std-norm table-clip table-kl table-async table-tasks table-smollm2 table-mismatch table-noise table-noise-length table-noise-remedy table-critique table-overoptimization table-tools table-status readme-tables

table-status: venv ## Each run of a table: done / running / interrupted / failed / to do, and the time left: make table-status NAME=dapo [SMOKE=1]
	@test -n "$(NAME)" || { echo "usage: make table-status NAME=<table in conf/table> [SMOKE=1]"; exit 2; }
	@$(PY) scripts/make_table.py $(NAME) --status $(ARGS)

table-group-size: venv ## Table: GRPO group size G in {2,4,8,16} at a fixed budget of generated samples
	$(PY) scripts/make_table.py group_size $(ARGS)

table-dapo: venv ## Table: DAPO ladder (arXiv 2503.14476 Table 1), GRPO -> ... -> dynamic sampling
	$(PY) scripts/make_table.py dapo $(ARGS)

table-algorithms: venv ## Table: GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++, PPO + matched-compute SFT control
	$(PY) scripts/make_table.py algorithms $(ARGS)

table-losses: venv ## Table: CISPO, GMPO, SAPO, DPPO vs GRPO, DAPO, GSPO (4 minibatches each), with ratio spread, clipped/gated share, entropy
	$(PY) scripts/make_table.py losses $(ARGS)

table-std-norm: venv ## Table: advantage std normalisation: group std vs none (Dr.GRPO) vs batch std
	$(PY) scripts/make_table.py std_norm $(ARGS)

table-clip: venv ## Table: clip range eps in {0.1,0.2,0.3} x epochs in {1,4}, with clipped fractions
	$(PY) scripts/make_table.py clip $(ARGS)

table-kl: venv ## Table: KL beta in {0,0.001,0.04} x estimator k2/k3
	$(PY) scripts/make_table.py kl $(ARGS)

table-tasks: venv ## Table: GRPO vs DAPO vs matched-compute SFT on five tasks (greedy and sampled mean@4, 1,000 test items)
	$(PY) scripts/make_table.py tasks $(ARGS)

table-noise: venv ## Table: GRPO, PPO, RLOO, group DPO, DPO with 1/0 rewards flipped at p in {0,0.1,0.2,0.3}, drop vs each algorithm's p=0
	$(PY) scripts/make_table.py noise $(ARGS)

table-noise-length: venv ## Table: completion length and accuracy of GRPO, Dr.GRPO, PPO, RLOO under a judge that rewards length
	$(PY) scripts/make_table.py noise_length $(ARGS)

table-noise-remedy: venv ## Table: DPO vs cDPO vs rDPO with preference labels swapped at p in {0,0.1,0.2,0.3}, drop vs clean DPO
	$(PY) scripts/make_table.py noise_remedy $(ARGS)

table-critique: venv ## Table: single-turn GRPO vs revising after the verifier's or a critic LLM's feedback (frozen, SFT, RL; critic every 1 or 4 steps)
	$(PY) scripts/make_table.py critique $(ARGS)

table-overoptimization: venv ## Table: GRPO, PPO, RLOO, offline group DPO against a good and a weak learned reward model, + ensemble and KL rows; gold/proxy vs sqrt(KL)
	$(PY) scripts/make_table.py overoptimization $(ARGS)
table-tools: venv ## Table: single-turn GRPO vs GRPO with a sandboxed Python tool (demonstrated or RL-only start) and RLOO with the tool, on 3-digit products
	$(PY) scripts/make_table.py tools $(ARGS)

table-smollm2: venv ## Table: GRPO, Dr.GRPO, DAPO, GSPO on SmolLM2-135M-Instruct, 2 seeds (about 8 h on 2 CPU cores; resumes where it stopped)
	$(PY) scripts/make_table.py smollm2 $(ARGS)

table-mismatch: venv ## Table: engine/learner mismatch on SmolLM2-135M: no correction, token TIS, sequence MIS, geometric mask, 2 seeds (hours; resumes)
	$(PY) scripts/make_table.py mismatch $(ARGS)

readme-tables: venv ## Regenerate tables/README.md's list of tables from tables/*.md and *_findings.json
	$(PY) -m grpo_lab.tables.readme

table-async: venv ## Table: synchronous vs one-step-stale rollouts (trainer.max_staleness 0 vs 1) at equal samples
	$(PY) scripts/make_table.py async $(ARGS)

clean: ## Remove outputs/, multirun/ and the model cache (keeps .venv)
	rm -rf outputs multirun .cache
