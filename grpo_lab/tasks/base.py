"""Task data model and the ``TASKS`` registry.

A task source is ``fn(**kwargs) -> Task``; a ``Task`` holds three splits of ``TaskItem``s.
"""

from __future__ import annotations

import inspect

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
    # A dev/test overlap is reported (or refused) by check_splits, which build_task runs on every source.
    return {"train_removed_overlap": removed, "dev_test_overlap": dev_test}


# TaskConfig fields that gate a built task (check_splits) rather than shape it: build_task does not offer
# them to the source, and the warm-up's cache key leaves them out (grpo_lab.run_setup.build_policy).
SPLIT_CHECK_FIELDS = ("min_distinct_train_prompts", "allow_split_overlap")
# Test items whose prompt is also in dev tolerated without task.allow_split_overlap: this share of the test
# split (at least 1). Chance repeats of a large problem space stay under it (chain_sum: 2 of 200).
DEV_TEST_TOLERANCE = 0.05


def check_splits(task: Task, min_distinct_train_prompts: int, allow_split_overlap: bool) -> dict[str, Any]:
    """Count the distinct prompts of each split (recorded in ``task.info``) and refuse a task whose problem
    space is too small for its splits, before any model is built or trained: a ConfigError with the counts
    and what to change when (a) the train split has fewer distinct prompts than ``min_distinct_train_prompts``
    and than half the train items asked for (overlap removal included; a deliberately small split passes),
    or (b) more than DEV_TEST_TOLERANCE of the test items repeat a dev prompt. ``min_distinct_train_prompts=0``
    / ``allow_split_overlap=True`` let such a task through with a printed warning carrying the counts."""
    import sys

    from grpo_lab.schema import ConfigError, TaskConfig

    splits = task.splits
    distinct = {s: len({it.prompt for it in splits[s]}) for s in SPLITS}
    n = {s: len(splits[s]) for s in SPLITS}
    removed = int(task.info.get("train_removed_overlap") or 0)
    asked = n["train"] + removed
    dev_prompts = {it.prompt for it in splits["dev"]}
    dev_test = sum(it.prompt in dev_prompts for it in splits["test"])
    task.info["distinct_prompts"] = distinct
    task.info["dev_test_overlap"] = dev_test

    default_min = TaskConfig.min_distinct_train_prompts
    few = distinct["train"] < min(int(min_distinct_train_prompts), asked / 2)
    few_by_default = distinct["train"] < min(default_min, asked / 2)   # what an override lets through
    tolerated = max(1, int(DEV_TEST_TOLERANCE * n["test"]))
    shared = dev_test > tolerated

    train_fact = (f"the train split has {distinct['train']:,} distinct prompts among its {n['train']:,} items"
                  + (f" ({removed:,} of {asked:,} removed as overlapping dev/test)" if removed else ""))
    share_fact = f"dev and test share {dev_test:,} of {n['test']:,} test prompts"
    if few or (shared and not allow_split_overlap):
        facts, overrides = [], []
        if few:
            bound = (f"task.min_distinct_train_prompts={min_distinct_train_prompts}"
                     if min_distinct_train_prompts <= asked / 2 else f"half the {asked:,} train items asked for")
            facts.append(f"{train_fact}, fewer than {bound}")
            overrides.append("task.min_distinct_train_prompts=0")
        if shared:
            facts.append(f"{share_fact}, more than the {tolerated} tolerated ({DEV_TEST_TOLERANCE:.0%} of the "
                         "test split)")
            overrides.append("task.allow_split_overlap=true")
        raise ConfigError(
            f"task {task.name}: {'; '.join(facts)}. Its problem space is too small for these splits (the warm-up "
            "would memorise the few distinct prompts): widen the generator's range in task.dataset_kwargs (e.g. a "
            "larger max_value), lower task.train_size / task.dev_size / task.test_size, or choose other split "
            "seeds (task.train_seed / dev_seed / test_seed); a local dataset needs more distinct prompts. To "
            f"train on it anyway, set {' and '.join(overrides)}")
    if few_by_default:
        print(f"warning: task {task.name}: {train_fact}; trained on anyway "
              f"(task.min_distinct_train_prompts={min_distinct_train_prompts})", file=sys.stderr, flush=True)
    if shared:
        print(f"warning: task {task.name}: {share_fact}; evaluated anyway (task.allow_split_overlap=true)",
              file=sys.stderr, flush=True)
    elif dev_test:
        log.warning("task %s: %d test prompts also appear in dev", task.name, dev_test)
    return {"distinct_prompts": distinct, "dev_test_overlap": dev_test}


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


def build_task(task_cfg: Any, cache_dir: str | None = None) -> Task:
    """The Task a ``task`` config section describes (all sources, plug-ins included).

    Every set (non-null) field except ``source`` and ``max_completion_tokens`` is offered to the
    factory, which receives the ones its signature names (all of them if it takes ``**kwargs``), except
    the split check's (`check_splits`, run on the built task). A factory whose signature names
    ``cache_dir`` gets the run's (what it converts or downloads stays under the run's cache, not ~/.cache).
    """
    from grpo_lab.schema import TaskConfig, as_dict

    fields = {k: v for k, v in as_dict(task_cfg).items() if v is not None}
    fields.pop("max_completion_tokens", None)
    gate = {k: fields.pop(k, getattr(TaskConfig, k)) for k in SPLIT_CHECK_FIELDS}
    # A registered source or a plug-in factory "package.module:function" (grpo_lab.registry).
    source = fields.pop("source", "reasoning_gym")
    if cache_dir is not None and "cache_dir" in inspect.signature(TASKS.get(source)).parameters:
        fields["cache_dir"] = str(cache_dir)
    task = TASKS.call(source, **fields)
    if not isinstance(task, Task):
        raise TypeError(f"task.source factory returned {type(task).__name__}, not a grpo_lab.tasks.Task")
    check_splits(task, **gate)   # distinct prompts per split: refused here, before any model is built
    return task
