#!/usr/bin/env bash
# A Ray cluster inside one Slurm allocation, then one grpo_lab run on it (trainer.backend=ray).
# WRITTEN, NOT RUN on the project's machine (no Slurm there); the Ray calls it makes are the ones
# grpo_lab/ray_backend.py uses with RAY_ADDRESS, which ran against a local cluster in the tests.
#
#   sbatch --nodes=2 --gpus-per-node=1 --cpus-per-task=16 scripts/slurm_ray.sh \
#       experiment=gpu_dapo seed=0          # any grpo_lab.train overrides
#
# The first node of the allocation runs `ray start --head`; every other node runs `ray start
# --address=<head>`; the trainer (the driver) runs on the head node with RAY_ADDRESS set, so its
# placement group can put the learner and the engine on any node. The checkout, the venv, cache_dir
# and the run directory must be on a filesystem every node sees (actors load and save by path).
#
# Sweeps: `-m hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml) submits one single-node job per
# run; the trainer starts a local Ray cluster inside each job when trainer.backend=ray and RAY_ADDRESS
# is unset. This script is for one run spanning several nodes.
#SBATCH --job-name=grpo_lab_ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON="${PYTHON:-.venv/bin/python}"
RAY="$(dirname "$PYTHON")/ray"
PORT="${RAY_PORT:-6379}"
CPUS="${SLURM_CPUS_PER_TASK:-$(nproc)}"
GPUS="${SLURM_GPUS_PER_NODE:-0}"; GPUS="${GPUS##*:}"          # "a100:4" -> 4

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')"
export RAY_ADDRESS="$HEAD_IP:$PORT"
export RAY_USAGE_STATS_ENABLED=0
# Ray 2.60 clusters started by `ray start` authenticate clients with a token (~/.ray/auth_token; the
# home directory is assumed shared by the nodes): make it once, and make every process use it.
export RAY_AUTH_MODE=token
"$RAY" get-auth-token --generate > /dev/null

# --block keeps each `ray start` in the foreground of its srun step, so Slurm owns (and on
# cancellation kills) every Ray process; the steps run in the background of this batch script.
srun --nodes=1 --ntasks=1 -w "$HEAD" --overlap \
    "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$PORT" \
    --num-cpus="$CPUS" --num-gpus="$GPUS" --include-dashboard=false --block &
sleep 10
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" --overlap \
        "$RAY" start --address="$RAY_ADDRESS" --num-cpus="$CPUS" --num-gpus="$GPUS" --block &
done
# Wait until every node has joined (at most ~5 minutes).
for _ in $(seq 60); do
    joined="$("$PYTHON" -c 'import ray; ray.init(); print(len([n for n in ray.nodes() if n["Alive"]])); ray.shutdown()' 2>/dev/null || echo 0)"
    [ "$joined" -ge "${#NODES[@]}" ] && break
    sleep 5
done
echo "Ray cluster at $RAY_ADDRESS with $joined of ${#NODES[@]} nodes"

status=0
PYTHONPATH=. "$PYTHON" -m grpo_lab.train trainer.backend=ray "$@" || status=$?
"$RAY" stop --force || true          # this node's Ray processes; the other nodes' end with the job's srun steps
exit "$status"
