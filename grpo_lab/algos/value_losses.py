"""Critic (value-function) loss for PPO with GAE (arXiv 1707.06347).

Follows OpenAI baselines' ``ppo2``: the new value prediction is clipped to within ``clip`` of the
value at rollout time and the larger (pessimistic) of the two squared errors is taken. This is not
in the PPO paper's equations; it is the implementation detail every PPO code base copies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core import as_bool_mask, masked_mean


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped value loss.

        V_clip = V_old + clip(V - V_old, -clip, clip)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Shapes: values (with grad), old_values, returns, response_mask [N, T]
    -> (loss_mat [N, T], 0 on masked positions; metrics {"value_clip_frac": fraction of real
    tokens where the clipped error is the larger one, i.e. the one that is used}).
    """
    if clip < 0:
        raise ValueError(f"value clip must be >= 0, got {clip}")
    shapes = {tuple(t.shape) for t in (values, old_values, returns, response_mask)}
    if len(shapes) != 1:
        raise ValueError("values, old_values, returns and response_mask must share one [N, T] shape")
    mask = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    v_old = torch.where(mask, old_values.to(values.dtype), zero)
    ret = torch.where(mask, returns.to(values.dtype), zero)
    v_clipped = v_old + (v - v_old).clamp(-clip, clip)
    err_unclipped = (v - ret) ** 2
    err_clipped = (v_clipped - ret) ** 2
    loss = torch.where(mask, 0.5 * torch.maximum(err_unclipped, err_clipped), zero)
    clipped = err_clipped > err_unclipped
    return loss, {"value_clip_frac": masked_mean(clipped.to(values.dtype), mask).detach()}
