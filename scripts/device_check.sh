#!/usr/bin/env bash
# The GPU tier on the lent GPU machine, as one command (device tool, `carry: [".whl"]`; fill .whl first
# with scripts/device_wheels.sh here):
#     bash scripts/device_check.sh
# Installs the carried packages into /tmp/site (pycosat built from its sdist), shows the machine, then runs
# `pytest -m gpu tests/test_gpu.py`; the log goes to $OUT/gpu_check.log (or /tmp). On a GPU machine with
# the project's own venv, `make test-gpu` runs the same tests without any of this.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
py=${PYTHON:-python3}
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit
# Needs a C compiler and Python's headers there; without pycosat reasoning-gym does not import, and only
# the tests that build no task (learner, cuda_ipc) can pass: say so and go on.
"$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .whl/pycosat-*.tar.gz || echo "device_check: pycosat did not build here; the tests that run a task will fail" >&2
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
# The machine's own python3 and its torchrun (test_fsdp.torchrun looks beside sys.executable).
export PATH="$(dirname "$(command -v "$py")"):$PATH"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), '| transformers', transformers.__version__)"
  "$py" -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_gpu.py
} 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
