"""Reward functions and their registry.

One signature for every reward (the ``REWARDS`` registry)::

    fn(completions: list[str], **fields: list) -> list[float]

Every field is a list aligned with ``completions``: always ``answer`` and ``solution`` (from the
``TaskItem``), plus every key of ``TaskItem.fields`` (``answer_format``; reasoning-gym items add
``rg_dataset``, ``rg_config``, ``rg_entry``). Functions take ``**_`` for fields they do not use.
Completions are the generated text only (no prompt), special tokens already stripped.

The final answer is read from a completion with the item's answer format
(:mod:`grpo_lab.rewards.answers`): the whole stripped completion for ``plain`` (compact tasks),
after the last ``####`` for ``hash`` (GSM8K-style worked solutions), inside the last
``<answer>...</answer>`` for ``tags``.

Note on ``correctness`` for reasoning-gym items: it is the generator's own scorer, which is NOT
always 0/1. Many scorers give partial credit when the reference is a substring of the answer
(chain_sum: oracle ``28``, answer ``280`` -> 2/3; ``-28`` -> 2/3), and some give 0.01 for any
wrong answer. ``correctness_binary`` is 1.0 exactly when ``correctness`` is 1.0, else 0.0 (the
"reward 1/0" of the calibration in shared/ENVIRONMENT.md); ``is_correct`` uses the same test.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

from grpo_lab.registry import Registry

from .answers import extract_answer

log = logging.getLogger(__name__)

REWARDS = Registry("reward")

# Keys compute_rewards passes itself; TaskItem.fields must not use them.
RESERVED_FIELDS = ("completions", "answer", "solution")


def _fmts(n: int, answer_format: Sequence[str | None] | None) -> list[str]:
    if answer_format is None:
        return ["plain"] * n
    return [f or "plain" for f in answer_format]


@functools.lru_cache(maxsize=64)
def _rg_scorer(name: str, config_json: str):
    """``score_answer`` of a reasoning-gym dataset built with the task's own config.

    Built from the task's dataset_kwargs rather than ``reasoning_gym.get_score_answer_fn(name)``
    (default config): some scorers read their config (puzzle24's value range, decimal_arithmetic's
    precision). size/seed do not affect scoring.
    """
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json)).score_answer


def _score_rg(name: str, config: dict | None, extracted: str | None, entry: dict) -> float:
    if extracted is None:
        return 0.0
    scorer = _rg_scorer(name, json.dumps(config or {}, sort_keys=True))
    try:
        score = float(scorer(extracted, entry))
    except Exception as e:  # a scorer crashing on odd model output is a wrong answer, not a crash
        log.debug("reasoning-gym %s scorer raised %r on %r", name, e, extracted)
        return 0.0
    return score if math.isfinite(score) else 0.0


@REWARDS.register("correctness")
def correctness(
    completions: list[str],
    *,
    answer: list[str],
    answer_format: list[str] | None = None,
    rg_dataset: list[str | None] | None = None,
    rg_config: list[dict | None] | None = None,
    rg_entry: list[dict | None] | None = None,
    **_: Any,
) -> list[float]:
    """The reasoning-gym scorer on the extracted answer when the item has an ``rg_entry``
    (may be fractional, see module docstring), else 1.0/0.0 exact match after stripping."""
    n = len(completions)
    fmts = _fmts(n, answer_format)
    out = []
    for i, c in enumerate(completions):
        ext = extract_answer(c, fmts[i])
        entry = rg_entry[i] if rg_entry is not None else None
        if entry is not None:
            name = rg_dataset[i] if rg_dataset is not None and rg_dataset[i] else entry["metadata"]["source_dataset"]
            out.append(_score_rg(name, rg_config[i] if rg_config is not None else None, ext, entry))
        else:
            out.append(1.0 if ext is not None and ext == str(answer[i]).strip() else 0.0)
    return out


@REWARDS.register("correctness_binary")
def correctness_binary(completions: list[str], **fields: Any) -> list[float]:
    """1.0 where ``correctness`` is exactly 1.0, else 0.0 (no partial credit)."""
    return [1.0 if r == 1.0 else 0.0 for r in correctness(completions, **fields)]


@REWARDS.register("math_verify")
def math_verify_reward(
    completions: list[str], *, answer: list[str], answer_format: list[str] | None = None, **_: Any
) -> list[float]:
    """1.0 if ``math_verify.verify(parse(answer), parse(extracted answer))`` else 0.0.

    Mathematical equivalence rather than string equality: ``0.5`` matches ``1/2`` and
    ``\\frac{1}{2}``, ``288.0`` matches ``288``, ``1,000`` matches ``1000``.
    """
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    fmts = _fmts(len(completions), answer_format)
    out = []
    for i, c in enumerate(completions):
        ext = extract_answer(c, fmts[i])
        if ext is None:
            out.append(0.0)
            continue
        try:
            gold = parse(str(answer[i]), parsing_timeout=timeout)
            pred = parse(ext, parsing_timeout=timeout)
            ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
        except Exception as e:
            log.debug("math_verify failed on %r vs %r: %r", ext, answer[i], e)
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


@REWARDS.register("format")
def format_reward(completions: list[str], *, answer_format: list[str] | None = None, **_: Any) -> list[float]:
    """1.0 if an answer can be extracted under the item's answer format, else 0.0.

    Meaningful for worked-solution formats (``hash``: a ``####`` line; ``tags``: an
    ``<answer>`` element); for ``plain`` it only says the completion is not blank.
    """
    fmts = _fmts(len(completions), answer_format)
    return [0.0 if extract_answer(c, fmts[i]) is None else 1.0 for i, c in enumerate(completions)]


def reward_fields(items: Sequence[Any]) -> dict[str, list]:
    """Field lists aligned with ``items``: ``answer``, ``solution`` and every ``TaskItem.fields`` key
    (``None`` where an item lacks a key another item has)."""
    keys: list[str] = []
    for it in items:
        for k in it.fields:
            if k not in keys:
                keys.append(k)
    bad = [k for k in keys if k in RESERVED_FIELDS]
    if bad:
        raise ValueError(f"TaskItem.fields must not use the reserved names {bad} ({RESERVED_FIELDS})")
    fields: dict[str, list] = {"answer": [it.answer for it in items], "solution": [it.solution for it in items]}
    for k in keys:
        fields[k] = [it.fields.get(k) for it in items]
    return fields


def compute_rewards(
    completions: list[str], items: Sequence[Any], specs: Sequence[tuple[str, float]]
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of registered rewards.

    ``items[i]`` is the ``TaskItem`` that ``completions[i]`` answers (repeat each item G times for
    a group of G samples). ``specs`` is ``[(reward name, weight), ...]``; each name at most once.
    Returns ``(total, per_reward)`` with ``total[i] = sum_k weight_k * per_reward[name_k][i]`` and
    ``per_reward`` holding the unweighted values.
    """
    n = len(completions)
    if len(items) != n:
        raise ValueError(f"{n} completions but {len(items)} items; pass one item per completion")
    specs = [(str(name), float(w)) for name, w in specs]
    if not specs:
        raise ValueError("no rewards given; list at least one (name, weight), e.g. [('correctness', 1.0)]")
    names = [s[0] for s in specs]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"rewards listed more than once: {dup}; give each reward one weight")
    fields = reward_fields(items)
    total = [0.0] * n
    per: dict[str, list[float]] = {}
    for name, w in specs:
        vals = [float(v) for v in REWARDS.get(name)(list(completions), **fields)]
        if len(vals) != n:
            raise RuntimeError(f"reward {name!r} returned {len(vals)} values for {n} completions")
        per[name] = vals
        total = [t + w * v for t, v in zip(total, vals)]
    return total, per


def is_correct(completion: str, item: Any) -> bool:
    """True when the ``correctness`` reward of ``completion`` for ``item`` is exactly 1.0."""
    return correctness([completion], **reward_fields([item]))[0] == 1.0
