"""Policy losses: per-token loss matrices (aggregation is the caller's, see ``aggregation.py``).

Every loss is::

    fn(logprobs [N, T], old_logprobs [N, T], advantages [N, T], response_mask [N, T], *,
       <settings it reads, e.g. clip_low, clip_high, dual_clip>, is_weights: Tensor [N, T] | None = None)
      -> (loss_mat [N, T], metrics dict[str, scalar Tensor])

Settings are keyword-only and named as the ``algorithm.*`` config fields; the objective passes all
of them through ``POLICY_LOSSES.call(name, ...)``, which hands each loss only the ones it names. Each
loss writes its own formula between two calls that frame every loss the same way:
``_loss_inputs`` (shape check, boolean mask, fp32 upcast, masked advantages zeroed) before, and
``_finish`` (IS weights, masking, the ratio metrics) after.

``logprobs`` carry the gradient; ``old_logprobs`` are the learner's log-probs under the policy
that sampled the batch (detached). ``loss_mat`` is 0 on masked positions, and masked inputs
never reach it. ``is_weights`` (the rollout correction's, ``rollout_correction.py``) multiplies the
per-token loss.
Metrics are detached means over this call's real tokens: ``clip_frac_low`` / ``clip_frac_high``
(the clipped term is the one the min picks, at the lower / upper bound), ``dual_clip_frac``,
``ratio_mean``, ``ppo_kl`` (mean of old - new log-prob). Every loss reports ``clip_frac_low`` /
``clip_frac_high`` as the tokens its trust region acted on, low and high side: CISPO the tokens
whose weight was clipped, GMPO those whose log-ratio was, SAPO those its gate has at least halved,
DPPO those it masked; each docstring says which.

The losses of 2025-26 (CISPO, GMPO, SAPO, DPPO) take settings of their own (``cispo_clip_high``,
``gmpo_log_clip_low``, ``sapo_tau_pos``, ``dppo_delta_high``, ...) rather than reusing
``clip_low``/``clip_high`` as verl does: their bounds mean other things (an IS-weight cap, a log-space
range, a temperature, a probability difference), and a value meant for one would silently be read by
another.

Departures / choices:

* Log-ratios are clamped to [-20, 20] before exp() (verl does the same), so one token with a
  huge ratio cannot overflow; inside the range values are exact. The clamp kills the gradient
  only where the ratio is e^20 away from 1, far outside any clip range.
* ``gspo`` / ``gspo_token`` take the advantage per token (the learner broadcasts the sequence
  advantage), so they also run with token-level advantages; with sequence-constant advantages
  and ``seq_mean_token_mean`` aggregation they give the paper's objective exactly.
* ``vanilla_pg`` takes no clip settings (it has nothing to clip); its clip metrics are 0.
* Half-precision (bf16 / fp16) log-probs are upcast to float32 before the ratio is formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._utils import LOG_RATIO_CLAMP, as_bool_mask, masked_mean
from grpo_lab.registry import Registry

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

