"""Task source ``reasoning_gym``: any procedural generator from the ``reasoning-gym`` package.

reasoning-gym item ``i`` of a dataset created with ``seed=s`` is generated from
``random.Random(s + i)``, so two datasets share items whenever their seed ranges
``[s, s + size)`` overlap. Train, dev and test therefore get widely separated seeds (checked), and
train items whose prompt still collides with a dev/test prompt (small problem spaces produce
repeats by chance) are removed.

Prompt formats:
  ``question``: the generator's own question text, e.g. chain_sum
      ``State the final answer to the following arithmetic problem: 15 - 43 =``.
  ``compact``: a short form for tiny character-level models; defined for generators whose
      entries carry ``metadata["expression"]`` (chain_sum, basic_arithmetic, products): the expression
      with its spaces removed followed by ``=``, e.g. ``15-43=`` (answer ``-28``), ``123*456=``.
  ``partial_sums`` (chain_sum): the compact prompt, answered with the running total after each
      term, e.g. ``12+34-5=`` -> ``46,41``. A long answer whose length grows with the number of
      terms (set ``min_terms`` < ``max_terms``), so a completion budget can bind and wrong answers
      can differ in length from right ones: the task family where DAPO's overlong shaping,
      token-level loss and Dr.GRPO's length bias have something to act on. Scored by
      exact match of the whole list (the item carries no reasoning-gym entry, whose scorer would
      read only the final sum).

The tiny model's default task (conf/task/chain_sum.yaml), which it learns in minutes on a CPU, is
``name=chain_sum, dataset_kwargs={min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2},
prompt_format=compact``. Note chain_sum draws every term >= 0 unless ``allow_negation=True``;
only the result can be negative.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from grpo_lab.rewards.answers import check_answer_format, format_solution
from grpo_lab.schema import TaskConfig

from .base import SPLITS, TASKS, Task, TaskItem, remove_train_overlap


def _expression_compact(entry: dict[str, Any]) -> str:
    return entry["metadata"]["expression"].replace(" ", "") + "="


def running_sums(expression: str) -> str:
    """A chain_sum expression's running totals after each added term, comma-separated:
    "12 + 34 - 5" -> "46,41" (terms may be negative: "3 - -8" -> "11")."""
    tokens = expression.split()
    total, sums = int(tokens[0]), []
    for op, term in zip(tokens[1::2], tokens[2::2]):
        total = total + int(term) if op == "+" else total - int(term)
        sums.append(str(total))
    return ",".join(sums)


# generator name -> entry -> compact prompt
COMPACT_FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "chain_sum": _expression_compact,
    "basic_arithmetic": _expression_compact,
    "products": _expression_compact,
}
# prompt format -> generator name -> entry -> (prompt, answer): forms that also rewrite the answer.
REWRITTEN_FORMATS: dict[str, dict[str, Callable[[dict[str, Any]], tuple[str, str]]]] = {
    "partial_sums": {"chain_sum": lambda e: (_expression_compact(e), running_sums(e["metadata"]["expression"]))},
}
PROMPT_FORMATS = ("question", "compact", *REWRITTEN_FORMATS)


def _plain(x: Any) -> Any:
    """Hydra DictConfig/ListConfig (or any mapping/sequence) -> plain dict/list, recursively."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or (hasattr(x, "__iter__") and type(x).__name__ == "ListConfig"):
        return [_plain(v) for v in x]
    return x


def generator_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_generator(name: str) -> None:
    names = generator_names()
    if name in names:
        return
    close = difflib.get_close_matches(str(name), names, n=5, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown reasoning-gym generator {name!r}.{hint} {len(names)} are available, e.g. "
        f"{', '.join(names[:12])}, ... (full list: reasoning_gym.factory.DATASETS)"
    )


def generator_kwargs(name: str) -> list[str]:
    """The dataset_kwargs generator ``name`` accepts (its config dataclass's fields, less size/seed)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("size", "seed")]


def check_dataset_kwargs(name: str, dataset_kwargs: Mapping[str, Any]) -> None:
    """Raise (naming ``task.dataset_kwargs``) when a key is not a setting of generator ``name``.

    The usual cause: ``task.name=gcd`` keeps chain_sum's dataset_kwargs, and
    ``task.dataset_kwargs={}`` does not clear them (Hydra merges a dict override into the dict).
    """
    check_generator(name)
    valid = generator_kwargs(name)
    unknown = sorted(set(dataset_kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"task.dataset_kwargs has {unknown}, which reasoning-gym generator {name!r} does not take "
            f"(Valid dataset_kwargs for {name}: {', '.join(valid)}). Left over from another task? Switch tasks with task=<file> "
            f"(conf/task/*.yaml, each with its own dataset_kwargs, e.g. task={name} if that file exists); "
            f"task.name=... keeps the old kwargs and task.dataset_kwargs={{}} merges rather than "
            f"replaces, so remove each with ~task.dataset_kwargs.<key>. If task={name} was given, a recipe "
            f"(experiment=...) sets task.dataset_kwargs, which merge into every task: move them into a conf/task file"
        )


def make_rg_dataset(name: str, size: int, seed: int, dataset_kwargs: dict[str, Any]):
    """``reasoning_gym.create_dataset`` with config errors turned into messages that say what to change."""
    import dataclasses

    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    check_dataset_kwargs(name, dataset_kwargs)
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **dataset_kwargs)
    except (TypeError, AssertionError) as e:
        cfg_cls = DATASETS[name][1]
        valid = [f.name for f in dataclasses.fields(cfg_cls) if f.name not in ("size", "seed")]
        raise ValueError(
            f"reasoning-gym rejected task.dataset_kwargs {dataset_kwargs} for {name!r}: {e or type(e).__name__}. "
            f"Valid dataset_kwargs for {name}: {', '.join(valid)}"
        ) from e


# The config's split seeds (grpo_lab.schema.TaskConfig), which check_seed_ranges' advice cites: read from
# the schema, so a change of its defaults cannot leave the advice behind.
_DEFAULT_SEEDS = ", ".join(f"task.{s}_seed={getattr(TaskConfig, f'{s}_seed')}" for s in ("train", "dev", "test"))


def check_seed_ranges(sizes: dict[str, int], seeds: dict[str, int]) -> None:
    """Raise unless the item-seed ranges ``[seed, seed + size)`` of the splits are disjoint."""
    ranges = {s: (seeds[s], seeds[s] + sizes[s]) for s in SPLITS if sizes[s] > 0}
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (a0, a1), (b0, b1) = ranges[a], ranges[b]
            if a0 < b1 and b0 < a1:
                raise ValueError(
                    f"{a}_seed={a0} and {b}_seed={b0} are too close for {a}_size={sizes[a]} and "
                    f"{b}_size={sizes[b]}: reasoning-gym seeds item i with seed+i, so seeds "
                    f"[{a0}, {a1}) and [{b0}, {b1}) overlap and the splits would share items. "
                    f"Move the seeds more than the split sizes apart (defaults: {_DEFAULT_SEEDS})."
                )


def check_reasoning_gym(t: Any, errors: list[str]) -> None:
    """task.source=reasoning_gym settings: prompt format, generator kwargs, non-overlapping seed ranges."""
    if t.prompt_format not in PROMPT_FORMATS:
        errors.append(f"task.prompt_format={t.prompt_format!r}; valid choices: {', '.join(PROMPT_FORMATS)}")
    elif t.prompt_format == "compact" and t.name not in COMPACT_FORMATS:
        errors.append(f"task.prompt_format=compact is not defined for task.name={t.name!r} (only for "
                      f"{', '.join(sorted(COMPACT_FORMATS))}): set task.prompt_format=question")
    elif t.prompt_format in REWRITTEN_FORMATS and t.name not in REWRITTEN_FORMATS[t.prompt_format]:
        errors.append(f"task.prompt_format={t.prompt_format} is not defined for task.name={t.name!r} (only for "
                      f"{', '.join(sorted(REWRITTEN_FORMATS[t.prompt_format]))}): set task.prompt_format=question")
    kwargs = dict(t.dataset_kwargs or {})
    clash = sorted({"size", "seed"} & set(kwargs))
    if clash:
        errors.append(f"task.dataset_kwargs must not set {clash}: use task.train_size/dev_size/test_size and "
                      "task.train_seed/dev_seed/test_seed")
    try:
        check_dataset_kwargs(str(t.name), {k: v for k, v in kwargs.items() if k not in clash})
    except ValueError as e:
        msg = str(e)
        errors.append(msg if msg.startswith("task.") else f"task.name: {msg}")
    sizes = {s: int(t[f"{s}_size"] or 0) for s in ("train", "dev", "test")}
    seeds = {s: int(t[f"{s}_seed"]) for s in ("train", "dev", "test")}
    try:
        check_seed_ranges({k: max(v, 0) for k, v in sizes.items()}, seeds)
    except ValueError as e:
        errors.append(f"task.*_seed: {e}")


@TASKS.register("reasoning_gym", check=check_reasoning_gym)
def reasoning_gym_task(
    *,
    name: str,
    dataset_kwargs: Mapping[str, Any] | None = None,
    train_size: int = 10000,
    dev_size: int = 200,
    test_size: int = 200,
    train_seed: int = 0,
    dev_seed: int = 1_000_000,
    test_seed: int = 2_000_000,
    prompt_format: str = "question",
    answer_format: str | None = None,
    prompt_template: str = "{prompt}",
) -> Task:
    """Build train/dev/test from the reasoning-gym generator ``name``.

    ``dataset_kwargs`` go to ``reasoning_gym.create_dataset(name, size=, seed=, **dataset_kwargs)``.
    ``answer_format`` (plain | hash | tags, see grpo_lab.rewards.answers) defaults to ``hash`` when
    the generator provides worked solutions (``metadata["answer_cot"]``, e.g. gsm_symbolic) and
    the prompt format is ``question``, else ``plain``. ``prompt_template`` wraps the prompt
    (``{prompt}`` is replaced), e.g. to append an instruction for an instruct model.
    """
    kw = _plain(dict(dataset_kwargs or {}))
    clash = sorted({"size", "seed"} & set(kw))
    if clash:
        raise ValueError(
            f"dataset_kwargs must not set {clash}: use train_size/dev_size/test_size and "
            "train_seed/dev_seed/test_seed"
        )
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt_format {prompt_format!r}; valid choices: {', '.join(PROMPT_FORMATS)}")
    check_dataset_kwargs(name, kw)  # before any item is generated
    rewrite = REWRITTEN_FORMATS.get(prompt_format, {})
    if prompt_format in REWRITTEN_FORMATS and name not in rewrite:
        raise ValueError(f"prompt_format {prompt_format!r} is defined only for {', '.join(sorted(rewrite))}; "
                         "use prompt_format=question")
    if prompt_format == "compact" and name not in COMPACT_FORMATS:
        raise ValueError(
            f"prompt_format 'compact' is not defined for generator {name!r}; it is defined for "
            f"{', '.join(sorted(COMPACT_FORMATS))}. Use prompt_format=question, or add a compact "
            "form to grpo_lab.tasks.reasoning_gym_source.COMPACT_FORMATS"
        )
    if "{prompt}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
    sizes = {"train": int(train_size), "dev": int(dev_size), "test": int(test_size)}
    seeds = {"train": int(train_seed), "dev": int(dev_seed), "test": int(test_seed)}
    if sizes["train"] < 1 or sizes["dev"] < 0 or sizes["test"] < 0:
        raise ValueError(f"need train_size >= 1 and dev_size, test_size >= 0; got {sizes}")
    check_seed_ranges(sizes, seeds)

    fmt = answer_format
    splits: dict[str, list[TaskItem]] = {}
    for split in SPLITS:
        if sizes[split] == 0:
            splits[split] = []
            continue
        ds = make_rg_dataset(name, sizes[split], seeds[split], kw)
        items = []
        for i in range(sizes[split]):
            entry = ds[i]
            worked = entry.get("metadata", {}).get("answer_cot")
            if fmt is None:  # decided once, from the first entry
                fmt = "hash" if (worked and prompt_format == "question") else "plain"
            check_answer_format(fmt)
            fields = {"answer_format": fmt, "rg_dataset": name, "rg_config": kw, "rg_entry": entry}
            if name in rewrite:   # the answer is ours, not the generator's: exact match, no rg scorer
                raw, answer = rewrite[name](entry)
                fields = {"answer_format": fmt}
            else:
                raw = COMPACT_FORMATS[name](entry) if prompt_format == "compact" else entry["question"]
                answer = str(entry["answer"])
            solution = format_solution(answer, fmt, worked if fmt != "plain" else None)
            items.append(TaskItem(prompt=prompt_template.replace("{prompt}", raw), answer=answer, solution=solution,
                                  fields=fields))
        splits[split] = items

    overlap = remove_train_overlap(splits, name)
    info = {
        "source": "reasoning_gym",
        "generator": name,
        "dataset_kwargs": kw,
        "prompt_format": prompt_format,
        "answer_format": fmt,
        # Left to the source and plain on question-form prompts: grpo_lab.prompts.adapt_answer_format
        # reads such answers with boxed_or_last when the model answers through a chat template.
        "answer_format_defaulted": answer_format is None and fmt == "plain" and prompt_format == "question",
        "seeds": seeds,
        "sizes_requested": sizes,
        "sizes": {s: len(v) for s, v in splits.items()},
        **overlap,
    }
    return Task(name=name, splits=splits, info=info)
