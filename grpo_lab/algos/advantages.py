"""Advantage estimators, one registry, one signature.

Every estimator is::

    fn(token_rewards [N, T], response_mask [N, T], group_ids LongTensor [N], *, <settings it reads>)
      -> (advantages [N, T], returns [N, T])          # both 0 on masked positions

Settings are keyword-only and named as the ``algorithm.*`` config fields (``adv_eps``, ``gamma``,
``lam``; ``values`` [N, T] from the critic for GAE). The caller passes all of them through
``ADVANTAGE_ESTIMATORS.call(name, ...)``, which hands each estimator only the ones its signature
names: a new setting touches the schema, the YAML and the one estimator that reads it.

N = sequences, T = padded completion length. Outcome-reward estimators (group_*, rloo) score a
sequence by ``r_i = sum_t token_rewards[i, t]`` over real tokens (the learner puts the scalar
reward on the last real token and any in-reward KL penalty on every token), compute one scalar
advantage per sequence and broadcast it over the sequence's real tokens; for them returns =
advantages.

Departures from papers / reference code (verl ``core_algos.py``, OpenRLHF):

* ``group_zscore`` (and every group estimator): a group of size 1 gets advantage 0 (its mean is
  its own reward; its std is undefined and treated as 1). verl instead sets mean 0, std 1 for a
  singleton, i.e. A = r; we choose 0 because a lone sample has nothing to be compared with.
* Groups whose rewards all agree (``_utils.constant_groups``: max - min <= ``REWARD_ATOL``, the same
  test dynamic sampling uses) get advantage exactly 0 in every group estimator (the float mean of
  equal numbers can differ from them by one ulp; we do not let that leak as noise).
* ``group_mean_batch_std``: the batch std is taken over the N sequence advantages, as the
  REINFORCE++ paper writes it; verl and OpenRLHF whiten over tokens (long sequences weigh more).
  The batch mean of group-centred advantages is 0 by construction, so only the std is applied.
* ``reinforce_pp`` and ``gae``: masked positions are not time steps; the recursions skip them
  (so masked tool-output tokens in the middle of a response would not be discounted over).
  With right padding this is the usual recursion.
* ``gae`` and ``reinforce_pp`` whiten advantages over all real tokens of the batch with the
  unbiased std, as verl's ``masked_whiten`` / PPO implementations do; returns are not whitened.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._utils import (
    as_bool_mask,
    constant_groups,
    group_index,
    group_mean_std,
    group_sum,
    masked_whiten,
    work_dtype,
)
from grpo_lab.registry import Registry

# Facts on each entry: `min_group_size` (a group-relative baseline needs G >= 2, or every advantage is
# 0 and nothing is learned) and `needs_critic` (GAE reads a value model). validate() reads them.
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", defaults={"min_group_size": 1, "needs_critic": False})


def _prepare(token_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """-> (rewards [N, T] in float32/64 with masked positions set to 0, bool mask [N, T])."""
    if token_rewards.shape != response_mask.shape or token_rewards.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [N, T]"
        )
    mask = as_bool_mask(response_mask)
    r = token_rewards.to(work_dtype(token_rewards))
    return torch.where(mask, r, torch.zeros((), dtype=r.dtype, device=r.device)), mask


def _sequence_scores(token_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """-> (scores r_i = sum of real-token rewards [N], bool mask [N, T])."""
    r, mask = _prepare(token_rewards, response_mask)
    return r.sum(-1), mask  # [N]


def _broadcast(seq_adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Scalar advantage per sequence [N] -> (advantages [N, T], returns [N, T]), 0 on padding."""
    adv = torch.where(mask, seq_adv[:, None], torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device))
    return adv, adv.clone()


def _group_centre(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (r - mean_g [N], std_g per sequence [N], group size per sequence [N], constant-group [N])."""
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids must have shape [N]={tuple(scores.shape)}, got {tuple(group_ids.shape)}")
    inverse, counts = group_index(group_ids)
    g = counts.numel()
    mean, std = group_mean_std(scores, inverse, counts)  # [G], [G]
    constant = constant_groups(scores, inverse, g)[inverse]  # [N]; size-1 groups are constant too
    centred = torch.where(constant, torch.zeros_like(scores), scores - mean[inverse])
    return centred, std[inverse], counts[inverse], constant


@ADVANTAGE_ESTIMATORS.register("group_zscore", min_group_size=2)
def group_zscore(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    adv_eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO's group-normalised outcome advantage (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2).

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps),   broadcast over the real tokens of i

    std_g is the unbiased (Bessel-corrected, ``torch.std`` default) std, as verl uses. A group of
    size 1 gets A = 0 (mean = r, std treated as 1); a group whose rewards all agree (std 0) gets 0.

    Shapes: token_rewards, response_mask [N, T]; group_ids [N] -> advantages, returns [N, T].
    """
    scores, mask = _sequence_scores(token_rewards, response_mask)  # [N]
    centred, std, size, _ = _group_centre(scores, group_ids)
    std = torch.where(size > 1, std, torch.ones_like(std))
    return _broadcast(centred / (std + adv_eps), mask)


@ADVANTAGE_ESTIMATORS.register("group_mean", min_group_size=2)
def group_mean(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
) -> tuple[Tensor, Tensor]:
    """Dr.GRPO's advantage: group mean baseline without std division (arXiv 2503.20783, sec. 3.2).

        A_i = r_i - mean_g(r)

    Dividing by std_g up-weights groups that are nearly all right or all wrong (a question-level
    difficulty bias), which Dr.GRPO removes. Size-1 group -> 0.

    Shapes: token_rewards, response_mask [N, T]; group_ids [N] -> advantages, returns [N, T].
    """
    scores, mask = _sequence_scores(token_rewards, response_mask)
    centred, _, _, _ = _group_centre(scores, group_ids)
    return _broadcast(centred, mask)


@ADVANTAGE_ESTIMATORS.register("group_mean_batch_std", min_group_size=2)
def group_mean_batch_std(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    adv_eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group mean baseline, batch std normalisation (arXiv 2501.03262).

        A'_i = r_i - mean_g(r);    A_i = A'_i / (std_batch(A') + eps)

    std_batch is the unbiased std over the N sequences (1 if N < 2). The global std is more stable
    than a per-group one when a group is (nearly) constant.

    Shapes: token_rewards, response_mask [N, T]; group_ids [N] -> advantages, returns [N, T].
    """
    scores, mask = _sequence_scores(token_rewards, response_mask)
    centred, _, _, _ = _group_centre(scores, group_ids)
    if centred.numel() > 1:
        std = centred.std()
    else:
        std = torch.ones((), dtype=centred.dtype, device=centred.device)
    return _broadcast(centred / (std + adv_eps), mask)


@ADVANTAGE_ESTIMATORS.register("rloo", min_group_size=2)
def rloo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al., arXiv 2402.14740, eq. 6).

        A_i = r_i - 1/(G-1) * sum_{j != i, j in g} r_j  =  G/(G-1) * (r_i - mean_g(r))

    The baseline excludes the sample itself, so it is unbiased. A group of size 1 has no other
    sample: A = 0.

    Shapes: token_rewards, response_mask [N, T]; group_ids [N] -> advantages, returns [N, T].
    """
    scores, mask = _sequence_scores(token_rewards, response_mask)
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids must have shape [N]={tuple(scores.shape)}, got {tuple(group_ids.shape)}")
    inverse, counts = group_index(group_ids)
    g = counts.numel()
    size = counts[inverse].to(scores.dtype)  # [N]
    total = group_sum(scores, inverse, g)[inverse]  # [N]
    loo_mean = (total - scores) / (size - 1).clamp(min=1)  # mean of the others [N]
    constant = constant_groups(scores, inverse, g)[inverse]  # includes size 1
    adv = torch.where(constant, torch.zeros_like(scores), scores - loo_mean)
    return _broadcast(adv, mask)


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{next real t}, over real tokens only. [N, T] -> [N, T] (0 on padding)."""
    n, t_len = rewards.shape
    running = rewards.new_zeros(n)  # [N]
    out = torch.zeros_like(rewards)
    for t in reversed(range(t_len)):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    adv_eps: float = 1e-6,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch (arXiv 2501.03262).

        G_t = sum_{k >= t, k real} gamma^(#real tokens between t and k) * r_k
        A_t = (G_t - mean(G)) / (std(G) + eps)       mean/std over all real tokens of the batch

    No critic and no groups (group_ids is ignored): the global whitening replaces the baseline.
    std is the unbiased masked std. returns = G (not whitened).

    Shapes: token_rewards, response_mask [N, T]; group_ids [N] -> advantages, returns [N, T].
    """
    r, mask = _prepare(token_rewards, response_mask)
    returns = _discounted_returns(r, mask, gamma)  # [N, T]
    return masked_whiten(returns, mask, adv_eps), returns


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True)
def gae(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    values: Tensor | None = None,
    adv_eps: float = 1e-6,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation with a critic (GAE arXiv 1506.02438, PPO arXiv 1707.06347).

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last real token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}       (A after the last real token = 0)
        returns_t = A_t + V_t                            (the critic's regression target)

    t+1 means the next real token. Advantages are then whitened over all real tokens of the batch
    (unbiased masked std), as PPO implementations do; returns use the raw A.

    Shapes: token_rewards, response_mask, values [N, T]; group_ids [N] (ignored)
    -> advantages, returns [N, T].
    """
    if values is None:
        raise ValueError(
            "advantage estimator 'gae' needs critic values [N, T]; pass values=..., enable the "
            "critic, or choose an estimator without a critic (group_zscore, rloo, reinforce_pp, ...)"
        )
    r, mask = _prepare(token_rewards, response_mask)
    if values.shape != r.shape:
        raise ValueError(f"values must have shape {tuple(r.shape)}, got {tuple(values.shape)}")
    v = torch.where(mask, values.to(r.dtype), torch.zeros((), dtype=r.dtype, device=r.device))
    n, t_len = r.shape
    next_value = r.new_zeros(n)  # V of the next real token [N]
    next_adv = r.new_zeros(n)  # A of the next real token [N]
    adv = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
        adv[:, t] = torch.where(m, a_t, torch.zeros_like(a_t))
    returns = torch.where(mask, adv + v, torch.zeros_like(adv))
    return masked_whiten(adv, mask, adv_eps), returns
