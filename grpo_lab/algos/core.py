"""The policy-gradient step's math, in one file to read top to bottom (as verl keeps it in core_algos.py):
rewards -> group shaping -> advantages; log-probs -> policy loss -> one scalar.

Pure functions: tensors in, tensors (and metrics) out; no config, no I/O, no state. Each concept has one
registry, and settings reach a registered function by the ``algorithm.*`` names its signature takes
(``Registry.bind`` / ``Registry.call`` hand it only those):

    Tensor helpers          masked sums and means, per-group sums, ranges, means and stds
    Token entropy           entropy_from_logits
    AGGREGATIONS            token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm
    Reward shaping          soft_overlong_penalty, informative_group_mask, group_stats, best_of_group_mask,
                            ema_reward_normalize, linear_warmup
    ADVANTAGE_ESTIMATORS    group_zscore, group_mean, group_mean_batch_std, rloo, reinforce_pp, gae
    POLICY_LOSSES           clipped_surrogate, gspo, gspo_token, vanilla_pg, cispo, gmpo, sapo, dppo

The other objectives' and corrections' math (KL estimators, preference and ranking losses, the rollout
correction, the value loss) lives beside this file, one module each, and uses its helpers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_lab.registry import Registry


# === Tensor helpers ===
# Small masked / grouped tensor helpers shared by the algos modules (private).


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


# === Token entropy ===
# Token entropy of the policy's next-token distribution, for the entropy bonus and logging.


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) over the vocabulary, per position.

        H = logsumexp(z) - sum_v softmax(z)_v z_v

    which avoids log(p) of tiny probabilities (verl's ``entropy_from_logits`` uses the same form).
    Logits of -inf (banned tokens) are allowed: they get p = 0 and contribute 0. Differentiable.
    Computed in the logits' dtype; upcast bf16 logits first if you need more than logging accuracy.

    Shapes: logits [N, T, V] (any leading dims) -> entropy [N, T].
    """
    # Replace -inf by the most negative finite value: same softmax, but 0 * z stays 0, not NaN.
    z = logits.clamp(min=torch.finfo(logits.dtype).min)
    probs = torch.softmax(z, dim=-1)  # [N, T, V]
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


# === Loss aggregation ===
# Loss aggregation: a per-token loss matrix [n, T] -> one scalar.
#
# Every mode is ``fn(loss_mat [n, T], response_mask [n, T], *, num_tokens=None, num_seqs=None,
# max_len=None) -> scalar``; call them through :func:`aggregate`. With l = loss, m = mask:
#
#     token_mean               sum_{i,t} l*m / num_tokens                      (DAPO, arXiv 2503.14476 sec. 3.3)
#     seq_mean_token_mean      sum_i [sum_t l*m / len_i] / num_seqs            (GRPO eq. 3, arXiv 2402.03300)
#     seq_mean_token_sum       sum_i  sum_t l*m / num_seqs
#     seq_mean_token_sum_norm  sum_{i,t} l*m / (num_seqs * max_len)            (Dr.GRPO, 2503.20783)
#
# Micro-batching: every mode is a sum over sequences divided by a normaliser that does not depend on
# the micro-batch (num_tokens, num_seqs, max_len). So when a minibatch is split into micro-batches
# for gradient accumulation, pass the minibatch-wide counts to each call and *sum* the results (no
# division by the number of micro-batches): the sum equals the full-minibatch value and gradient
# exactly. The defaults (the local counts) are right only when the call sees the whole minibatch.
# For ``seq_mean_token_sum_norm`` pass max_len too: each micro-batch may be padded to a different T.
#
# Conventions (our choice, stated here since papers do not need one): ``num_seqs`` defaults to the
# number of rows with at least one real token, so all-padding rows (added to even out micro-batch
# sizes) do not dilute the mean; a row with no real token contributes 0, never NaN; a zero count
# is treated as 1 (the loss is then 0).


AGGREGATIONS = Registry("loss aggregation")


def _masked_rows(loss_mat: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """-> (per-sequence sums of l*m [n], per-sequence real-token counts [n]) in loss dtype."""
    if loss_mat.shape != response_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [n, T]"
        )
    mask = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    row_sums = torch.where(mask, loss_mat, zero).sum(-1)  # [n]
    lengths = mask.sum(-1).to(loss_mat.dtype)  # [n]
    return row_sums, lengths


def _denominator(count: float | Tensor | None, default: Tensor) -> Tensor:
    """The normaliser: the given (global) count or the local default, floored at 1 to avoid 0/0."""
    value = default if count is None else torch.as_tensor(count, dtype=default.dtype, device=default.device)
    return value.clamp(min=1)


@AGGREGATIONS.register("token_mean")
def token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_{i,t} l*m / num_tokens: every token weighs the same (DAPO, arXiv 2503.14476 sec. 3.3).

    A sequence's weight grows with its length, so long degenerate answers are penalised in full.

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_tokens defaults to mask.sum().
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    return row_sums.sum() / _denominator(num_tokens, lengths.sum())


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_i [sum_t l*m / len_i] / num_seqs: mean over tokens, then over sequences (GRPO eq. 3).

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_seqs defaults to the number of rows with
    a real token.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    per_seq = row_sums / lengths.clamp(min=1)  # [n]; 0 for an all-padding row
    return per_seq.sum() / _denominator(num_seqs, (lengths > 0).sum().to(per_seq.dtype))


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_i sum_t l*m / num_seqs: sum over tokens, mean over sequences.

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_seqs default as above.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    return row_sums.sum() / _denominator(num_seqs, (lengths > 0).sum().to(row_sums.dtype))


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_{i,t} l*m / (num_seqs * max_len): Dr.GRPO's constant normaliser (arXiv 2503.20783).

    Dividing by the same constant for every sequence removes GRPO's length bias (1/len_i favours
    short correct and long wrong answers). Dr.GRPO uses the generation budget as max_len; it
    defaults to T here, so pass the budget (or at least one value for all micro-batches).

    Shapes: loss_mat, response_mask [n, T] -> scalar.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    seqs = _denominator(num_seqs, (lengths > 0).sum().to(row_sums.dtype))
    length = torch.as_tensor(
        loss_mat.shape[-1] if max_len is None else max_len, dtype=row_sums.dtype, device=row_sums.device
    ).clamp(min=1)
    return row_sums.sum() / (seqs * length)


def aggregate(
    loss_mat: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss [n, T] into a scalar with the registered ``mode``.

    Pass minibatch-wide ``num_tokens`` / ``num_seqs`` (and ``max_len``) when ``loss_mat`` is one
    micro-batch of a larger minibatch, and sum the micro-batch results (see the module docstring).
    Unknown modes raise an error listing the valid ones.
    """
    fn = AGGREGATIONS.get(mode)
    return fn(loss_mat, response_mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


# === Reward shaping and group filtering ===
# Reward shaping, group filtering and small schedules: DAPO's parts (arXiv 2503.14476) and tricks.
#
# Pure functions: rewards / lengths / group ids in, tensors (or plain floats for state) out.
#
# Choices the papers leave open:
#
# * ``informative_group_mask`` / ``group_stats`` call rewards "equal" within ``REWARD_ATOL`` (the
#   advantage estimators' own test, ``constant_groups`` above) so continuous rewards work; DAPO's
#   dynamic sampling (sec. 3.2) is stated for exact 0/1 accuracy.
# * ``group_stats``'s ``group_reward_std`` uses the unbiased std (as ``group_zscore``) and counts a
#   size-1 group as std 0.
# * ``ema_reward_normalize`` is a descriptive trick, not a paper: EMA of the batch mean and the
#   batch (population) variance, then (r - mean) / sqrt(var + eps) with the updated statistics.


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


# === Advantage estimators ===
# Advantage estimators, one registry, one signature.
#
# Every estimator is::
#
#     fn(token_rewards [N, T], response_mask [N, T], group_ids LongTensor [N], *, <settings it reads>)
#       -> (advantages [N, T], returns [N, T])          # both 0 on masked positions
#
# Settings are keyword-only and named as the ``algorithm.*`` config fields (``adv_eps``, ``gamma``,
# ``lam``; ``values`` [N, T] from the critic for GAE). The caller passes all of them through
# ``ADVANTAGE_ESTIMATORS.call(name, ...)``, which hands each estimator only the ones its signature
# names: a new setting touches the schema, the YAML and the one estimator that reads it.
#
# N = sequences, T = padded completion length. Outcome-reward estimators (group_*, rloo) score a
# sequence by ``r_i = sum_t token_rewards[i, t]`` over real tokens (the learner puts the scalar
# reward on the last real token and any in-reward KL penalty on every token), compute one scalar
# advantage per sequence and broadcast it over the sequence's real tokens; for them returns =
# advantages.
#
# Departures from papers / reference code (verl ``core_algos.py``, OpenRLHF):
#
# * ``group_zscore`` (and every group estimator): a group of size 1 gets advantage 0 (its mean is
#   its own reward; its std is undefined and treated as 1). verl instead sets mean 0, std 1 for a
#   singleton, i.e. A = r; we choose 0 because a lone sample has nothing to be compared with.
# * Groups whose rewards all agree (``constant_groups`` above: max - min <= ``REWARD_ATOL``, the same
#   test dynamic sampling uses) get advantage exactly 0 in every group estimator (the float mean of
#   equal numbers can differ from them by one ulp; we do not let that leak as noise).
# * ``group_mean_batch_std``: the batch std is taken over the N sequence advantages, as the
#   REINFORCE++ paper writes it; verl and OpenRLHF whiten over tokens (long sequences weigh more).
#   The batch mean of group-centred advantages is 0 by construction, so only the std is applied.
# * ``reinforce_pp`` and ``gae``: masked positions are not time steps; the recursions skip them
#   (so masked tool-output tokens in the middle of a response would not be discounted over).
#   With right padding this is the usual recursion.
# * ``gae`` and ``reinforce_pp`` whiten advantages over all real tokens of the batch with the
#   unbiased std, as verl's ``masked_whiten`` / PPO implementations do; returns are not whitened.


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


# === Policy losses ===
# Policy losses: per-token loss matrices (aggregation is the caller's: ``aggregate`` above).
#
# Every loss is::
#
#     fn(logprobs [N, T], old_logprobs [N, T], advantages [N, T], response_mask [N, T], *,
#        <settings it reads, e.g. clip_low, clip_high, dual_clip>, is_weights: Tensor [N, T] | None = None)
#       -> (loss_mat [N, T], metrics dict[str, scalar Tensor])
#
# Settings are keyword-only and named as the ``algorithm.*`` config fields; the objective passes all
# of them through ``POLICY_LOSSES.call(name, ...)``, which hands each loss only the ones it names. Each
# loss writes its own formula between two calls that frame every loss the same way:
# ``_loss_inputs`` (shape check, boolean mask, fp32 upcast, masked advantages zeroed) before, and
# ``_finish`` (IS weights, masking, the ratio metrics) after.
#
# ``logprobs`` carry the gradient; ``old_logprobs`` are the learner's log-probs under the policy
# that sampled the batch (detached). ``loss_mat`` is 0 on masked positions, and masked inputs
# never reach it. ``is_weights`` (the rollout correction's, ``rollout_correction.py``) multiplies the
# per-token loss.
# Metrics are detached means over this call's real tokens: ``clip_frac_low`` / ``clip_frac_high``
# (the clipped term is the one the min picks, at the lower / upper bound), ``dual_clip_frac``,
# ``ratio_mean``, ``ppo_kl`` (mean of old - new log-prob). Every loss reports ``clip_frac_low`` /
# ``clip_frac_high`` as the tokens its trust region acted on, low and high side: CISPO the tokens
# whose weight was clipped, GMPO those whose log-ratio was, SAPO those its gate has at least halved,
# DPPO those it masked; each docstring says which.
#
# The losses of 2025-26 (CISPO, GMPO, SAPO, DPPO) take settings of their own (``cispo_clip_high``,
# ``gmpo_log_clip_low``, ``sapo_tau_pos``, ``dppo_delta_high``, ...) rather than reusing
# ``clip_low``/``clip_high`` as verl does: their bounds mean other things (an IS-weight cap, a log-space
# range, a temperature, a probability difference), and a value meant for one would silently be read by
# another.
#
# Departures / choices:
#
# * Log-ratios are clamped to [-20, 20] before exp() (verl does the same), so one token with a
#   huge ratio cannot overflow; inside the range values are exact. The clamp kills the gradient
#   only where the ratio is e^20 away from 1, far outside any clip range.
# * ``gspo`` / ``gspo_token`` take the advantage per token (the learner broadcasts the sequence
#   advantage), so they also run with token-level advantages; with sequence-constant advantages
#   and ``seq_mean_token_mean`` aggregation they give the paper's objective exactly.
# * ``vanilla_pg`` takes no clip settings (it has nothing to clip); its clip metrics are 0.
# * Half-precision (bf16 / fp16) log-probs are upcast to float32 before the ratio is formed.


# Fact on each entry: `zero_at_zero_advantage` -- a token with A_t = 0 gets loss 0 and gradient 0 whatever
# its ratio (every loss here is A_t times a finite function of the ratio). Then a row whose advantages
# are all 0 adds nothing to the update, and the learner may leave it out of the forward/backward
# (learner.skip_rows_without_gradient; PolicyGradient.rows_without_gradient reads this fact).
POLICY_LOSSES = Registry("policy loss", defaults={"zero_at_zero_advantage": True})


def _check_shapes(**tensors: Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"policy-loss inputs must all be [N, T]; got {shapes}")


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _upcast(x: Tensor) -> Tensor:
    """bf16 / fp16 log-probs -> float32. A ratio computed in bf16 is rounded to a multiple of 2^-7
    near 1, far coarser than GSPO's 3e-4 clip range; upcasting avoids adding that error (it cannot
    undo rounding already in bf16 inputs). float32 / float64 pass through. Differentiable."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _clean(x: Tensor, mask: Tensor) -> Tensor:
    """Replace masked positions by 0 so garbage there reaches neither values nor gradients."""
    return torch.where(mask, x, _zero(x))


def _loss_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                 is_weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first half of every policy loss's frame: checks that all inputs are [N, T], and returns
    (logprobs, old_logprobs) in float32/64 (`_upcast`), the advantages in that dtype with masked
    positions zeroed, and the bool mask."""
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                  response_mask=response_mask, is_weights=is_weights)
    mask = as_bool_mask(response_mask)
    logprobs, old_logprobs = _upcast(logprobs), _upcast(old_logprobs)
    return logprobs, old_logprobs, _clean(advantages.to(logprobs.dtype), mask), mask


def _clipped_objective(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic clipped surrogate as a loss, per token, with optional dual clip.

        L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))               (PPO eq. 7, 1707.06347)
        L = min(L, -A c)   for A < 0, c = dual_clip > 1                       (dual clip, 1912.09729)

    Shapes: ratio, advantages, bool mask [N, T] -> (loss [N, T] unmasked, metrics).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    # The clipped term is chosen (strictly larger loss) only when the ratio has left the trust
    # region in the direction the advantage pushes it: r > 1 + clip_high with A > 0 (upper bound),
    # r < 1 - clip_low with A < 0 (lower bound). There its gradient is 0.
    clipped = pg_clipped > pg_unclipped
    metrics = {
        "clip_frac_low": masked_mean((clipped & (ratio < 1.0)).to(ratio.dtype), mask).detach(),
        "clip_frac_high": masked_mean((clipped & (ratio > 1.0)).to(ratio.dtype), mask).detach(),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (Ye et al. use 3), got {dual_clip}")
        # For A < 0 a huge ratio makes -A r unbounded; dual clip caps the loss at -A c.
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (cap < loss)
        loss = torch.where(dual, cap, loss)
        metrics["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask).detach()
    return loss, metrics


def _finish(
    loss: Tensor,
    mask: Tensor,
    is_weights: Tensor | None,
    log_ratio: Tensor,
    metrics: dict[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """The second half of every policy loss's frame: apply IS weights and the mask; add the ratio
    metrics (``ratio_mean``, ``ppo_kl``) of ``log_ratio`` over the real tokens."""
    if is_weights is not None:
        loss = loss * _clean(is_weights.to(loss.dtype), mask)
    loss = _clean(loss, mask)
    lr = log_ratio.detach()
    metrics["ratio_mean"] = masked_mean(torch.exp(lr), mask)
    metrics["ppo_kl"] = masked_mean(-lr, mask)
    return loss, metrics


@POLICY_LOSSES.register("clipped_surrogate")
def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                      clip_low: float, clip_high: float, dual_clip: float | None = None,
                      is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO clipped surrogate with asymmetric clip and optional dual clip, per token.

        r_t = exp(logp_t - logp_old_t)
        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        L_t = min(L_t, -A_t c)   if A_t < 0 and dual_clip c is given

    PPO: arXiv 1707.06347 (clip_low = clip_high = 0.2); GRPO: 2402.03300; clip-higher (DAPO,
    2503.14476: clip_low 0.2, clip_high 0.28) decouples the two bounds so low-probability tokens
    can grow; dual clip: Ye et al., arXiv 1912.09729 (c = 3).

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    log_ratio = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [N, T]
    loss, metrics = _clipped_objective(ratio, advantages, mask, clip_low, clip_high, dual_clip)
    return _finish(loss, mask, is_weights, log_ratio, metrics)


def _sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s_i = mean over real tokens of (logp - logp_old), clamped. [N, T] -> [N]."""
    token_lr = _clean(logprobs - old_logprobs, mask)
    lengths = mask.sum(-1).clamp(min=1).to(token_lr.dtype)
    return (token_lr.sum(-1) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@POLICY_LOSSES.register("gspo")
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
         clip_low: float, clip_high: float, dual_clip: float | None = None,
         is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: Group Sequence Policy Optimization, sequence-level ratio (arXiv 2507.18071).

        s_i   = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(1/|y_i| sum_t (logp_t - logp_old_t))
        L_i,t = max(-A_i,t s_i, -A_i,t clip(s_i, 1 - clip_low, 1 + clip_high))

    The loss of sequence i is broadcast over its real tokens, so ``seq_mean_token_mean``
    aggregation gives the paper's objective 1/G sum_i min(s_i A_i, clip(s_i) A_i). The paper clips
    far tighter than PPO because s_i is a length-normalised ratio: clip_low 3e-4, clip_high 4e-4.
    Clip metrics count tokens of clipped sequences.

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    seq_lr = _sequence_log_ratio(logprobs, old_logprobs, mask)  # [N]
    log_ratio = _clean(seq_lr[:, None].expand_as(logprobs), mask)  # [N, T]
    loss, metrics = _clipped_objective(torch.exp(log_ratio), advantages, mask, clip_low, clip_high, dual_clip)
    return _finish(loss, mask, is_weights, log_ratio, metrics)


@POLICY_LOSSES.register("gspo_token")
def gspo_token(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
               clip_low: float, clip_high: float, dual_clip: float | None = None,
               is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: sequence-level ratio value, token-level gradient (arXiv 2507.18071).

        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] = exp(logp_t - sg[logp_t] + sg[log s_i])
        L_i,t = max(-A_i,t s_i,t, -A_i,t clip(s_i,t, 1 - clip_low, 1 + clip_high))

    s_i,t equals s_i in value (so clipping acts on whole sequences, as in GSPO), but its gradient
    flows only through token t: d s_i,t / d logp_t = s_i. With advantages constant over each
    sequence and ``seq_mean_token_mean`` aggregation the gradient equals ``gspo``'s; with
    token-level advantages (e.g. multi-turn credit assignment) each token gets its own.

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    seq_lr = _sequence_log_ratio(logprobs, old_logprobs, mask).detach()  # sg[log s_i] [N]
    token_grad_path = _clean(logprobs - logprobs.detach(), mask)  # value 0, gradient 1 [N, T]
    log_ratio = _clean(token_grad_path + seq_lr[:, None], mask)  # value log s_i [N, T]
    loss, metrics = _clipped_objective(torch.exp(log_ratio), advantages, mask, clip_low, clip_high, dual_clip)
    return _finish(loss, mask, is_weights, log_ratio, metrics)


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
               is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain REINFORCE policy gradient for strictly on-policy updates (Williams 1992).

        L_t = -A_t logp_t

    Only its gradient -A grad logp is meaningful (the value is not a surrogate of anything).
    On-policy with one update per batch (mu = 1) the ratio is exactly 1, and then the clipped
    surrogate has this same gradient: d(-A r)/d theta = -A r grad logp = -A grad logp at r = 1, and
    no clip is active. Use it only when the batch is on-policy; it reads no clip settings, and
    the clip metrics are 0. ``ratio_mean`` is still reported, to detect off-policy use.

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    loss = -advantages * _clean(logprobs, mask)
    log_ratio = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    zero = _zero(loss)
    return _finish(loss, mask, is_weights, log_ratio, {"clip_frac_low": zero.clone(), "clip_frac_high": zero.clone()})


def _check_positive(**settings: float) -> None:
    for name, value in settings.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


@POLICY_LOSSES.register("cispo")
def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
          cispo_clip_low: float | None, cispo_clip_high: float,
          is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, §3.1 eq. 4-5).

        r_t   = exp(logp_t - logp_old_t)
        w_t   = sg(clip(r_t, 1 - eps_low^IS, 1 + eps_high^IS))      (no lower bound: cispo_clip_low None)
        L_t   = -w_t A_t logp_t                                     d L_t / d logp_t = -w_t A_t

    PPO's clip drops the gradient of a token whose ratio has left the trust region in the direction
    of its advantage (the first updates of rare "However"/"Wait" tokens). CISPO clips the *weight*
    instead, detached, so every token keeps a gradient -A w_t grad logp_t of bounded size. On-policy
    (r = 1) the gradient is the plain policy gradient -A grad logp. The paper aggregates over all
    tokens of the group (1 / sum_i |o_i|: ``token_mean``).

    Sources and where they differ: MiniMax-M1 sets no lower bound ("eps_low^IS large") and tunes only
    eps_high^IS, without stating its value. verl (``compute_policy_loss_cispo``) clamps to
    [1 - clip_ratio_low, 1 + clip_ratio_high], its example using 10 (no lower bound) and 0.2; TRL
    (``loss_type="cispo"``) caps at min(r, epsilon_high) with no lower bound, epsilon_high read as an
    absolute cap, recommended 5 after ScaleRL (arXiv 2510.13786), i.e. cispo_clip_high = 4 here.
    We follow the paper's form and verl's parameterisation.

    Only the gradient is meaningful (the value is not a surrogate of the objective). Metrics:
    ``clip_frac_low`` / ``clip_frac_high`` are the fractions of real tokens whose weight was clipped
    at the lower / upper bound, whatever the advantage's sign (the gradient is kept either way).

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    _check_positive(cispo_clip_high=cispo_clip_high)
    if cispo_clip_low is not None and cispo_clip_low < 0:
        raise ValueError(f"cispo_clip_low must be >= 0 or None (no lower bound), got {cispo_clip_low}")
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    log_ratio = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())  # [N, T]; a weight: sg(.)
    lower = None if cispo_clip_low is None else 1.0 - cispo_clip_low
    weight = ratio.clamp(min=lower, max=1.0 + cispo_clip_high)
    loss = -weight * advantages * _clean(logprobs, mask)
    below = ratio < lower if lower is not None else torch.zeros_like(mask)
    metrics = {"clip_frac_low": masked_mean(below.to(ratio.dtype), mask),
               "clip_frac_high": masked_mean((ratio > 1.0 + cispo_clip_high).to(ratio.dtype), mask)}
    return _finish(loss, mask, is_weights, log_ratio, metrics)


@POLICY_LOSSES.register("gmpo")
def gmpo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
         gmpo_log_clip_low: float, gmpo_log_clip_high: float,
         is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: Geometric-Mean Policy Optimization (arXiv 2507.20673, §3 eq. 4 and its released code).

        d_t   = logp_t - logp_old_t                                          (token log-ratio)
        d'_t  = min(d_t, eps_high)      if A_t > 0                           (sign-aware clip in log space,
        d'_t  = max(d_t, -eps_low)      if A_t < 0                            the pessimistic side as PPO)
        s'_i  = exp(1/|o_i| sum_t d'_t) = (prod_t clip(r_t))^(1/|o_i|)       (geometric mean of the ratios)
        L_i,t = -A_i,t s'_i

    GRPO maximises the arithmetic mean of the token rewards r_t A; GMPO the geometric mean, which
    one outlier ratio moves far less. The paper writes it as
    1/G sum_i (prod_t |clip(r_t) A_i|)^(1/|o_i|) sgn(A_i), the same thing for a sequence-constant
    A_i. The loss of sequence i is broadcast over its real tokens, so ``seq_mean_token_mean``
    aggregation gives the paper's 1/G sum_i -A_i s'_i (its released code updates one sequence at a
    time and averages). Paper values: eps_low = eps_high = 0.4, i.e. ratios in (e^-0.4, e^0.4) =
    (0.670, 1.492), wider than GRPO's (0.8, 1.2), clipped per token (the released code keeps a
    sequence-level clip only as an ablation).

    The sign-aware clip is the released code's (``train_zero_math_gmpo.py``) and verl's
    ``geo_mean`` loss: for A > 0 a token whose log-ratio exceeds eps_high adds no more to the
    objective and no gradient; for A < 0 one below -eps_low. With token-level advantages each token
    is clipped by its own advantage's sign (the paper defines GMPO for sequence advantages only).
    On-policy (every d_t = 0) the gradient of the summed loss is the plain policy gradient,
    -A_t on each token: d(-A s')/d logp_t = -A s' / |o_i| summed over the |o_i| copies.

    Metrics: ``clip_frac_high`` / ``clip_frac_low`` count the tokens whose log-ratio was clipped at
    eps_high (A > 0) / -eps_low (A < 0); ``ratio_mean`` and ``ppo_kl`` are of the unclipped
    geometric-mean ratio, broadcast over tokens (as ``gspo``'s). IS weights multiply each token's
    copy of the sequence loss, so a sequence is weighted by the arithmetic mean of its tokens' weights
    (verl's ``geo_mean`` takes their geometric mean).

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    _check_positive(gmpo_log_clip_low=gmpo_log_clip_low, gmpo_log_clip_high=gmpo_log_clip_high)
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    token_lr = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)   # d_t [N, T]
    up, down = advantages > 0, advantages < 0
    clipped_lr = torch.where(up, token_lr.clamp(max=gmpo_log_clip_high),
                             torch.where(down, token_lr.clamp(min=-gmpo_log_clip_low), token_lr))   # d'_t
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(token_lr.dtype)                    # [N, 1]
    seq_ratio = torch.exp(clipped_lr.sum(-1, keepdim=True) / lengths)                       # s'_i [N, 1]
    loss = -advantages * seq_ratio                                                           # [N, T]
    metrics = {"clip_frac_high": masked_mean((up & (token_lr > gmpo_log_clip_high)).to(loss.dtype), mask),
               "clip_frac_low": masked_mean((down & (token_lr < -gmpo_log_clip_low)).to(loss.dtype), mask)}
    seq_lr = _clean((token_lr.sum(-1, keepdim=True) / lengths).expand_as(token_lr), mask)   # unclipped [N, T]
    return _finish(loss, mask, is_weights, seq_lr, metrics)


# A token counts as gated (SAPO's clip_frac_low / clip_frac_high) when its soft gate has at least
# halved the gradient the plain IS-weighted policy gradient would give it: 4 p (1 - p) < 1/2.
SAPO_GATED_BELOW = 0.5


@POLICY_LOSSES.register("sapo")
def sapo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
         sapo_tau_pos: float, sapo_tau_neg: float,
         is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: Soft Adaptive Policy Optimization (arXiv 2511.20347, §3), a soft gate instead of the clip.

        r_t   = exp(logp_t - logp_old_t)
        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = sigmoid(tau_t (r - 1)) * 4 / tau_t                          (the soft gate)
        L_t   = -f(r_t) A_t
        d L_t / d logp_t = -A_t w_t r_t,   w_t = 4 p_t (1 - p_t),  p_t = sigmoid(tau_t (r_t - 1))

    w_t is 1 on-policy (r = 1: p = 1/2), so there the gradient is the plain policy gradient -A grad
    logp, and it decays smoothly as r leaves 1 instead of dropping to 0 at a clip bound: a
    continuous trust region. The 4/tau factor makes w(1) = 1 for every tau; a larger tau decays
    faster, and the paper sets tau_neg > tau_pos (1.05 vs 1.0) because negative-advantage updates
    raise the logits of many unsampled tokens and destabilise training. The paper averages per
    sequence then over the group (1/G sum_i 1/|y_i| sum_t: ``seq_mean_token_mean``), as verl's and
    TRL's implementations do.

    Sources: the gate and temperatures as in the paper, verl's ``compute_policy_loss_sapo`` and TRL's
    ``loss_type="sapo"`` (all three agree; A = 0 takes tau_neg in both codes, irrelevant as its
    loss is 0).

    Metrics: ``clip_frac_low`` / ``clip_frac_high`` count the real tokens the gate has *gated*,
    w_t < 1/2 (at least halved the IS-weighted gradient), with r < 1 / r > 1 (for tau near 1 only
    r > 2.76 gets there); ``gate_weight_mean`` is the mean w_t.

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    _check_positive(sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg)
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    log_ratio = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)                                                     # [N, T]
    tau = torch.where(advantages > 0, sapo_tau_pos, sapo_tau_neg).to(ratio.dtype)    # [N, T]
    p = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(p * 4.0 / tau) * advantages
    w = (4.0 * p * (1.0 - p)).detach()                                               # gradient weight, 1 at r = 1
    gated = w < SAPO_GATED_BELOW
    metrics = {"clip_frac_low": masked_mean((gated & (ratio < 1.0)).to(ratio.dtype), mask),
               "clip_frac_high": masked_mean((gated & (ratio > 1.0)).to(ratio.dtype), mask),
               "gate_weight_mean": masked_mean(w, mask)}
    return _finish(loss, mask, is_weights, log_ratio, metrics)


@POLICY_LOSSES.register("dppo")
def dppo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
         dppo_delta_low: float, dppo_delta_high: float, dppo_ratio_cap: float | None,
         is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV: Divergence Proximal Policy Optimization (Qi et al., arXiv 2602.04879).

        r_t   = exp(logp_t - logp_old_t),      D_t = pi(y_t) - pi_old(y_t)      (probabilities, not logs)
        M_t   = 0  if A_t > 0 and D_t > delta_high,  or  A_t < 0 and D_t < -delta_low;   else 1
        L_t   = -A_t sg(min(r_t, C)) M_t logp_t          d L_t / d logp_t = -A_t min(r_t, C) M_t

    PPO's ratio clip is a one-sample estimate of the policy's divergence that over-constrains rare
    tokens (a ratio of 2 on a 1e-4 token moves almost no probability) and under-constrains common
    ones. DPPO masks a token instead when the divergence itself leaves the trust region in the
    direction its advantage pushes: |pi - pi_old| of the sampled token is the total variation of the
    binary distribution {y_t, everything else}, the paper's Binary approximation of
    D_TV(pi_old(.|s_t) || pi(.|s_t)). The gradient of the kept tokens is the PPO surrogate's, A r grad logp
    (written with a detached weight, as the paper's code); on-policy (r = 1, D = 0) it is the plain
    policy gradient. The Binary-KL and Top-K approximations are not implemented.

    Which code we follow, and where they differ:
    * The authors' code (sail-sg/Stable-RL, ``dppo_binary_tv``) anchors D and r to the *rollout*
      policy's log-probs, and the paper finds that anchoring crucial for stability; verl's port
      (``compute_policy_loss_dppo_tv``) uses the recomputed old log-probs (the authors'
      ``dppo_binary_tv_recompute``). Here ``old_logprobs`` is what the learner passes: the engine's
      sampling log-probs (the authors' anchoring) unless ``algorithm.rollout_correction`` is on, when it
      is the learner's recomputed pi_old (verl's) and the correction weights multiply the loss.
    * The weight min(r, C) truncates the ratio (TIS) instead of dual-clip; the paper (§5.4) finds the
      truncation bias harmful, so C is large: the authors' code defaults to 10, verl's code to 20 and
      verl's example script to 10000. ``dppo_ratio_cap=None`` is no truncation.
    * The thresholds: 0.15 for Binary-TV (verl's example for the paper's Qwen3-30B-A3B run; 0.05 for
      Binary-KL), the same on both sides.

    Metrics: ``clip_frac_high`` / ``clip_frac_low`` are the fractions of real tokens masked with
    A > 0 / A < 0; ``ratio_cap_frac`` those whose weight the cap truncated.

    Shapes: logprobs, old_logprobs, advantages, response_mask, is_weights [N, T]
    -> (loss_mat [N, T], metrics).
    """
    _check_positive(dppo_delta_low=dppo_delta_low, dppo_delta_high=dppo_delta_high)
    if dppo_ratio_cap is not None and not dppo_ratio_cap >= 1.0:
        raise ValueError(f"dppo_ratio_cap must be >= 1 or None (no truncation), got {dppo_ratio_cap}")
    logprobs, old_logprobs, advantages, mask = _loss_inputs(logprobs, old_logprobs, advantages, response_mask,
                                                            is_weights)
    log_ratio = _clean(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())                                                  # [N, T]
    prob_diff = torch.exp(_clean(logprobs.detach(), mask)) - torch.exp(_clean(old_logprobs, mask))   # D_t, 0 on padding
    masked_up = (advantages > 0) & (prob_diff > dppo_delta_high)
    masked_down = (advantages < 0) & (prob_diff < -dppo_delta_low)
    keep = ~(masked_up | masked_down)
    weight = ratio if dppo_ratio_cap is None else ratio.clamp(max=dppo_ratio_cap)
    loss = -advantages * torch.where(keep, weight, _zero(weight)) * _clean(logprobs, mask)
    metrics = {"clip_frac_high": masked_mean(masked_up.to(ratio.dtype), mask),
               "clip_frac_low": masked_mean(masked_down.to(ratio.dtype), mask)}
    if dppo_ratio_cap is not None:
        metrics["ratio_cap_frac"] = masked_mean((keep & (ratio > dppo_ratio_cap)).to(ratio.dtype), mask)
    return _finish(loss, mask, is_weights, log_ratio, metrics)

def log_ratio_stats(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """How far the policy has moved from pi_old on this batch's tokens, whatever the loss: the spread
    of the token log importance ratios log r_t = logp_t - logp_old_t over real tokens.

    Returns detached scalars ``log_ratio_std`` (population std; 0 with no real token) and
    ``log_ratio_abs_max`` (max |log r_t|). GMPO (arXiv 2507.20673, Fig. 2) and SAPO (arXiv
    2511.20347) argue from the range of these ratios; this is the same number for every loss.

    Shapes: logprobs, old_logprobs, response_mask [N, T].
    """
    mask = as_bool_mask(response_mask)
    lr = _clean(_upcast(logprobs.detach()) - _upcast(old_logprobs.detach()), mask)  # [N, T], 0 on padding
    mean = masked_mean(lr, mask)
    var = masked_mean((lr - mean) ** 2, mask)
    return {"log_ratio_std": var.clamp(min=0).sqrt(),
            "log_ratio_abs_max": lr.abs().max() if lr.numel() else _zero(lr)}
