"""Reward shaping, group filtering and small schedules: DAPO's parts (arXiv 2503.14476) and tricks.

Pure functions: rewards / lengths / group ids in, tensors (or plain floats for state) out.

Choices the papers leave open:

* ``informative_group_mask`` / ``group_stats`` call rewards "equal" within ``REWARD_ATOL`` (the
  advantage estimators' own test, ``_utils.constant_groups``) so continuous rewards work; DAPO's
  dynamic sampling (sec. 3.2) is stated for exact 0/1 accuracy.
* ``group_stats``'s ``group_reward_std`` uses the unbiased std (as ``group_zscore``) and counts a
  size-1 group as std 0.
* ``ema_reward_normalize`` is a descriptive trick, not a paper: EMA of the batch mean and the
  batch (population) variance, then (r - mean) / sqrt(var + eps) with the updated statistics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._utils import constant_groups, group_index, group_mean_std, group_range, work_dtype


def soft_overlong_penalty(
    lengths: Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), scaled by ``penalty``.

        R(y) = 0                                        if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache      if L_max - L_cache < |y| <= L_max
             = -1                                       if L_max < |y|

    The penalty falls linearly from 0 to -1 over the last L_cache tokens of the budget. Since
    generation stops at L_max, |y| <= L_max in practice and the last branch only guards
    oddities; |y| = L_max (a truncated answer) already gets -1 from the middle branch.
    Added to the task reward by the caller.

    Shapes: lengths LongTensor [N] (completion tokens) -> penalty [N] float32, in [-penalty, 0].
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    length = lengths.to(torch.float32)
    expected = float(max_len - buffer_len)  # L_max - L_cache
    inside = (expected - length) / buffer_len  # in [-1, 0) inside the buffer
    out = torch.where(length <= expected, torch.zeros_like(length), inside)
    out = torch.where(length > max_len, torch.full_like(length, -1.0), out)
    return out * penalty


def _grouped(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (rewards in their work dtype [N], inverse [N], counts [G]); both inputs must be [N]."""
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    inverse, counts = group_index(group_ids)
    return rewards.to(work_dtype(rewards)), inverse, counts


def informative_group_mask(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Sequences whose group's rewards do not all agree (DAPO dynamic sampling, sec. 3.2).

    A group where every reward is equal (all right, all wrong) has zero group-relative advantage
    and contributes no gradient, only noise in the batch size; dynamic sampling drops it. Rewards
    agree when max - min <= REWARD_ATOL (the estimators' test). A size-1 group always agrees.

    Shapes: rewards [N], group_ids [N] -> BoolTensor [N] (True = keep).
    """
    r, inverse, counts = _grouped(rewards, group_ids)
    return ~constant_groups(r, inverse, counts.numel())[inverse]


def group_stats(rewards: Tensor, group_ids: Tensor) -> dict[str, Tensor]:
    """Group diagnostics: ``zero_adv_group_frac`` (fraction of groups whose rewards all agree
    within REWARD_ATOL) and ``group_reward_std`` (mean over groups of the unbiased within-group std; a
    size-1 group counts as 0).

    Shapes: rewards [N], group_ids [N] -> dict of scalar tensors.
    """
    r, inverse, counts = _grouped(rewards, group_ids)
    constant = constant_groups(r, inverse, counts.numel())
    _, std = group_mean_std(r, inverse, counts)  # [G]; 0 for size 1 (0 / 1)
    return {
        "zero_adv_group_frac": constant.to(r.dtype).mean(),
        "group_reward_std": std.mean(),
    }


def best_of_group_mask(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Exactly one True per group, at its highest reward (ties -> lowest index).

    Selects the samples for the best-of-group supervised anchor (an SFT loss on each group's
    best completion, a trick rather than a paper's algorithm).

    Shapes: rewards [N], group_ids [N] -> BoolTensor [N].
    """
    r, inverse, counts = _grouped(rewards, group_ids)
    g = counts.numel()
    _, hi = group_range(r, inverse, g)
    n = r.numel()
    index = torch.arange(n, device=r.device)
    candidate = torch.where(r == hi[inverse], index, torch.full_like(index, n))  # [N]
    first = torch.full((g,), n, dtype=index.dtype, device=r.device).scatter_reduce(
        0, inverse, candidate, "amin", include_self=True
    )  # [G] lowest index attaining the max
    return index == first[inverse]


def ema_reward_normalize(
    rewards: Tensor,
    mean: float,
    var: float,
    count: int,
    *,
    decay: float,
    eps: float = 1e-8,
) -> tuple[Tensor, float, float, int]:
    """Running (EMA) reward normalisation; pure: the state goes in and comes out.

        m_b, v_b = mean(r), var(r)                         (population variance of this batch)
        mean'    = m_b, var' = v_b                         if count == 0 (first call)
        mean'    = decay * mean + (1 - decay) * m_b        otherwise; likewise var'
        r_norm   = (r - mean') / sqrt(var' + eps)

    Keeps the reward scale steady across training when rewards drift (a trick, no paper).

    Shapes: rewards [N] -> (normalized [N], new_mean, new_var, new_count = count + N).
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    r = rewards.to(work_dtype(rewards))
    if r.numel() == 0:
        return r.clone(), float(mean), float(var), int(count)
    batch_mean = r.mean().item()
    batch_var = r.var(unbiased=False).item()
    if count == 0:
        new_mean, new_var = batch_mean, batch_var
    else:
        new_mean = decay * mean + (1.0 - decay) * batch_mean
        new_var = decay * var + (1.0 - decay) * batch_var
    normalized = (r - new_mean) / math.sqrt(new_var + eps)
    return normalized, float(new_mean), float(new_var), int(count) + r.numel()


def linear_warmup(step: int, warmup_steps: int, final_value: float) -> float:
    """Linear ramp from 0 at step 0 to final_value at step >= warmup_steps (e.g. a KL or aux-loss
    coefficient). warmup_steps <= 0 means no warmup."""
    if warmup_steps <= 0:
        return float(final_value)
    return float(final_value) * min(max(step, 0) / warmup_steps, 1.0)
