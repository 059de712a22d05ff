"""Rollout correction: importance weights for the rollout engine / learner mismatch (and staleness).

The engine (vLLM in bf16, another kernel, weights one update old with ``trainer.max_staleness=1``)
samples from mu = pi_engine, while the learner computes pi_learner for the same weights: "on-policy"
data is off-policy. With a correction on, the policy loss takes the learner's own log-probs as
pi_old (its ratio then only measures the update) and every token's loss is multiplied by a weight
built from

    log rho_t = log pi_learner_old(y_t) - log pi_engine(y_t)        (per real token)

at one of three **levels** (registry ``ROLLOUT_CORRECTION_LEVELS``)::

    token       w_t = rho_t                                  one weight per token   (Yao et al. 2025, TIS)
    sequence    w_i = prod_t rho_t = exp(sum_t log rho_t)    one weight per answer  (the unbiased one)
    geometric   w_i = exp(1/|y_i| sum_t log rho_t)           one weight per answer, length-normalised

and one of two **modes** (registry ``ROLLOUT_CORRECTION_MODES``) against the bounds [lower, upper]::

    truncate    w <- min(max(w, lower), upper)               (TIS: bounded variance, some bias)
    mask        w <- 0 where w < lower or w > upper          (MIS / rejection: the unit is dropped; the
                                                              units inside keep their weight w)

Sources: token-level truncation (TIS) is Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training" (cap 2). The sequence level and the masked ("MIS") mode follow
verl's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``: Seq-MIS as sequence IS with
rejection outside [0.5, 2]; Geo-RS as a rejection of the geometric mean outside [0.999, 1.001]) and
TRL's ``vllm_importance_sampling_mode`` (token/sequence x truncate/mask, kept units keeping their
ratio as here, cap 3 by default). verl's rejection sampling instead keeps weight 1 inside the bounds;
with the geometric level's narrow bounds the two hardly differ.

Every function is pure: tensors in, detached tensors and metrics out. Comparisons with the bounds are
made in log space (no overflow for a long answer's product); weights are formed after the bounds, so
they never exceed ``upper``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .core import LOG_RATIO_CLAMP, as_bool_mask, masked_mean
from .kl import kl_k3
from grpo_lab.registry import Registry

# level -> fn(log_rho [N, T] (0 on padding), mask bool [N, T]) -> log weights of the level's units:
# [N, T] (one per token) or [N, 1] (one per sequence).
ROLLOUT_CORRECTION_LEVELS = Registry("rollout-correction level")
# mode -> fn(log_w [units], *, log_lower: float | None, log_upper: float) -> (weights [units], touched bool [units]).
ROLLOUT_CORRECTION_MODES = Registry("rollout-correction mode")


@ROLLOUT_CORRECTION_LEVELS.register("token")
def token_level(log_rho: Tensor, mask: Tensor) -> Tensor:
    """w_t = rho_t: each token's own ratio. [N, T] -> [N, T]."""
    return log_rho


@ROLLOUT_CORRECTION_LEVELS.register("sequence")
def sequence_level(log_rho: Tensor, mask: Tensor) -> Tensor:
    """w_i = prod_t rho_t = exp(sum_t log rho_t): the exact sequence IS weight. [N, T] -> [N, 1]."""
    return log_rho.sum(-1, keepdim=True)


@ROLLOUT_CORRECTION_LEVELS.register("geometric")
def geometric_level(log_rho: Tensor, mask: Tensor) -> Tensor:
    """w_i = exp(mean_t log rho_t): the per-token geometric mean, on one scale for every length. [N, T] -> [N, 1]."""
    return log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)


@ROLLOUT_CORRECTION_MODES.register("truncate")
def truncate(log_w: Tensor, *, log_lower: float | None, log_upper: float) -> tuple[Tensor, Tensor]:
    """w = exp(clamp(log w, log lower, log upper)); touched: the units a bound changed."""
    touched = log_w > log_upper
    if log_lower is not None:
        touched = touched | (log_w < log_lower)
    return torch.exp(log_w.clamp(min=log_lower, max=log_upper)), touched


@ROLLOUT_CORRECTION_MODES.register("mask")
def mask_outside(log_w: Tensor, *, log_lower: float | None, log_upper: float) -> tuple[Tensor, Tensor]:
    """w = exp(log w) inside [lower, upper], 0 outside; touched: the units dropped."""
    outside = log_w > log_upper
    if log_lower is not None:
        outside = outside | (log_w < log_lower)
    # Inside the bounds log w <= log upper, so exp() cannot overflow; outside it is never taken.
    return torch.where(outside, torch.zeros_like(log_w), torch.exp(log_w.clamp(max=log_upper))), outside


def effective_sample_size(weights: Tensor, units: Tensor) -> Tensor:
    """Normalised effective sample size of importance weights over the real units:

        ESS = (sum w)^2 / (n sum w^2)   in [1/n, 1]; 1 when all weights are equal, 0 when all are 0

    (Kish's effective sample size divided by n). Shapes: weights, bool units, the same shape -> scalar."""
    w = torch.where(units, weights, torch.zeros_like(weights))
    n = units.sum().to(w.dtype)
    sq = (w * w).sum()
    return torch.where(sq > 0, w.sum() ** 2 / (n * sq).clamp(min=torch.finfo(w.dtype).tiny), torch.zeros_like(sq))


def rollout_correction_weights(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: str,
    mode: str,
    upper: float,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token correction weights for the policy loss, and what they did.

        log rho_t = log pi_learner(y_t) - log pi_engine(y_t)
        w         = mode(level(log rho), lower, upper), broadcast over each sequence's tokens

    ``level``: token | sequence | geometric (``ROLLOUT_CORRECTION_LEVELS``); ``mode``: truncate | mask
    (``ROLLOUT_CORRECTION_MODES``); ``upper`` >= 1 and ``lower`` in (0, 1] or None, so that a perfect
    match (w = 1) is never changed.

    Returns the weights [N, T] (detached, 0 on padding) and detached scalars over the level's units
    (real tokens, or sequences with a real token): ``correction_weight_mean``,
    ``correction_truncated_frac`` / ``correction_masked_frac`` (units a bound changed / dropped; the
    other mode's is 0), ``correction_ess`` (:func:`effective_sample_size` of the final weights).

    Shapes: learner_logprobs, sampler_logprobs, response_mask [N, T] -> ([N, T], metrics).
    """
    if not upper >= 1.0:
        raise ValueError(f"rollout correction upper bound must be >= 1 (Yao et al. use 2), got {upper}")
    if lower is not None and not 0.0 < lower <= 1.0:
        raise ValueError(f"rollout correction lower bound must lie in (0, 1] or be None, got {lower}")
    mask = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=learner_logprobs.dtype, device=learner_logprobs.device)
    # Each token's log-ratio clamped to [-20, 20] as the policy losses' (an engine's -inf log-prob stays finite).
    log_rho = torch.where(mask, learner_logprobs.detach() - sampler_logprobs.detach(), zero
                          ).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)                            # [N, T]
    log_w = ROLLOUT_CORRECTION_LEVELS.get(level)(log_rho, mask)              # [N, T] or [N, 1]
    units = mask if log_w.shape == mask.shape else mask.any(-1, keepdim=True)   # real tokens / real sequences
    weights, touched = ROLLOUT_CORRECTION_MODES.get(mode)(
        log_w, log_lower=None if lower is None else math.log(lower), log_upper=math.log(upper))
    weights = torch.where(units, weights, torch.zeros_like(weights))
    frac = masked_mean(touched.to(weights.dtype), units)
    metrics = {
        "correction_weight_mean": masked_mean(weights, units),
        "correction_truncated_frac": frac if mode == "truncate" else torch.zeros_like(frac),
        "correction_masked_frac": frac if mode == "mask" else torch.zeros_like(frac),
        "correction_ess": effective_sample_size(weights, units),
    }
    token_weights = torch.where(mask, weights.expand_as(log_rho), zero)       # [N, T]
    return token_weights.detach(), {k: v.detach() for k, v in metrics.items()}


def logprob_mismatch_metrics(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    response_mask: Tensor,
) -> dict[str, Tensor]:
    """How far the sampler's log-probs are from the learner's, over real tokens.

    Returns detached scalars: ``logprob_abs_diff_mean``, ``logprob_abs_diff_max`` (0 if no real
    token) and ``kl_k3``: the k3 estimate of KL(pi_sampler || pi_learner), the right direction
    since the tokens were sampled from the sampler.

    Shapes: learner_logprobs, sampler_logprobs, response_mask [N, T].
    """
    mask = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=learner_logprobs.dtype, device=learner_logprobs.device)
    learner = torch.where(mask, learner_logprobs.detach(), zero)
    sampler = torch.where(mask, sampler_logprobs.detach(), zero)
    abs_diff = (learner - sampler).abs()  # 0 on padding
    return {
        "logprob_abs_diff_mean": masked_mean(abs_diff, mask),
        "logprob_abs_diff_max": abs_diff.max() if abs_diff.numel() else zero,
        "kl_k3": masked_mean(kl_k3(sampler, learner), mask),
    }
