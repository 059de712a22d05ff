"""Preference math: losses on (chosen, rejected) pairs, and ways to form pairs from scored groups.

Two registries:

    PREFERENCE_LOSSES  dpo (arXiv 2305.18290; cDPO with label_smoothing), ipo (arXiv 2310.12036),
                       rdpo (arXiv 2403.00409)
        fn(policy_chosen_logps [P], policy_rejected_logps [P], ref_chosen_logps [P],
           ref_rejected_logps [P], *, beta, weights [P] | None, <settings it reads>) -> (loss, metrics)
    PAIRINGS           best_worst, all_pairs
        fn(rewards [N], group_ids [N], *, <settings it reads, e.g. bt_weighting>)
           -> (chosen_idx [P], rejected_idx [P], weights [P])

"group DPO" is the composition all_pairs + dpo: every ordered pair (better, worse) of a group of G
sampled completions, optionally weighted by the Bradley-Terry probability that the better one is
preferred, sigma(r_i - r_j). It is our composition (pairs from RL-style groups), not a paper's
algorithm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_lab.registry import Registry

from .core import REWARD_ATOL, as_bool_mask

PREFERENCE_LOSSES = Registry("preference loss")
PAIRINGS = Registry("preference pairing")


def _check_pair_logps(*logps: Tensor) -> None:
    shapes = {tuple(t.shape) for t in logps}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"preference log-probs must all be [P], got shapes {shapes}")


def _beta_log_ratios(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
                     ref_rejected_logps: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """[P] x 4 -> (beta (log pi - log ref)(y_c), beta (log pi - log ref)(y_r)), each [P]: DPO's implicit rewards."""
    _check_pair_logps(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return beta * (policy_chosen_logps - ref_chosen_logps), beta * (policy_rejected_logps - ref_rejected_logps)


def _weighted_mean(losses: Tensor, weights: Tensor | None) -> Tensor:
    """sum_p w_p L_p / sum_p w_p (plain mean without weights); 0 for P = 0, still on the graph."""
    w = torch.ones_like(losses) if weights is None else weights.to(losses.dtype)
    if w.shape != losses.shape:
        raise ValueError(f"weights must have shape {tuple(losses.shape)}, got {tuple(w.shape)}")
    return (w * losses).sum() / w.sum().clamp(min=torch.finfo(losses.dtype).tiny)


def _implicit_reward_metrics(chosen_reward: Tensor, rejected_reward: Tensor) -> dict[str, Tensor]:
    """Detached means over pairs of beta-scaled log-ratios: chosen_reward, rejected_reward, reward_margin
    (chosen - rejected) and reward_accuracy (fraction of pairs with margin > 0); 0 with no pairs."""
    margin = chosen_reward - rejected_reward
    p = max(margin.numel(), 1)
    return {
        "reward_accuracy": (margin > 0).to(margin.dtype).sum().detach() / p,
        "reward_margin": margin.sum().detach() / p,
        "chosen_reward": chosen_reward.sum().detach() / p,
        "rejected_reward": rejected_reward.sum().detach() / p,
    }


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    weights: Tensor | None = None,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Preference Optimization loss (Rafailov et al., arXiv 2305.18290, eq. 7).

        h = beta * [(log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))]
        L = mean_p -log sigma(h_p)          (sum_p w_p L_p / sum_p w_p with weights)

    With label_smoothing = eps > 0, conservative DPO (cDPO, Mitchell 2023, "A note on DPO with noisy
    preferences"; TRL's label_smoothing), for labels flipped with probability eps:
        L_p = -(1 - eps) log sigma(h_p) - eps log sigma(-h_p)

    Sequence log-probs are sums of token log-probs over the completion. Metrics (detached,
    unweighted means over pairs): chosen_reward = beta (log pi - log ref)(y_c), rejected_reward,
    reward_margin = chosen - rejected, reward_accuracy = fraction of pairs with margin > 0.
    With zero pairs the loss is 0 (still attached to the graph) and metrics are 0.

    Shapes: the four log-prob tensors and weights [P] -> (loss scalar, metrics).
    """
    chosen_reward, rejected_reward = _beta_log_ratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                                      ref_rejected_logps, beta)  # [P] each
    h = chosen_reward - rejected_reward  # [P]
    # logsigmoid is stable for large |margin|; eps = 0 adds an exact 0 (the plain DPO loss, bit for bit)
    losses = -F.logsigmoid(h) if not label_smoothing else (
        -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h))
    return _weighted_mean(losses, weights), _implicit_reward_metrics(chosen_reward, rejected_reward)


@PREFERENCE_LOSSES.register("rdpo")
def robust_dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Robust DPO (rDPO, Chowdhury et al., arXiv 2403.00409): for labels flipped with a known
    probability eps < 1/2, an unbiased estimate of the clean DPO loss,

        L_p = [(1 - eps) (-log sigma(h_p)) - eps (-log sigma(-h_p))] / (1 - 2 eps)

    with h as in ``dpo_loss``; eps = label_smoothing. Metrics as ``dpo_loss``.

    Shapes: the four log-prob tensors and weights [P] -> (loss scalar, metrics).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"rdpo needs a flip rate eps in [0, 0.5), got label_smoothing={label_smoothing}")
    chosen_reward, rejected_reward = _beta_log_ratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                                      ref_rejected_logps, beta)  # [P] each
    h = chosen_reward - rejected_reward  # [P]
    eps = label_smoothing
    losses = ((1 - eps) * -F.logsigmoid(h) - eps * -F.logsigmoid(-h)) / (1 - 2 * eps)  # [P]
    return _weighted_mean(losses, weights), _implicit_reward_metrics(chosen_reward, rejected_reward)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Identity Preference Optimisation (Azar et al., arXiv 2310.12036, eq. 17), beta = the paper's tau.

        h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))
        L = mean_p (h_p - 1 / (2 beta))^2

    A squared loss that pulls the log-ratio margin to the finite target 1/(2 beta) instead of pushing
    it to infinity as DPO's logistic loss does, so it does not over-fit deterministic preferences.
    Sequence log-probs are sums over the completion, as in the paper. Metrics as ``dpo_loss``
    (beta-scaled log-ratios).

    Shapes: the four log-prob tensors and weights [P] -> (loss scalar, metrics).
    """
    _check_pair_logps(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen_ratio = policy_chosen_logps - ref_chosen_logps  # [P]
    rejected_ratio = policy_rejected_logps - ref_rejected_logps  # [P]
    losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2  # [P]
    return _weighted_mean(losses, weights), _implicit_reward_metrics(beta * chosen_ratio, beta * rejected_ratio)


@PAIRINGS.register("all_pairs")
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


@PAIRINGS.register("best_worst")
def best_worst_pairs(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One (chosen, rejected) pair per group: its highest- and lowest-reward sequence (first index on
    ties); groups whose rewards all agree (within REWARD_ATOL) give no pair. This is how DPO is run on the policy's own
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
        if r.max() - r.min() > REWARD_ATOL:  # the estimators' and dynamic sampling's test
            chosen.append(int(best))
            rejected.append(int(worst))
    c = torch.tensor(chosen, dtype=torch.long)
    return c, torch.tensor(rejected, dtype=torch.long), torch.ones(c.shape, dtype=torch.float32)
