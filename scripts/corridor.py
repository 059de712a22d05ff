#!/usr/bin/env python
"""The corridor from the entry point to the first optimizer step: which of the lab's files one run
passes through, in this process, before the policy's weights first change.

    python scripts/corridor.py [hydra overrides]        # default: the tiny default run, 1 step, HF engine

Runs `grpo_lab.train` in this process twice: once untraced with trainer.total_steps=0 (it builds the
model and the warm-up, so they come from the cache), then under a trace of Python calls that stops at
the first call of a torch optimizer's `step`: the RL step's. Prints, for the whole process and for the
step alone (from the loop taking its batch to the optimizer, plus the files on the call stack from the
entry point), each file of grpo_lab/ whose functions ran (module bodies, i.e. imports, left out) with its
lines and the lines that ran, then the totals: how many files a reader opens to follow one step from the
entry point to the optimizer, and how much of them executes. Engines in their own processes (vLLM's) are not traced; the HF engine keeps
sampling in this process, so the default here is rollout=hf.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_lab"


class FirstStep(BaseException):
    """Raised from the trace at the first optimizer step (a BaseException, so no handler of the lab's
    catches it)."""


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("WANDB_MODE", "offline")
    overrides = argv or ["rollout=hf", "logger=none", "trainer.total_steps=1", "trainer.save_checkpoint=false",
                         "hydra.run.dir=outputs/corridor/run", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    lines: dict[str, set[int]] = defaultdict(set)        # the whole process, entry to the first step
    step_lines: dict[str, set[int]] = defaultdict(set)   # the step alone: from its batch being taken
    stack: list[str] = []                                 # the lab's files on the call stack at the step

    def trace(frame, event, arg):
        code = frame.f_code
        # A torch optimizer's step (not an LR scheduler's, which steps once when it is built).
        if event == "call" and code.co_name == "step" and "torch/optim" in code.co_filename \
                and "lr_scheduler" not in code.co_filename:
            f = frame.f_back
            while f is not None:
                if f.f_code.co_filename.startswith(str(PACKAGE)):
                    stack.append(f.f_code.co_filename)
                f = f.f_back
            raise FirstStep
        if code.co_filename.startswith(str(PACKAGE)) and not (event == "call" and code.co_name == "<module>"):
            lines[code.co_filename].add(frame.f_lineno)
            # The step begins when the loop takes its batch (RolloutPipeline.take).
            if step_lines or (event == "call" and code.co_name == "take" and "self" in frame.f_locals
                              and type(frame.f_locals["self"]).__name__ == "RolloutPipeline"):
                step_lines[code.co_filename].add(frame.f_lineno)
            return trace
        return None

    import grpo_lab.train as train

    # In-process, Hydra is told where conf/ is (as tests/helpers.py does), so older checkouts run too.
    where = ["--config-path", str(REPO / "conf"), "--config-name", "config"]
    sys.argv = ["grpo_lab.train", *where, *overrides, "trainer.total_steps=0", "hydra.run.dir=outputs/corridor/warm"]
    train.main()   # the model and its warm-up into the cache, untraced
    sys.argv = ["grpo_lab.train", *where, *overrides]
    sys.settrace(trace)
    threading.settrace(trace)
    try:
        train.main()
        print("no optimizer step was reached (trainer.total_steps=0?)", file=sys.stderr)
        return 1
    except FirstStep:
        pass
    finally:
        sys.settrace(None)
        threading.settrace(None)
    report(lines, "the whole process, before the first optimizer step")
    corridor = {name: step_lines.get(name, set()) for name in {*step_lines, *stack}}
    report(corridor, "the step: from its batch being taken to the optimizer step, with the entry point's files "
                     "on the call stack")
    return 0


def report(lines: dict[str, set[int]], what: str) -> None:
    total = ran = 0
    print(f"\n{what}\n{'file':55} {'lines':>6} {'ran':>5}")
    for name in sorted(lines):
        n = sum(1 for _ in open(name))
        total, ran = total + n, ran + len(lines[name])
        print(f"{Path(name).relative_to(REPO)!s:55} {n:6d} {len(lines[name]):5d}")
    print(f"{len(lines)} files, {total} lines, {ran} of them ran")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
