"""Plug-ins as a user would write them outside the project: imported by path from config
("robust_plugins:length_penalty"), never registered. Used by tests/test_robust_rewards_tasks.py."""

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
