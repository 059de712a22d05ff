"""The preferences a reward model learns from: ranked groups of completions, read from a file or made by
labelling a policy's samples with a gold scorer.

    RankedGroup(prompt, completions (best first), margin=None, source="file:line")
    read_preferences(path) -> [RankedGroup]                  one JSON object a line, refused line by line
    groups_from_scores(prompts, completions, gold, *, form, n, rng) -> [RankedGroup]
    swap_labels(groups, p, rng) -> ([RankedGroup], n swapped)  a noisy annotator

A line of a preference file is a pair, ``{"prompt": ..., "chosen": ..., "rejected": ...}`` with an optional
``"margin"`` (Llama 2's preference-strength margin, arXiv 2307.09288 eq. 2), or a ranked group,
``{"prompt": ..., "ranked": [best, ..., worst]}`` (Plackett-Luce; InstructGPT's K-way rankings, arXiv
2203.02155 §3.5) -- the field names of TRL's and OpenRLHF's preference datasets. Bad data is refused before any
model loads, each problem named by file and line: not JSON, a missing or non-string field, an empty completion,
a tie (chosen equal to rejected, or a ranking that repeats a completion), a non-finite margin.

Pairs made from samples follow the peers' recipe for synthetic preferences (AlpacaFarm, arXiv 2305.14387;
Gao et al.'s gold/proxy set-up, arXiv 2210.10760): G completions per prompt, a gold scorer, and every pair of
distinct completions whose gold scores differ is a candidate (the higher one chosen); ``n`` of them are drawn
at random, so the data's size is a knob. ``form="ranked"`` keeps one completion per distinct gold score, best
first (ties cannot be ranked).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from grpo_lab.schema import ConfigError


@dataclass(frozen=True)
class RankedGroup:
    """One prompt's completions, best first (a pair has two); `margin` only for pairs (None = none)."""

    prompt: str
    completions: tuple[str, ...]
    margin: float | None = None
    source: str = ""


def _line_problem(obj) -> str | None:
    """Why a parsed line is not a pair or a ranked group (None when it is one)."""
    if not isinstance(obj, dict):
        return "is not a JSON object"
    if not isinstance(obj.get("prompt"), str):
        return 'has no "prompt" string'
    if "ranked" in obj:
        ranked = obj["ranked"]
        if not isinstance(ranked, list) or len(ranked) < 2 or not all(isinstance(c, str) for c in ranked):
            return '"ranked" must be a list of at least two strings, best first'
        completions = ranked
    else:
        missing = [k for k in ("chosen", "rejected") if not isinstance(obj.get(k), str)]
        if missing:
            return "has no " + " or ".join(f'"{k}" string' for k in missing) + ' (or a "ranked" list)'
        completions = [obj["chosen"], obj["rejected"]]
        margin = obj.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not math.isfinite(margin)):
            return f'"margin" must be a finite number, not {margin!r}'
    if any(not c.strip() for c in completions):
        return "has an empty completion"
    if len(set(completions)) < len(completions):
        return "is a tie: the same completion is ranked twice (chosen equal to rejected)"
    return None


def read_preferences(path: str | Path) -> list[RankedGroup]:
    """Every line of the JSONL file `path` as a RankedGroup; ConfigError naming each bad line (up to 10)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"reward_model.data.path={path}: no such file; point it at a JSONL file of "
                          '{"prompt", "chosen", "rejected"} lines')
    groups, problems = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{number}: not JSON ({e.msg})")
                continue
            problem = _line_problem(obj)
            if problem:
                problems.append(f"{path}:{number}: {problem}")
                continue
            completions = tuple(obj["ranked"]) if "ranked" in obj else (obj["chosen"], obj["rejected"])
            margin = obj.get("margin")
            groups.append(RankedGroup(obj["prompt"], completions, None if margin is None else float(margin),
                                      f"{path}:{number}"))
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise ConfigError(f"{len(problems)} bad line(s) in the preference file; fix or remove them:\n  - "
                          + "\n  - ".join(shown))
    if not groups:
        raise ConfigError(f"reward_model.data.path={path} holds no preferences")
    return groups


def groups_from_scores(prompts: Sequence[str], completions: Sequence[Sequence[str]],
                       gold: Sequence[Sequence[float]], *, form: str, n: int, rng: random.Random,
                       margin_scale: float = 0.0) -> list[RankedGroup]:
    """Up to `n` ranked groups from each prompt's sampled completions and their gold scores.

    form="pairs": every pair of distinct texts with different gold scores is a candidate (higher gold chosen,
    margin = margin_scale x the gold difference when margin_scale > 0); `n` are drawn uniformly from all
    prompts' candidates. form="ranked": per prompt, one text for each distinct gold score (the first sampled),
    best first, when there are at least two; `n` prompts' groups drawn.
    """
    candidates: list[RankedGroup] = []
    for prompt, texts, scores in zip(prompts, completions, gold):
        best: dict[str, float] = {}
        for t, s in zip(texts, scores):   # one score per distinct text (a scorer is a function of the text)
            best.setdefault(t, float(s))
        distinct = list(best.items())
        if form == "ranked":
            by_score: dict[float, str] = {}
            for t, s in distinct:
                by_score.setdefault(s, t)
            if len(by_score) >= 2:
                candidates.append(RankedGroup(prompt, tuple(by_score[s] for s in sorted(by_score, reverse=True))))
            continue
        for i, (ti, si) in enumerate(distinct):
            for tj, sj in distinct[i + 1:]:
                if si == sj:
                    continue
                (tw, sw), (tl, sl) = ((ti, si), (tj, sj)) if si > sj else ((tj, sj), (ti, si))
                candidates.append(RankedGroup(prompt, (tw, tl), margin_scale * (sw - sl) if margin_scale else None))
    if len(candidates) > n:
        candidates = rng.sample(candidates, n)
    return candidates


def swap_labels(groups: Sequence[RankedGroup], p: float, rng: random.Random) -> tuple[list[RankedGroup], int]:
    """Each group's order reversed with probability `p` (a pair's chosen and rejected swapped): an annotator
    who errs at rate p; the margin stays. Returns the groups and how many were swapped."""
    out, swapped = [], 0
    for g in groups:
        if p > 0 and rng.random() < p:
            out.append(replace(g, completions=tuple(reversed(g.completions))))
            swapped += 1
        else:
            out.append(g)
    return out, swapped
