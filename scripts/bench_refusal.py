"""`make bench-refusal`: how long `python -m grpo_lab.train` takes to refuse a bad config, against what a
launch that loaded torch first could not beat (`python -c "import torch"`), measured in the same run.

    PYTHONPATH=. .venv/bin/python scripts/bench_refusal.py [--reps 7]

Rows (medians of --reps interleaved rounds, each round running every command once in rotating order, so a
slow patch of this shared machine does not land on one command only):

1. value     — a value the config alone refuses (learner.lr=-1): checked before torch, transformers or
               vLLM load (grpo_lab.launch, grpo_lab.config.value_errors); the target is <= 3 s idle.
2. name      — a name no registry holds (algorithm.policy_loss=clipped_surogate), refused from the index of
               the registries' names an earlier launch wrote (grpo_lab.name_index). A valid launch writes it:
               one is made first, stopped right after validation (its run directory already holds metrics).
3. cold_name — the same name with no index (a fresh cache_dir each time: a first launch, or the first after
               the package's sources changed): torch and the registries load first.
4. torch     — `python -c "import torch"`: the baseline, the least any refusal after torch could take.

Nothing here asserts a timing; it prints numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, capture_output=True, env={**os.environ, "WANDB_MODE": "disabled"})
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_refusal_"))
    train = [sys.executable, "-m", "grpo_lab.train", "logger=none", f"cache_dir={tmp / 'cache'}"]
    commands = {
        "value": lambda i: [*train, "learner.lr=-1", f"hydra.run.dir={tmp / f'value_{i}'}"],
        "name": lambda i: [*train, "algorithm.policy_loss=clipped_surogate", f"hydra.run.dir={tmp / f'name_{i}'}"],
        "cold_name": lambda i: [*train[:-1], f"cache_dir={tmp / f'cold_cache_{i}'}",
                                "algorithm.policy_loss=clipped_surogate", f"hydra.run.dir={tmp / f'cold_{i}'}"],
        "torch": lambda i: [sys.executable, "-c", "import torch"],
    }
    indexed = tmp / "indexed"   # a valid config's launch, refused for its directory once it has validated
    indexed.mkdir()
    (indexed / "metrics.jsonl").write_text('{"step": 1}\n')
    timed([*train, f"hydra.run.dir={indexed}"], REPO)
    if not (tmp / "cache" / "name_index.json").is_file():
        raise SystemExit("the valid launch wrote no name index; the `name` row would not measure it")
    names = list(commands)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:   # one untimed round: the byte-code caches are written, as on any second launch
        timed(commands[name](-1), REPO)
    for i in range(args.reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(timed(commands[name](i), REPO))
    base = statistics.median(times["torch"])
    print(f"refusal time, median of {args.reps} interleaved rounds (load average {os.getloadavg()[0]:.2f}):")
    for name in names:
        med = statistics.median(times[name])
        print(f"  {name:<9} {med:6.2f} s   ratio to `import torch` {med / base:5.2f}   "
              f"(min {min(times[name]):.2f} s, max {max(times[name]):.2f} s)")
    print("target: value and name <= 3 s on an idle machine, ratio < 1 (refused before torch loads)")


if __name__ == "__main__":
    main()
