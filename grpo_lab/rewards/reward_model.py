"""The rules of reward ``reward_model`` (registered by grpo_lab/second_models/learned_reward.py, where the models
live): learned reward models score each (prompt, completion); the proxy reward of RLHF.

The models are the directories in ``reward.reward_model.dirs`` (what ``python -m grpo_lab.train_reward_model``
writes, or what a run with ``reward=reward_model`` trains itself from the top-level ``reward_model`` section,
cached by content: grpo_lab/second_models/reward_model_training.py). Each is loaded once per process and kept
(frozen: nothing here steps an optimizer). A call scores the whole batch, ``batch_size`` rows a forward, then:

* **ensemble** of k members (Coste et al., "Reward Model Ensembles Help Mitigate Overoptimization", arXiv
  2310.02743 §3): ``mean``; ``min`` (worst-case optimisation, WCO); ``mean_minus_std`` (uncertainty-weighted
  optimisation, UWO: mean - λ·std over members, λ = ensemble_std_coef; population std as in their eq. 3).
* **normalisation**: ``none``; ``batch`` (z-score over the call's samples); ``group`` (z-score over the samples
  of each prompt, the group a GRPO step samples together). A running z-score across steps is the run-wide
  ``algorithm.reward_ema_decay``, which is checkpointed with the run.
* **clip**: the result clamped to [-clip, clip] (after normalising), as OpenRLHF's reward clip.

Per sample, ``info`` carries the raw score (the members' mean) and, for an ensemble, the members' std.
The gold scorer is separate: evaluation and ``reward/correct_frac`` always use the task's verifier, so proxy
(``reward/reward_model``, ``reward/mean``) and gold are different numbers in every log.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


NORMALIZATIONS = ("none", "batch", "group")
SCORING_DTYPES = ("fp32", "bf16")
ENSEMBLE_RULES = ("mean", "min", "mean_minus_std")


def combine_members(scores: Tensor, rule: str, std_coef: float = 1.0) -> Tensor:
    """[k, N] member scores -> [N]: mean, min, or mean - std_coef * std (population std over members)."""
    if rule == "mean":
        return scores.mean(0)
    if rule == "min":
        return scores.min(0).values
    if rule == "mean_minus_std":
        return scores.mean(0) - std_coef * scores.std(0, unbiased=False)
    raise ValueError(f"unknown ensemble rule {rule!r} ({', '.join(ENSEMBLE_RULES)})")


def _zscore(x: Tensor, eps: float = 1e-6) -> Tensor:
    return (x - x.mean()) / (x.std(unbiased=False) + eps) if len(x) > 1 else x - x.mean()


def normalize_scores(values: Tensor, how: str, groups: Sequence[Any] | None = None) -> Tensor:
    """[N] -> [N]: unchanged (none), one z-score over all (batch), or a z-score within each group label (group;
    a group of one becomes 0)."""
    if how == "none":
        return values
    if how == "batch":
        return _zscore(values)
    if how == "group":
        out = torch.empty_like(values)
        for label in dict.fromkeys(groups):
            idx = torch.tensor([i for i, g in enumerate(groups) if g == label])
            out[idx] = _zscore(values[idx])
        return out
    raise ValueError(f"unknown normalisation {how!r} ({', '.join(NORMALIZATIONS)})")


def check_reward_model_reward(rw: Any, errors: list[str], machine: bool = True) -> None:
    """reward.reward_model settings (the REWARDS `check` fact), before anything loads."""
    r = rw.reward_model
    if r.normalize not in NORMALIZATIONS:
        hint = " (a running z-score is algorithm.reward_ema_decay=0.99)" if r.normalize == "running" else ""
        errors.append(f"reward.reward_model.normalize={r.normalize!r} must be one of {', '.join(NORMALIZATIONS)}{hint}")
    if r.ensemble not in ENSEMBLE_RULES:
        errors.append(f"reward.reward_model.ensemble={r.ensemble!r} must be one of {', '.join(ENSEMBLE_RULES)}")
    if r.clip is not None and not r.clip > 0:
        errors.append(f"reward.reward_model.clip={r.clip} must be > 0 or null (no clamp)")
    if r.ensemble_std_coef < 0:
        errors.append(f"reward.reward_model.ensemble_std_coef={r.ensemble_std_coef} must be >= 0")
    if r.batch_size < 1:
        errors.append(f"reward.reward_model.batch_size={r.batch_size} must be >= 1")
    if r.dtype not in SCORING_DTYPES:
        errors.append(f"reward.reward_model.dtype={r.dtype!r} must be one of {', '.join(SCORING_DTYPES)}")
    if r.dirs is not None:
        if not r.dirs:
            errors.append("reward.reward_model.dirs=[] names no reward model; give directories or null (train one)")
        for d in r.dirs:
            if machine and not (Path(str(d)) / "config.json").is_file():
                errors.append(f"reward.reward_model.dirs names {d}, which holds no saved reward model (config.json); "
                              "train one with `python -m grpo_lab.train_reward_model` or set dirs=null")


__all__ = ["ENSEMBLE_RULES", "NORMALIZATIONS", "SCORING_DTYPES", "check_reward_model_reward", "combine_members",
           "normalize_scores"]
