"""Plug-ins as a user would write them outside the project: imported by path from config
("robust_plugins:length_penalty"), never registered. Used by tests/test_robust_rewards_tasks.py and
tests/test_reward_isolation.py."""

from __future__ import annotations

import time

from grpo_lab.tasks import Task, TaskItem

NOT_CALLABLE = 42


def length_penalty(completions: list[str], **_) -> list[float]:
    """-0.1 per character: a plain user reward."""
    return [-0.1 * len(c) for c in completions]


def raises_on_x(completions: list[str], **_) -> list[float]:
    """Crashes the whole batch when any completion contains 'x' (only those samples should fail)."""
    out = []
    for c in completions:
        if "x" in c:
            raise ValueError(f"cannot score {c!r}")
        out.append(1.0)
    return out


def nan_on_y(completions: list[str], **_) -> list[float]:
    return [float("nan") if "y" in c else 1.0 for c in completions]


def hangs_on_h(completions: list[str], **_) -> list[float]:
    """Sleeps 'forever' on completions containing 'h', and swallows ordinary exceptions while at it."""
    for c in completions:
        if "h" in c:
            try:
                time.sleep(60)
            except Exception:
                pass
    return [1.0] * len(completions)


def spins_on_h(completions: list[str], **_) -> list[float]:
    """A pure-Python busy loop on 'h' (interruptible by an async exception in any thread)."""
    for c in completions:
        if "h" in c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pass
    return [1.0] * len(completions)


def make_task(*, name: str = "plugin_task", train_size: int = 20, **_) -> Task:
    """A task factory named as task.source=robust_plugins:make_task."""
    items = [TaskItem(prompt=f"{i}+1=", answer=str(i + 1), solution=str(i + 1), fields={"answer_format": "plain"})
             for i in range(train_size + 10)]
    return Task(name=name, splits={"train": items[:train_size], "dev": items[train_size:train_size + 5],
                                   "test": items[train_size + 5:]}, info={"source": "plugin"})


def small_llama(out_dir, *, alphabet: str, seed: int = 0):
    """A model builder named as model.builder=robust_plugins.small_llama: the lab's tiny Llama, smaller."""
    from grpo_lab.models import MODEL_BUILDERS

    return MODEL_BUILDERS.call("tiny_llama", out_dir, alphabet=alphabet, seed=seed, hidden_size=32, num_layers=1,
                               num_heads=2, intermediate_size=64, max_position_embeddings=64)


def regex_hangs(completions: list[str], **_) -> list[float]:
    """A catastrophic regex: exponential backtracking inside re's C engine (no bytecode runs, so no
    in-process timeout can stop it)."""
    import re

    return [1.0 if re.match(r"(a+)+$", "a" * 40 + "b") else 0.0 for _ in completions]


def sleeps_forever(completions: list[str], **_) -> list[float]:
    """Sleeps in one C call for a day (a blocked network read, a deadlock), whatever the completion.

    With $REWARD_CALLS_FILE set, every call first appends a line to that file and the first
    $REWARD_HANG_AFTER calls (default 0) return 1.0 instead: a test can let step 1 pass (so the
    max_staleness=1 sampler hangs in its background thread) and see when the hang began.
    """
    import os

    log = os.environ.get("REWARD_CALLS_FILE")
    if log:
        with open(log, "a+") as f:
            f.seek(0)
            before = len(f.readlines())
            f.write("call\n")
        if before < int(os.environ.get("REWARD_HANG_AFTER", "0")):
            return [1.0] * len(completions)
    time.sleep(86_400)
    return [1.0] * len(completions)


def worker_pid(completions: list[str], **_) -> list[float]:
    """The pid of the process that runs the reward (to see where it ran)."""
    import os

    return [float(os.getpid())] * len(completions)
