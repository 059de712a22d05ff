"""Write the GPU device check's report (scripts/device_check.sh) as Markdown: the machine, the GPU test
tier's outcome per test, the smoke recipe's step times split into rollout / learn / push, the GPU's
peak memory, and whether the pushed weights reached the engine.

The push verdict reads ``rollout/logprob_abs_diff_mean``, the mean |engine logprob - learner logprob|
over the sampled tokens of each step. Step 1 samples from the weights both sides loaded from disk, so
its value is the floor set by the two sides' arithmetic (bf16 engine vs bf16 autocast over fp32 masters).
Every later step samples from pushed weights; experiment=smollm2_gpu_smoke's lr moves the weights by
more than bf16 rounding each update, so an engine that missed a push samples from other weights and the
value jumps well above that floor. "Reached" means every later step stays within
``PUSH_FACTOR`` × the floor + ``PUSH_SLACK`` nats.

Standard library only: it runs on the lent machine beside whatever its image holds.

    python scripts/device_report.py --out report.md --machine machine.txt --junit gpu_tests.xml \
        --tier-rc 0 --run-dir /tmp/gpu_smoke_run --recipe-rc 0 --gpu-memory gpu_memory.csv --note "..."
"""

from __future__ import annotations

import argparse
import json
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

PUSH_FACTOR = 3.0
PUSH_SLACK = 0.02
# Columns of the step table: metrics.jsonl key -> header.
STEP_COLUMNS = {"perf/step_time_s": "step s", "perf/rollout_s": "rollout s", "perf/learn_s": "learn s",
                "perf/sync_s": "push s", "rollout/logprob_abs_diff_mean": "abs Δlogp mean",
                "rollout/logprob_abs_diff_max": "abs Δlogp max", "reward/mean": "reward"}


def tier_section(junit: Path, rc: int) -> list[str]:
    """One line per test of the JUnit XML (passed / failed / skipped / error, with the first line of the
    reason), and the counts; a missing file says the tier did not run to its end."""
    lines = [f"## 1. GPU test tier (`pytest -m gpu tests/test_gpu.py`, exit {rc})", ""]
    if not junit.is_file():
        return lines + [f"No JUnit file ({junit.name}): the tier was killed or did not start; see gpu_check.log.", ""]
    counts: dict[str, int] = {}
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                reason = (node.get("message") or node.text or "").strip().splitlines()[0][:160] if (
                    node.get("message") or node.text) else ""
                break
        counts[outcome] = counts.get(outcome, 0) + 1
        rows.append(f"| `{case.get('name')}` | {outcome} | {float(case.get('time') or 0):.1f} | {reason} |")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests collected"
    return lines + [f"**{summary}**", "", "| test | outcome | s | reason |", "|---|---|---|---|", *rows, ""]


def read_steps(run_dir: Path) -> list[dict]:
    """The RL steps' lines of metrics.jsonl (those with a step time), in order."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in lines if isinstance(m.get("perf/step_time_s"), (int, float))]


def push_verdict(steps: list[dict]) -> str:
    """Whether the engine sampled from the pushed weights (module docstring's rule)."""
    diffs = [m.get("rollout/logprob_abs_diff_mean") for m in steps]
    if len(diffs) < 2 or any(not isinstance(d, (int, float)) for d in diffs):
        return "unknown: fewer than 2 steps with rollout/logprob_abs_diff_mean logged"
    floor, later = diffs[0], diffs[1:]
    bound = PUSH_FACTOR * floor + PUSH_SLACK
    ok = max(later) <= bound
    return (f"{'REACHED' if ok else 'NOT REACHED'}: abs Δlogp mean {floor:.4f} at step 1 (same weights on both "
            f"sides), at most {max(later):.4f} after pushes (bound {bound:.4f} = {PUSH_FACTOR:g} × step 1 + "
            f"{PUSH_SLACK:g})")


def peak_gpu_memory(csv: Path) -> str:
    """Peak and baseline of nvidia-smi's memory.used samples (MiB, one a line), whole GPU, all processes."""
    values = []
    if csv.is_file():
        for line in csv.read_text().splitlines():
            try:
                values.append(float(line.strip()))
            except ValueError:
                continue
    if not values:
        return "not sampled"
    return f"{max(values) / 1024:.1f} GiB peak (whole GPU, all processes; {min(values) / 1024:.1f} GiB at least, " \
           f"{len(values)} samples every 0.5 s)"


def recipe_section(run_dir: Path, rc: int, command: str, gpu_memory: Path, notes: list[str]) -> list[str]:
    lines = [f"## 2. Real-model recipe (exit {rc})", "", f"`{command}`", ""]
    lines += [f"- {note}" for note in notes]
    summary = run_dir / "summary.json"
    status = json.loads(summary.read_text()) if summary.is_file() else {}
    lines.append(f"- run: {status.get('status', 'no summary.json')}"
                 + (f", error: {status['error']}" if status.get("error") else ""))
    steps = read_steps(run_dir)
    lines.append(f"- GPU memory: {peak_gpu_memory(gpu_memory)}")
    lines.append(f"- weight push: {push_verdict(steps)}")
    if steps:
        later = steps[1:] or steps
        split = " / ".join(f"{statistics.median(m.get(k, float('nan')) for m in later):.2f}"
                           for k in ("perf/rollout_s", "perf/learn_s", "perf/sync_s"))
        lines.append(f"- median step after the first: {statistics.median(m['perf/step_time_s'] for m in later):.2f} s "
                     f"(rollout / learn / push: {split} s)")
        lines += ["", "| step | " + " | ".join(STEP_COLUMNS.values()) + " |", "|---" * (len(STEP_COLUMNS) + 1) + "|"]
        for m in steps:
            cells = [f"{m[k]:.4g}" if isinstance(m.get(k), (int, float)) else "" for k in STEP_COLUMNS]
            lines.append(f"| {m.get('step', '')} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--machine", type=Path, required=True, help="what device_check.sh recorded of the machine")
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--tier-rc", type=int, required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--recipe-rc", type=int, required=True)
    ap.add_argument("--recipe-command", default="")
    ap.add_argument("--gpu-memory", type=Path, required=True)
    ap.add_argument("--note", action="append", default=[], help="a line about the recipe's setup (repeatable)")
    args = ap.parse_args(argv)
    machine = args.machine.read_text().strip() if args.machine.is_file() else "not recorded"
    text = ["# GPU device check", "", "## Machine", "", "```", machine, "```", "",
            *tier_section(args.junit, args.tier_rc),
            *recipe_section(args.run_dir, args.recipe_rc, args.recipe_command, args.gpu_memory, args.note)]
    args.out.write_text("\n".join(text))


if __name__ == "__main__":
    main()
