"""Per-token estimators of KL(pi || pi_ref) from sampled tokens (Schulman, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html).

Every estimator is ``fn(logprobs [N, T], ref_logprobs [N, T]) -> [N, T]``: the per-token estimate
at the sampled token, for tokens sampled from pi. Masking and aggregation are the caller's job
(use ``core.aggregate``), so the same estimate serves as a loss term (GRPO) or as an
in-reward penalty (PPO / REINFORCE++).

With log-ratio x = logp_ref - logp = log(pi_ref / pi):
    k1 = -x                    unbiased, high variance, can be negative per token
    k2 = 0.5 * x^2             biased, low variance, >= 0
    k3 = exp(x) - x - 1        unbiased, low variance, >= 0  (GRPO eq. 4, arXiv 2402.03300)

Departure: k3 clamps x to [-20, 20] before exp (as verl does) so one token with a huge log-ratio
cannot overflow to inf; inside that range the value is exact. k1 and k2 are not clamped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core import LOG_RATIO_CLAMP
from grpo_lab.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logp - logp_ref.  Shapes: [N, T], [N, T] -> [N, T]."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - logp_ref)^2.  Shapes: [N, T], [N, T] -> [N, T]."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (GRPO eq. 4, arXiv 2402.03300).

    The log-ratio is clamped to [-20, 20] for numerical safety (see the module docstring).
    Shapes: [N, T], [N, T] -> [N, T].
    """
    x = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(x) - x - 1.0


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence KL(pi || pi_ref) estimate: the k1 log-ratios summed over each row's masked tokens.
    Unbiased for the KL between the two distributions over whole completions when the rows are samples of
    pi (the chain rule sums the per-token KLs); the quantity whose square root is the x axis of Gao et al.'s
    over-optimisation curves (arXiv 2210.10760 §2). Shapes: [N, T] x 3 -> [N]."""
    return ((logprobs - ref_logprobs) * mask).sum(-1)


def off_policy_sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, behaviour_logprobs: Tensor,
                           mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """KL(pi || pi_ref) over whole completions from rows sampled by another policy mu (offline preferences:
    a pool drawn once from the start policy), by self-normalised importance sampling:
    KL ~ sum_i w_i d_i with d_i = `sequence_kl`(pi, pi_ref) of row i and w_i = softmax_i(sum_t log pi - log mu),
    since KL(pi || pi_ref) = E_mu[(pi / mu) log(pi / pi_ref)]. When mu = pi every weight is 1/N and this is
    the mean of `sequence_kl`. Returns (KL per completion, per token: sum_i w_i d_i / sum_i w_i n_i, the
    normalised effective sample size (sum_i w_i)^2 / (N sum_i w_i^2) in (0, 1]: near 0 the estimate rests on
    a few rows, i.e. pi has moved far from mu). Shapes: [N, T] x 4 -> three scalars."""
    d = sequence_kl(logprobs, ref_logprobs, mask)                                # [N]
    w = torch.softmax(sequence_kl(logprobs, behaviour_logprobs, mask), dim=0)    # [N], sums to 1
    kl = (w * d).sum()
    return kl, kl / (w * mask.sum(-1)).sum().clamp(min=1e-12), 1.0 / (len(w) * (w * w).sum())
