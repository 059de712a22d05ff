#!/usr/bin/env python
"""What one sandboxed tool call costs on this machine (grpo_lab/interaction/sandbox.py): N distinct calls of
the tiny model's kind (``123*456``) through one Sandbox, with 1 and with W calls at once; prints the isolation
mode, calls per second and the median / 90th-percentile latency of a call.

    python scripts/bench_tool_sandbox.py [--calls 200] [--workers 2] [--isolation auto]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from grpo_lab.interaction.sandbox import Limits, Sandbox  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--isolation", default="auto")
    args = ap.parse_args()
    rng = random.Random(0)
    codes = [f"{rng.randint(100, 999)}*{rng.randint(100, 999)}" for _ in range(args.calls)]
    for workers in sorted({1, args.workers}):
        box = Sandbox(Limits.of(), isolation=args.isolation, workers=workers)
        started = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(box.run, codes))
        wall = time.perf_counter() - started
        box.close()
        latency = sorted(r.time_s for r in results)
        print(f"isolation={box.mode} workers={workers}: {len(codes)} calls in {wall:.2f} s = {len(codes) / wall:.0f} "
              f"calls/s; latency median {statistics.median(latency) * 1e3:.0f} ms, 90th percentile "
              f"{latency[int(0.9 * len(latency))] * 1e3:.0f} ms; all ok: {all(r.ok for r in results)}")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
