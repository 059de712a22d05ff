"""Preference losses: DPO (arXiv 2305.18290) and its group-wise variant ("group_dpo").

group_dpo turns each group of G sampled completions with scalar rewards into every ordered pair
(better, worse) of that group and applies the DPO loss to the pairs, optionally weighting each
pair by the Bradley-Terry probability that the better one is preferred, sigma(r_i - r_j). This
is our composition (pairs from RL-style groups), not a separate paper's algorithm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._utils import as_bool_mask


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Preference Optimization loss (Rafailov et al., arXiv 2305.18290, eq. 7).

        h = beta * [(log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))]
        L = mean_p -log sigma(h_p)          (sum_p w_p L_p / sum_p w_p with weights)

    Sequence log-probs are sums of token log-probs over the completion. Metrics (detached,
    unweighted means over pairs): chosen_reward = beta (log pi - log ref)(y_c), rejected_reward,
    reward_margin = chosen - rejected, reward_accuracy = fraction of pairs with margin > 0.
    With zero pairs the loss is 0 (still attached to the graph) and metrics are 0.

    Shapes: the four log-prob tensors and weights [P] -> (loss scalar, metrics).
    """
    shapes = {
        tuple(t.shape)
        for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    }
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"DPO log-probs must all be [P], got shapes {shapes}")
    chosen_reward = beta * (policy_chosen_logps - ref_chosen_logps)  # [P]
    rejected_reward = beta * (policy_rejected_logps - ref_rejected_logps)  # [P]
    margin = chosen_reward - rejected_reward  # [P]
    losses = -F.logsigmoid(margin)  # [P]; logsigmoid is stable for large |margin|
    w = torch.ones_like(losses) if weights is None else weights.to(losses.dtype)
    if w.shape != losses.shape:
        raise ValueError(f"weights must have shape {tuple(losses.shape)}, got {tuple(w.shape)}")
    loss = (w * losses).sum() / w.sum().clamp(min=torch.finfo(losses.dtype).tiny)
    p = max(margin.numel(), 1)
    metrics = {
        "reward_accuracy": (margin > 0).to(losses.dtype).sum().detach() / p,
        "reward_margin": margin.sum().detach() / p,
        "chosen_reward": chosen_reward.sum().detach() / p,
        "rejected_reward": rejected_reward.sum().detach() / p,
    }
    return loss, metrics


def group_preference_pairs(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    bt_weighting: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """All ordered (chosen, rejected) pairs within each group, for group-wise DPO.

        pairs = {(i, j) : group_i == group_j, r_i > r_j}        (ties give no pair)
        w_ij  = sigma(r_i - r_j) if bt_weighting else 1          (Bradley-Terry confidence)

    Pairs come in row-major order of (i, j). A group of G distinct rewards gives G(G-1)/2 pairs.

    Shapes: rewards [N], group_ids [N] -> (chosen_idx LongTensor [P], rejected_idx LongTensor [P],
    weights [P] float).
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    same_group = group_ids[:, None] == group_ids[None, :]  # [N, N]
    better = r[:, None] > r[None, :]  # [N, N]; strict, so ties and i == j give no pair
    chosen, rejected = torch.nonzero(same_group & better, as_tuple=True)  # [P], [P]
    if bt_weighting:
        weights = torch.sigmoid(r[chosen] - r[rejected])
    else:
        weights = torch.ones(chosen.shape, dtype=r.dtype, device=r.device)
    return chosen, rejected, weights


def sequence_logps(token_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Sequence log-prob log pi(y|x) = sum of real-token log-probs. [N, T] -> [N]."""
    mask = as_bool_mask(response_mask)
    return torch.where(
        mask, token_logprobs, torch.zeros((), dtype=token_logprobs.dtype, device=token_logprobs.device)
    ).sum(-1)


def best_worst_pairs(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One (chosen, rejected) pair per group: its highest- and lowest-reward sequence (first index on
    ties); groups whose rewards all agree give no pair. This is how DPO is run on the policy's own
    scored groups (on-policy / "online" DPO); group_preference_pairs uses every ordered pair instead.

    Shapes: rewards [N], group_ids [N] -> (chosen_idx [P], rejected_idx [P], weights [P] = 1).
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError("rewards and group_ids must both be [N]")
    chosen, rejected = [], []
    for g in torch.unique(group_ids, sorted=True).tolist():
        idx = torch.nonzero(group_ids == g).flatten()         # [G] positions of this group
        r = rewards[idx]
        best, worst = idx[torch.argmax(r)], idx[torch.argmin(r)]
        if r.max() > r.min():
            chosen.append(int(best))
            rejected.append(int(worst))
    c = torch.tensor(chosen, dtype=torch.long)
    return c, torch.tensor(rejected, dtype=torch.long), torch.ones(c.shape, dtype=torch.float32)
