"""Task data model and the ``TASKS`` registry.

A task source is ``fn(**kwargs) -> Task``; a ``Task`` holds three splits of ``TaskItem``s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from grpo_lab.registry import Registry

log = logging.getLogger(__name__)

# Fact: `check(task_cfg, errors)` validates the source's own settings before anything loads (None = none).
# Facts: `check(task_cfg, errors)` validates the source's settings before anything loads; `run_label(task_cfg)`
# is what run names and tags call the task (None: task.name, the reasoning-gym generator).
TASKS = Registry("task source", defaults={"check": None, "run_label": None})

SPLITS = ("train", "dev", "test")


@dataclass
class TaskItem:
    """One prompt with its reference.

    ``prompt``: the text the model sees (the caller prepends bos / applies a chat template).
    ``answer``: the reference final answer (what the reward compares against).
    ``solution``: the SFT warm-up target completion, ending in ``answer`` written in the item's
    answer format (``fields["answer_format"]``, see ``grpo_lab.rewards.answers``).
    ``fields``: extra per-item data the reward functions receive as keyword lists
    (``answer_format`` always; reasoning-gym items add ``rg_dataset``, ``rg_config``, ``rg_entry``).
    """

    prompt: str
    answer: str
    solution: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    """A named set of splits ``{"train", "dev", "test"} -> list[TaskItem]``.

    ``info`` records what the source did (sizes, seeds, how many train items were dropped as
    duplicates of dev/test prompts) so the train loop can log it.
    """

    name: str
    splits: dict[str, list[TaskItem]]
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [s for s in SPLITS if s not in self.splits]
        if missing:
            raise ValueError(f"task {self.name!r} lacks splits {missing}; need {list(SPLITS)}")

    def alphabet(self) -> str:
        """Every character of every prompt, answer and solution in all splits, sorted, unique.

        This is what the character tokenizer is built from, so nothing the model reads or is
        trained to write maps to ``<unk>``.
        """
        chars: set[str] = set()
        for items in self.splits.values():
            for it in items:
                chars.update(it.prompt)
                chars.update(it.answer)
                chars.update(it.solution)
        return "".join(sorted(chars))


def remove_train_overlap(splits: dict[str, list[TaskItem]], task_name: str) -> dict[str, int]:
    """Drop train items whose prompt also appears in dev or test (in place); return counts.

    Evaluating on prompts seen in training would overstate generalisation. dev/test overlap with
    each other is only counted (both are held out; removing from either would change its size).
    """
    held_out = {it.prompt for s in ("dev", "test") for it in splits[s]}
    before = len(splits["train"])
    splits["train"] = [it for it in splits["train"] if it.prompt not in held_out]
    removed = before - len(splits["train"])
    dev_prompts = {it.prompt for it in splits["dev"]}
    dev_test = sum(it.prompt in dev_prompts for it in splits["test"])
    if removed:
        log.info("task %s: removed %d of %d train items whose prompt is also in dev/test", task_name, removed, before)
    if dev_test:
        log.warning("task %s: %d test prompts also appear in dev", task_name, dev_test)
    return {"train_removed_overlap": removed, "dev_test_overlap": dev_test}


def task_label(task_cfg: Any) -> str:
    """What run names, tags and groups call the task a ``task`` config section describes: the source's
    ``run_label`` fact (a local dataset: its file's stem), else ``task.name`` for a registered source, else
    a plug-in factory's name (``my_pkg.tasks:arith_words`` -> ``arith_words``; not imported here, so a
    run name never depends on the plug-in being importable)."""
    source = str(task_cfg.source)
    if ":" in source or "." in source:  # a plug-in path (registered names have neither)
        return source.rpartition(":")[2] if ":" in source else source.rpartition(".")[2]
    label = TASKS.fact(source, "run_label") if source in TASKS.names() else None
    return str(label(task_cfg)) if label is not None else str(task_cfg.name)


def build_task(task_cfg: Any) -> Task:
    """The Task a ``task`` config section describes (all sources, plug-ins included).

    Every set (non-null) field except ``source`` and ``max_completion_tokens`` is offered to the
    factory, which receives the ones its signature names (all of them if it takes ``**kwargs``).
    """
    from grpo_lab.schema import as_dict

    fields = {k: v for k, v in as_dict(task_cfg).items() if v is not None}
    fields.pop("max_completion_tokens", None)
    # A registered source or a plug-in factory "package.module:function" (grpo_lab.registry).
    task = TASKS.call(fields.pop("source", "reasoning_gym"), **fields)
    if not isinstance(task, Task):
        raise TypeError(f"task.source factory returned {type(task).__name__}, not a grpo_lab.tasks.Task")
    return task
