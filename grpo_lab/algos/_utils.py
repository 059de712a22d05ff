"""Small masked / grouped tensor helpers shared by the algos modules (private)."""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped to this range before exp() (verl clamps to [-20, 20] too): e^20 ~ 5e8
# is far beyond any clip range, so the clamp only changes values that would otherwise overflow.
LOG_RATIO_CLAMP = 20.0


def as_bool_mask(mask: Tensor) -> Tensor:
    """[...] float/bool mask -> bool mask (nonzero = real token)."""
    return mask if mask.dtype == torch.bool else mask != 0


def work_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, ints) is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over True positions of the bool mask; masked values never reach the result."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over True positions; 0 when the mask is empty (never NaN)."""
    n = mask.sum().clamp(min=1).to(x.dtype)
    return masked_sum(x, mask) / n


def masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over True positions of the mask, zeros elsewhere.

    x: [N, T], mask: bool [N, T] -> [N, T]. std is the unbiased (Bessel) one, as verl's
    ``masked_whiten``; with fewer than two real tokens the centred value is 0 anyway and std is
    treated as 1.
    """
    n = mask.sum().to(x.dtype)
    mean = masked_sum(x, mask) / n.clamp(min=1)
    centred = torch.where(mask, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = (centred**2).sum() / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), torch.ones_like(var))
    return centred / (std + eps)


def group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """group_ids LongTensor[N] (any ids) -> (inverse LongTensor[N] in [0, G), counts LongTensor[G])."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must have shape [N], got {tuple(group_ids.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """x [N] -> per-group sums [G]."""
    return x.new_zeros(num_groups).index_add_(0, inverse, x)


def group_range(x: Tensor, inverse: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """x [N] -> (per-group min [G], per-group max [G])."""
    lo = x.new_zeros(num_groups).scatter_reduce(0, inverse, x, "amin", include_self=False)
    hi = x.new_zeros(num_groups).scatter_reduce(0, inverse, x, "amax", include_self=False)
    return lo, hi


# Rewards of one group "agree" when max - min <= REWARD_ATOL: one definition for the advantage
# estimators (agreeing groups get advantage exactly 0) and for dynamic sampling / group statistics
# (agreeing groups carry no signal). Tolerant rather than exact, so continuous rewards whose
# differences are float noise are not turned into large z-scores.
REWARD_ATOL = 1e-6


def constant_groups(x: Tensor, inverse: Tensor, num_groups: int, atol: float = REWARD_ATOL) -> Tensor:
    """x [N] -> BoolTensor [G]: True where the group's values agree within ``atol`` (size 1 always agrees)."""
    lo, hi = group_range(x, inverse, num_groups)
    return (hi - lo) <= atol


def group_mean_std(x: Tensor, inverse: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """x [N] -> (per-group mean [G], per-group unbiased std [G]); std is NaN-free: 0 for size 1."""
    g = counts.numel()
    c = counts.to(x.dtype)
    mean = group_sum(x, inverse, g) / c
    var = group_sum((x - mean[inverse]) ** 2, inverse, g) / (c - 1).clamp(min=1)
    return mean, var.sqrt()
