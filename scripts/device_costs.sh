#!/usr/bin/env bash
# PPO (critic + GAE) vs GRPO, RLOO and GSPO on one lent GPU: whole-tree peak memory, the learner's CUDA
# peak and median step time (scripts/bench_algorithms.py), at SmolLM2-135M's size with the SmolLM2
# recipe (experiment=smollm2_chain_sum: LoRA r16, bf16 autocast), then the same with full fine-tuning.
# One command of at most ~6 minutes (device tool, `carry: [".whl"]`; fill .whl with
# scripts/device_wheels.sh first):
#     bash scripts/device_costs.sh [--dry-run]
# What the machine lacks is replaced as in device_check.sh: the HF engine on the GPU instead of vLLM, and
# SmolLM2-135M's architecture with seeded random weights, so every completion runs to max_new_tokens
# (equal lengths for every algorithm) and earns no reward; algorithm.entropy_coef=0.001 then gives every
# algorithm a gradient, so no update is skipped for want of one. Writes $OUT/costs_lora.txt and
# $OUT/costs_full.txt ($OUT is /tmp/device_costs where the tool's OUT is not set).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
case "${1:-}" in --dry-run) dry=1 ;; "") ;; *) echo "usage: bash scripts/device_costs.sh [--dry-run]" >&2; exit 2 ;; esac
out=${OUT:-/tmp/device_costs}
py=${PYTHON:-python3}
run() { if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi; }
mkdir -p "$out"
. scripts/device_env.sh
make_random_smollm2
bench=("$py" scripts/bench_algorithms.py --algorithms ppo grpo rloo gspo --baseline ppo --steps 3 --warmup 1
       experiment=smollm2_chain_sum model=pretrained "model.path=$random_model" learner.device=cuda
       learner.num_threads=null rollout.dtype=bfloat16 algorithm.entropy_coef=0.001)
rc=0
if [ "$dry" = 1 ]; then run "${bench[@]}"; run "${bench[@]}" learner.lora.rank=0; exit 0; fi
"${bench[@]}" 2>&1 | tee "$out/costs_lora.txt"; rc=$(( rc | PIPESTATUS[0] ))
"${bench[@]}" learner.lora.rank=0 2>&1 | tee "$out/costs_full.txt"; rc=$(( rc | PIPESTATUS[0] ))
exit "$rc"
