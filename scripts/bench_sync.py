"""Weight-sync time as a share of the RL step: the old protocol (every tensor pickled through
`collective_rpc`) against the new one (flattened shared-memory buckets), on the running vLLM engine.

    PYTHONPATH=. .venv/bin/python scripts/bench_sync.py                    # tiny model and SmolLM2-135M
    PYTHONPATH=. .venv/bin/python scripts/bench_sync.py --models tiny --reps 10
    PYTHONPATH=. .venv/bin/python scripts/bench_sync.py --step-s smollm2_135m=45   # your own step time

How it measures, and why:

* One engine per model; the same weights (a full fine-tune's worth: every tensor but the tied
  lm_head, as `Learner.weights_for_sync` returns them) are pushed N times per transport, the
  transports interleaved A B B A ... so a slow patch of this shared 2-core machine does not land on
  one side only; medians are printed. One untimed push per transport first (it creates the
  shared-memory file and the worker's mapping).
* Before every push each tensor is bumped in place (`mul_(1.0)`: same values, new version
  counter), so change detection sees a full update and sends everything, as after a real AdamW step.
* A SmolLM2 step is too slow to measure here in a benchmark, so the step time is an input
  (--step-s; defaults in DEFAULT_STEP_S): the median step of the default tiny run with the vLLM
  engine, and the lower end of a SmolLM2-135M step on 2 CPU cores (the lower end gives the
  largest share).
  Those steps include the old push; the share of the new one is new / (step − old + new).
  `make bench` prints the same share from a step it measures itself (tiny model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Step times the share is computed against, and where they come from (module docstring).
DEFAULT_STEP_S = {"tiny": (0.44, "default: median step of the default run, vLLM engine"),
                  "smollm2_135m": (40.0, "default: SmolLM2 step on 2 CPU cores, 40–53 s (lower end)")}


def model_dir(name: str) -> Path:
    """The model's directory (built once, cached under .cache/grpo_lab/models)."""
    from grpo_lab.models import MODEL_BUILDERS

    cache = REPO / ".cache" / "grpo_lab" / "models"
    if name == "tiny":
        # The default run's model: tiny_llama over the chain_sum character vocabulary.
        return Path(MODEL_BUILDERS.call("tiny_llama", out_dir=cache / "bench_tiny_llama",
                                        alphabet="0123456789+-=", seed=0))
    if name == "smollm2_135m":
        return Path(MODEL_BUILDERS.call("smollm2_135m", out_dir=cache / "smollm2_135m"))
    raise SystemExit(f"unknown model {name!r}: tiny or smollm2_135m")


def learner_weights(path: Path):
    """The tensors a full fine-tune pushes: every parameter but a tied lm_head (Learner.weights_for_sync)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tied = getattr(model.config, "tie_word_embeddings", False)
    return model, [(n, p.detach()) for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")]


def measure_sync(engine, weights, transports: list[str], reps: int, *, bucket_mb: float = 256) -> dict[str, dict]:
    """Median seconds per push for each transport, interleaved; `engine` is a running VLLMEngine."""
    import torch

    from grpo_lab.rollout import weight_sync, weight_sync_worker

    infos = engine._rpc(weight_sync_worker.worker_info)
    syncs = {t: weight_sync.WeightSync(engine._rpc, transport=t, bucket_mb=bucket_mb, worker_infos=infos)
             for t in transports}
    times: dict[str, list[float]] = {t: [] for t in transports}
    parts: dict[str, list[dict]] = {t: [] for t in transports}

    def push(t: str) -> float:
        with torch.no_grad():
            for _, w in weights:
                w.mul_(1.0)  # same values, new version: the tracker sees a full update
        t0 = time.perf_counter()
        stats = syncs[t].push(weights)
        engine.llm.reset_prefix_cache()
        dt = time.perf_counter() - t0
        parts[t].append(stats)
        return dt

    try:
        for t in transports:
            push(t)  # untimed: creates the shm file and the worker's mapping
        for r in range(reps):
            for t in (transports if r % 2 == 0 else transports[::-1]):
                times[t].append(push(t))
    finally:
        for s in syncs.values():
            s.close()
    out = {}
    for t in transports:
        last = parts[t][-1]
        out[t] = {"median_s": statistics.median(times[t]), "all_s": times[t], "mib": last["bytes"] / 2**20,
                  "tensors": last["tensors"], "buckets": last["buckets"],
                  **{k: statistics.median(p.get(k, float("nan")) for p in parts[t][1:])
                     for k in ("pack_s", "load_s") if k in last}}
    return out


def bench_model(name: str, reps: int, bucket_mb: float) -> dict:
    from grpo_lab.rollout.vllm_engine import VLLMEngine

    path = model_dir(name)
    _, weights = learner_weights(path)
    # The CPU build counts the weights inside this share of RAM; SmolLM2 needs 0.3.
    engine = VLLMEngine(path, gpu_memory_utilization=0.3 if name == "smollm2_135m" else 0.1, max_model_len=256, enforce_eager=True,
                        dtype="float32", seed=0, sync_timeout_s=600)
    try:
        return measure_sync(engine, weights, ["pickle", "cpu"], reps, bucket_mb=bucket_mb)
    finally:
        engine.close()


def share_row(name: str, res: dict, step_s: float, source: str) -> str:
    old, new = res["pickle"]["median_s"], res["cpu"]["median_s"]
    step_new = step_s - old + new
    return (f"{name:<14}{res['cpu']['mib']:>9.1f}{res['cpu']['tensors']:>9d}{res['cpu']['buckets']:>9d}"
            f"{1000 * old:>12.1f}{1000 * new:>12.1f}{old / new:>9.2f}x{step_s:>10.2f}"
            f"{100 * old / step_s:>11.1f}%{100 * new / step_new:>11.1f}%   {source}")


HEADER = (f"{'model':<14}{'MiB':>9}{'tensors':>9}{'buckets':>9}{'old ms':>12}{'new ms':>12}{'speed-up':>10}"
          f"{'step s':>10}{'old share':>12}{'new share':>12}   step time source")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2_135m"])
    parser.add_argument("--reps", type=int, default=6, help="timed pushes per transport (default 6)")
    parser.add_argument("--bucket-mb", type=float, default=256, help="rollout.sync_bucket_mb (default 256)")
    parser.add_argument("--step-s", nargs="*", default=[], metavar="MODEL=SECONDS",
                        help="step time to divide by, per model (default: " +
                        ", ".join(f"{k}={v[0]:g}" for k, v in DEFAULT_STEP_S.items()) + ")")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from grpo_lab.learner.learner import set_cpu_threads

    # The trainer's thread placement (learner.num_threads=null: half the cores, the engine gets the
    # rest): the sender's packing runs on the learner's threads.
    set_cpu_threads(None)
    steps = dict(DEFAULT_STEP_S)
    for item in args.step_s:
        k, _, v = item.partition("=")
        steps[k] = (float(v), "given with --step-s")
    rows = []
    for name in args.models:
        print(f"[bench_sync] {name}: starting the engine ...", file=sys.stderr, flush=True)
        res = bench_model(name, args.reps, args.bucket_mb)
        for t in ("pickle", "cpu"):
            detail = ", ".join(f"{k} {1000 * res[t][k]:.0f}" for k in ("pack_s", "load_s") if k in res[t])
            print(f"[bench_sync] {name} {t}: pushes (ms) {[round(1000 * x) for x in res[t]['all_s']]}"
                  + (f"; median parts (ms): {detail}" if detail else ""), file=sys.stderr, flush=True)
        step, source = steps.get(name, (float("nan"), "unknown"))
        rows.append(share_row(name, res, step, source))
    print(f"\nweight sync: old = every tensor pickled through collective_rpc; new = rollout.sync_transport=cpu "
          f"(shared-memory buckets of {args.bucket_mb:g} MiB); medians of {args.reps} interleaved pushes each. "
          "Target: new share <= 5 % of the SmolLM2 step.")
    print(HEADER)
    print("-" * len(HEADER))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
