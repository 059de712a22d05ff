"""Policy losses: clip bounds by hand (asymmetric, dual clip), GSPO's sequence ratio, GSPO-token's
equivalence, vanilla PG, CISPO's clipped IS weight, GMPO's geometric mean, SAPO's soft gate, DPPO's
divergence mask, and the spread of the log-ratios every loss logs."""

import functools
import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import (
    POLICY_LOSSES,
    aggregate,
    cispo,
    clipped_surrogate,
    dppo,
    gmpo,
    gspo,
    gspo_token,
    log_ratio_stats,
    sapo,
    vanilla_pg,
)
from grpo_lab.schema import AlgorithmConfig, as_dict

D = torch.float64
GARBAGE = 1.0e4
# Every loss's settings, as the objective passes them (the schema's defaults; each loss takes the ones
# it names), with DAPO's clip-higher and a dual clip so that those paths run too.
SETTINGS = {**as_dict(AlgorithmConfig()), "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}


def _leaf(x):
    return torch.tensor(x, dtype=D).requires_grad_()


# One sequence of 7 real tokens + 1 padding token. old logp = 0, so ratio r = exp(logp) = given r.
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.5, 1.25, 0.75]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, 2.0, -2.0]


def _clip_example():
    logp = _leaf([[math.log(r) for r in RATIOS] + [GARBAGE]])
    old = torch.tensor([[0.0] * 7 + [-GARBAGE]], dtype=D)
    adv = torch.tensor([ADVS + [GARBAGE]], dtype=D)
    mask = torch.tensor([[1] * 7 + [0]])
    return logp, old, adv, mask


def test_clipped_surrogate_by_hand_asymmetric():
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28] (DAPO clip-higher). L = max(-A r, -A clip(r)):
    #  1. r=1.1,  A=+1: inside                     -> -1.1
    #  2. r=1.5,  A=+1: max(-1.5, -1.28)            -> -1.28   upper clip active
    #  3. r=0.5,  A=+1: max(-0.5, -0.8)             -> -0.5    (below 0.8 but A>0: not clipped)
    #  4. r=0.5,  A=-1: max(0.5, 0.8)               ->  0.8    lower clip active
    #  5. r=1.5,  A=-1: max(1.5, 1.28)              ->  1.5    (above 1.28 but A<0: not clipped)
    #  6. r=1.25, A=+2: inside (1.25 < 1.28)        -> -2.5    (a symmetric 0.2 clip would give -2.4)
    #  7. r=0.75, A=-2: max(1.5, 2 * 0.8 = 1.6)     ->  1.6    lower clip active
    #  8. padding                                   ->  0
    logp, old, adv, mask = _clip_example()
    loss, metrics = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert_close(loss, torch.tensor([[-1.1, -1.28, -0.5, 0.8, 1.5, -2.5, 1.6, 0.0]], dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(1 / 7, dtype=D))
    assert_close(metrics["clip_frac_low"], torch.tensor(2 / 7, dtype=D))
    # ratio_mean = (1.1 + 1.5 + 0.5 + 0.5 + 1.5 + 1.25 + 0.75) / 7 = 7.1 / 7
    assert_close(metrics["ratio_mean"], torch.tensor(7.1 / 7, dtype=D))
    assert "dual_clip_frac" not in metrics
    # gradient d L / d logp = -A r where unclipped, 0 where the clipped term is chosen
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.1, 0.0, -0.5, 0.0, 1.5, -2.5, 0.0, 0.0]], dtype=D))


def test_clipped_surrogate_symmetric_clips_token_6():
    # clip_high = 0.2: token 6 (r=1.25, A=+2) is now clipped: max(-2.5, -2.4) = -2.4
    logp, old, adv, mask = _clip_example()
    loss, metrics = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert_close(loss[0, 5], torch.tensor(-2.4, dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(2 / 7, dtype=D))


def test_dual_clip_by_hand():
    # c = 3, clip 0.2/0.28:
    #  r=5, A=-1: max(5, 1.28) = 5 > -A c = 3 -> 3 (dual clip binds, gradient 0)
    #  r=2, A=-1: max(2, 1.28) = 2 < 3        -> 2
    #  r=5, A=+1: max(-5, -1.28) = -1.28      (dual clip only for A < 0)
    logp = _leaf([[math.log(5.0), math.log(2.0), math.log(5.0)]])
    old = torch.zeros(1, 3, dtype=D)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=D)
    mask = torch.ones(1, 3)
    loss, metrics = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert_close(loss, torch.tensor([[3.0, 2.0, -1.28]], dtype=D))
    assert_close(metrics["dual_clip_frac"], torch.tensor(1 / 3, dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(1 / 3, dtype=D))  # token 3
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=D))  # -A r = 2 on token 2
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=1.0)


def test_is_weights_multiply_the_loss():
    logp, old, adv, mask = _clip_example()
    w = torch.tensor([[0.5, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, GARBAGE]], dtype=D)
    base, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    weighted, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weights=w)
    # [-1.1 * 0.5, -1.28, -0.5 * 2, ...], padding still 0
    assert_close(weighted, base * torch.where(mask.bool(), w, 0.0))
    assert_close(weighted[0, :3], torch.tensor([-0.55, -1.28, -1.0], dtype=D))


def test_gspo_by_hand():
    # seq 0: token log-ratios [0.1, 0.3, pad] -> mean 0.2 -> s_0 = e^0.2 = 1.2214028
    # seq 1: token log-ratios [-0.3, 0, 0]   -> mean -0.1 -> s_1 = e^-0.1 = 0.9048374
    logp = _leaf([[0.1, 0.3, GARBAGE], [-0.3, 0.0, 0.0]])
    old = torch.zeros(2, 3, dtype=D)
    adv = torch.tensor([[1.0, 1.0, GARBAGE], [-1.0, -1.0, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # clip 0.2/0.2: s_0 = 1.2214 > 1.2 with A = +1 -> clipped: -1.2 on each real token
    #               s_1 = 0.9048 in [0.8, 1.2]  -> unclipped: +0.9048374
    loss, metrics = gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s1 = math.exp(-0.1)
    assert_close(loss, torch.tensor([[-1.2, -1.2, 0.0], [s1, s1, s1]], dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(2 / 5, dtype=D))  # seq 0's 2 tokens of 5
    # seq_mean_token_mean gives the paper's 1/G sum_i loss_i = (-1.2 + 0.9048374) / 2
    assert_close(aggregate(loss, mask, "seq_mean_token_mean"), torch.tensor((-1.2 + s1) / 2, dtype=D))
    # gradient: seq 0 clipped -> 0; seq 1: d(1/3 sum_t s_1)/d logp_t... loss.sum() = 3 s_1 and
    # d s_1 / d logp_t = s_1 / 3, so each token gets 3 * s_1 / 3 = s_1
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [s1, s1, s1]], dtype=D))


def test_gspo_paper_clip_range():
    # paper values clip_low 3e-4, clip_high 4e-4: both sequences are now clipped
    #   seq 0 A=+1: -(1 + 4e-4) = -1.0004;  seq 1 A=-1: s_1 = 0.905 < 0.9997 -> +0.9997
    logp = torch.tensor([[0.1, 0.3, GARBAGE], [-0.3, 0.0, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, GARBAGE], [-1.0, -1.0, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = gspo(logp, torch.zeros(2, 3, dtype=D), adv, mask, clip_low=3e-4, clip_high=4e-4)
    assert_close(loss, torch.tensor([[-1.0004, -1.0004, 0.0], [0.9997, 0.9997, 0.9997]], dtype=D))
    assert_close(metrics["clip_frac_low"], torch.tensor(3 / 5, dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(2 / 5, dtype=D))


def _random_batch(seed, n=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 1, 5])[:n]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    logp = (-torch.rand(n, t, generator=gen, dtype=D) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, t, generator=gen, dtype=D)
    seq_adv = torch.randn(n, generator=gen, dtype=D)
    adv = seq_adv[:, None].expand(n, t).clone()
    token_adv = torch.randn(n, t, generator=gen, dtype=D)
    pad = mask == 0
    logp_g = torch.where(pad, GARBAGE, logp)  # garbage at padding, still a function of logp
    return logp, logp_g, old, adv, token_adv, mask


def test_gspo_ratio_is_exp_of_mean_token_log_ratio():
    # With an unbounded clip range and A = -1 the loss is exactly s_i on every real token.
    logp, logp_g, old, _, _, mask = _random_batch(0)
    loss, _ = gspo(logp_g, old, -torch.ones_like(old), mask, clip_low=1e9, clip_high=1e9)
    lr = ((logp - old) * mask).sum(-1) / mask.sum(-1)  # mean token log-ratio [N]
    assert_close(loss, torch.exp(lr)[:, None] * mask)


@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.28), (3e-4, 4e-4), (1e9, 1e9)])
def test_gspo_token_equals_gspo_in_value_and_gradient(clip_low, clip_high):
    logp, logp_g, old, adv, token_adv, mask = _random_batch(1)
    # value: equal for any advantages (s_i,t has the value of s_i)
    for a in (adv, token_adv):
        seq_loss, seq_metrics = gspo(logp_g, old, a, mask, clip_low=clip_low, clip_high=clip_high)
        tok_loss, tok_metrics = gspo_token(logp_g, old, a, mask, clip_low=clip_low, clip_high=clip_high)
        assert_close(tok_loss, seq_loss)
        for k in seq_metrics:
            assert_close(tok_metrics[k], seq_metrics[k])

    # gradient: equal with sequence-constant advantages under seq_mean_token_mean
    def garbage_padded():  # a fresh graph for each autograd.grad call
        return torch.where(mask == 0, GARBAGE, logp)

    (g_seq,) = torch.autograd.grad(
        aggregate(
            gspo(garbage_padded(), old, adv, mask, clip_low=clip_low, clip_high=clip_high)[0],
            mask,
            "seq_mean_token_mean",
        ),
        logp,
    )
    (g_tok,) = torch.autograd.grad(
        aggregate(
            gspo_token(garbage_padded(), old, adv, mask, clip_low=clip_low, clip_high=clip_high)[0],
            mask,
            "seq_mean_token_mean",
        ),
        logp,
    )
    assert_close(g_tok, g_seq)
    assert (g_seq[mask == 0] == 0).all()


def test_gspo_token_gradient_is_per_token_with_token_advantages():
    # unclipped: d L_{i,t} / d logp_{i,t} = -A_{i,t} s_i, only through token t
    logp, logp_g, old, _, token_adv, mask = _random_batch(2)
    loss, _ = gspo_token(logp_g, old, token_adv, mask, clip_low=1e9, clip_high=1e9)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # [N]
    assert_close(grad, -token_adv * s[:, None] * mask)


def test_vanilla_pg_by_hand_and_same_gradient_as_clipped_at_ratio_one():
    # L = -A logp: tokens logp = [-1, -2], A = [2, -1] -> [2, -2]
    logp = _leaf([[-1.0, -2.0, GARBAGE]])
    adv = torch.tensor([[2.0, -1.0, GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = vanilla_pg(logp, logp.detach(), adv, mask)
    assert_close(loss, torch.tensor([[2.0, -2.0, 0.0]], dtype=D))
    assert_close(metrics["ratio_mean"], torch.tensor(1.0, dtype=D))
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0
    (g_pg,) = torch.autograd.grad(loss.sum(), logp)
    clipped, _ = clipped_surrogate(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
    (g_clip,) = torch.autograd.grad(clipped.sum(), logp)
    assert_close(g_pg, torch.tensor([[-2.0, 1.0, 0.0]], dtype=D))  # -A
    assert_close(g_clip, g_pg)


def test_cispo_by_hand_no_lower_bound():
    # The clip example's 7 tokens (old logp = 0, so r = e^logp), CISPO with no lower bound and
    # eps_high 0.28: w = sg(min(r, 1.28)) = [1.1, 1.28, 0.5, 0.5, 1.28, 1.25, 0.75].
    # L = -w A logp; its gradient d L / d logp = -w A (the weight is detached):
    #   [-1.1, -1.28, -0.5, +0.5, +1.28, -2.5, +1.5]
    # PPO's clip (test_clipped_surrogate_by_hand_asymmetric) drops tokens 2, 4 and 7 (gradient 0);
    # CISPO keeps all three: token 2 (r 1.5, A +1) with its weight capped at 1.28, tokens 4 and 7
    # (r below 0.8 with A < 0) with their own weights 0.5 and 0.75.
    logp, old, adv, mask = _clip_example()
    loss, metrics = cispo(logp, old, adv, mask, cispo_clip_low=None, cispo_clip_high=0.28)
    w = [1.1, 1.28, 0.5, 0.5, 1.28, 1.25, 0.75]
    expected = [-wi * a * math.log(r) for wi, a, r in zip(w, ADVS, RATIOS)] + [0.0]
    # e.g. token 1: -1.1 * 1 * ln 1.1 = -0.1048412
    assert abs(expected[0] - (-0.1048412)) < 1e-7
    assert_close(loss, torch.tensor([expected], dtype=D))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.1, -1.28, -0.5, 0.5, 1.28, -2.5, 1.5, 0.0]], dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(2 / 7, dtype=D))   # r = 1.5 twice
    assert_close(metrics["clip_frac_low"], torch.tensor(0.0, dtype=D))      # no lower bound
    assert_close(metrics["ratio_mean"], torch.tensor(7.1 / 7, dtype=D))


def test_cispo_keeps_the_gradient_ppo_clip_drops():
    logp, old, adv, mask = _clip_example()
    ppo, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    ours, _ = cispo(logp, old, adv, mask, cispo_clip_low=0.2, cispo_clip_high=0.28)
    (g_cispo,) = torch.autograd.grad(ours.sum(), logp)
    real = mask.bool()
    dropped = (g_ppo == 0) & real
    assert dropped.sum() == 3 and (g_cispo[dropped] != 0).all()
    # With a lower bound 1 - 0.2 the weights below it are raised to 0.8 (tokens 3, 4, 7):
    #   gradient -w A = [-1.1, -1.28, -0.8, +0.8, +1.28, -2.5, +1.6]
    assert_close(g_cispo, torch.tensor([[-1.1, -1.28, -0.8, 0.8, 1.28, -2.5, 1.6, 0.0]], dtype=D))


def test_cispo_clip_fractions_with_a_lower_bound():
    logp, old, adv, mask = _clip_example()
    _, metrics = cispo(logp, old, adv, mask, cispo_clip_low=0.2, cispo_clip_high=0.28)
    assert_close(metrics["clip_frac_low"], torch.tensor(3 / 7, dtype=D))    # r = 0.5, 0.5, 0.75 < 0.8
    assert_close(metrics["clip_frac_high"], torch.tensor(2 / 7, dtype=D))
    with pytest.raises(ValueError, match="cispo_clip_high must be > 0"):
        cispo(logp, old, adv, mask, cispo_clip_low=None, cispo_clip_high=0.0)
    with pytest.raises(ValueError, match="cispo_clip_low must be >= 0"):
        cispo(logp, old, adv, mask, cispo_clip_low=-0.1, cispo_clip_high=0.2)


def test_gmpo_by_hand():
    # old logp = 0, so the token log-ratios d are the logps; eps_low = eps_high = 0.4 (the paper's).
    # seq 0, A = +1, d = [0.1, 0.6, -0.5]: only the upper side clips (A > 0): d' = [0.1, 0.4, -0.5],
    #   mean 0 -> s'_0 = 1; loss -A s' = -1 on each real token; token 2 clipped.
    # seq 1, A = -1, d = [-0.6, 0.5, 0.1]: only the lower side clips: d' = [-0.4, 0.5, 0.1],
    #   mean 0.2/3 -> s'_1 = e^(0.2/3) = 1.0689391; loss +1.0689391 on each real token; token 1 clipped.
    logp = _leaf([[0.1, 0.6, -0.5, GARBAGE], [-0.6, 0.5, 0.1, GARBAGE]])
    old = torch.zeros(2, 4, dtype=D)
    adv = torch.tensor([[1.0, 1.0, 1.0, GARBAGE], [-1.0, -1.0, -1.0, GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    loss, metrics = gmpo(logp, old, adv, mask, gmpo_log_clip_low=0.4, gmpo_log_clip_high=0.4)
    s1 = math.exp(0.2 / 3)
    assert abs(s1 - 1.0689391) < 1e-7
    assert_close(loss, torch.tensor([[-1.0, -1.0, -1.0, 0.0], [s1, s1, s1, 0.0]], dtype=D))
    # seq_mean_token_mean gives the paper's 1/G sum_i -A_i s'_i = (-1 + 1.0689391) / 2
    assert_close(aggregate(loss, mask, "seq_mean_token_mean"), torch.tensor((-1.0 + s1) / 2, dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(1 / 6, dtype=D))
    assert_close(metrics["clip_frac_low"], torch.tensor(1 / 6, dtype=D))
    # ratio_mean: the unclipped geometric means e^(0.2/3) (seq 0) and e^0 (seq 1), 3 tokens each
    assert_close(metrics["ratio_mean"], torch.tensor((math.exp(0.2 / 3) + 1.0) / 2, dtype=D))
    # gradient of the summed loss: sum_t -A s' = -3 A s', d s'/d d_t = s'/3 for an unclipped token
    #   seq 0: -1 * 1 = -1 on tokens 1 and 3, 0 on the clipped token 2
    #   seq 1: +s'_1 on tokens 2 and 3, 0 on the clipped token 1
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.0, 0.0, -1.0, 0.0], [0.0, s1, s1, 0.0]], dtype=D))


def test_gmpo_geometric_mean_damps_an_outlier_ratio():
    # One token's ratio e^2 = 7.389 next to two at 1, no clip, A = -1 (so the loss is the ratio):
    #   GMPO:      (e^2 * 1 * 1)^(1/3) = e^(2/3) = 1.9477340
    #   GRPO-like: arithmetic mean (e^2 + 1 + 1) / 3 = 3.1296854  (clipped_surrogate, seq_mean_token_mean)
    logp = torch.tensor([[2.0, 0.0, 0.0]], dtype=D)
    adv, mask, old = -torch.ones(1, 3, dtype=D), torch.ones(1, 3), torch.zeros(1, 3, dtype=D)
    geo, _ = gmpo(logp, old, adv, mask, gmpo_log_clip_low=1e9, gmpo_log_clip_high=1e9)
    arith, _ = clipped_surrogate(logp, old, adv, mask, clip_low=1e9, clip_high=1e9)
    assert_close(aggregate(geo, mask, "seq_mean_token_mean"), torch.tensor(1.9477340, dtype=D))
    assert_close(aggregate(arith, mask, "seq_mean_token_mean"), torch.tensor(3.1296854, dtype=D))
    with pytest.raises(ValueError, match="gmpo_log_clip_low must be > 0"):
        gmpo(logp, old, adv, mask, gmpo_log_clip_low=0.0, gmpo_log_clip_high=0.4)


def test_sapo_by_hand():
    # tau_pos = 1, tau_neg = 2; p = sigmoid(tau (r - 1)), loss -4 p A / tau, gradient -A w r with w = 4 p (1 - p)
    #  1. r = 1,   A = +1, tau 1: p = 1/2,        loss -2,          w = 1,         grad -1
    #  2. r = 2,   A = +1, tau 1: p = 0.7310586,  loss -2.9242343,  w = 0.7864477, grad -1.5728955
    #  3. r = 0.5, A = -1, tau 2: p = 0.2689414,  loss +0.5378828,  w = 0.7864477, grad +0.3932239
    #  4. r = 4,   A = +1, tau 1: p = 0.9525741,  loss -3.8102965,  w = 0.1807066, grad -0.7228266 (gated: w < 1/2)
    # PPO's clip 0.2 would give tokens 2 and 4 no gradient at all, and token 3 none either (r < 0.8, A < 0).
    logp = _leaf([[0.0, math.log(2.0), math.log(0.5), math.log(4.0), GARBAGE]])
    old = torch.zeros(1, 5, dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = sapo(logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    assert_close(loss, torch.tensor([[-2.0, -2.9242343, 0.5378828, -3.8102965, 0.0]], dtype=D), atol=1e-7, rtol=0)
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.5728955, 0.3932239, -0.7228266, 0.0]], dtype=D),
                 atol=1e-7, rtol=0)
    assert_close(metrics["gate_weight_mean"], torch.tensor((1 + 2 * 0.7864477 + 0.1807066) / 4, dtype=D),
                 atol=1e-7, rtol=0)
    assert_close(metrics["clip_frac_high"], torch.tensor(1 / 4, dtype=D))   # token 4
    assert_close(metrics["clip_frac_low"], torch.tensor(0.0, dtype=D))
    with pytest.raises(ValueError, match="sapo_tau_neg must be > 0"):
        sapo(logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=0.0)


def test_sapo_gate_decays_faster_for_negative_advantages():
    # The same ratio r = 1.5 under A = +1 (tau_pos 1.0) and A = -1 (tau_neg 1.05, the paper's values):
    # |gradient| = w r with w = 4 p (1 - p); the larger tau gives the smaller w.
    logp = _leaf([[math.log(1.5), math.log(1.5)]])
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    loss, _ = sapo(logp, torch.zeros(1, 2, dtype=D), adv, torch.ones(1, 2), sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    w = lambda tau: 4 * (1 / (1 + math.exp(-tau * 0.5))) * (1 - 1 / (1 + math.exp(-tau * 0.5)))
    assert_close(grad, torch.tensor([[-w(1.0) * 1.5, w(1.05) * 1.5]], dtype=D))
    assert abs(grad[0, 1]) < abs(grad[0, 0])


# DPPO's example: (pi_old, pi, A) per token, delta 0.15 both sides, cap C = 10.
DPPO_TOKENS = [
    (0.5, 0.6, 1.0),     # D = +0.1 <= 0.15: kept, r = 1.2                       grad -A r = -1.2
    (0.5, 0.7, 1.0),     # D = +0.2 > 0.15 with A > 0: masked                    grad 0
    (0.01, 0.05, 1.0),   # D = +0.04: kept although r = 5 (PPO would clip it)    grad -5
    (0.8, 0.6, -1.0),    # D = -0.2 < -0.15 with A < 0: masked                   grad 0
    (0.9, 0.8, -1.0),    # D = -0.1: kept, r = 0.8889                             grad +0.8889
    (0.3, 0.6, -1.0),    # D = +0.3 but A < 0 pushes pi down: no bound that side  grad +2
    (0.001, 0.02, 1.0),  # D = +0.019: kept, r = 20 truncated to C = 10           grad -10
]


def test_dppo_binary_tv_by_hand():
    old = torch.log(torch.tensor([[t[0] for t in DPPO_TOKENS] + [0.5]], dtype=D))
    logp = _leaf([[math.log(t[1]) for t in DPPO_TOKENS] + [GARBAGE]])
    adv = torch.tensor([[t[2] for t in DPPO_TOKENS] + [GARBAGE]], dtype=D)
    mask = torch.tensor([[1] * 7 + [0]])
    loss, metrics = dppo(logp, old, adv, mask, dppo_delta_low=0.15, dppo_delta_high=0.15, dppo_ratio_cap=10.0)
    weight = [1.2, 0.0, 5.0, 0.0, 0.8 / 0.9, 2.0, 10.0]           # min(r, C) M
    expected = [-a * w * math.log(p) for (_, p, a), w in zip(DPPO_TOKENS, weight)] + [0.0]
    assert_close(loss, torch.tensor([expected], dtype=D))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.2, 0.0, -5.0, 0.0, 0.8 / 0.9, 2.0, -10.0, 0.0]], dtype=D))
    assert_close(metrics["clip_frac_high"], torch.tensor(1 / 7, dtype=D))   # token 2
    assert_close(metrics["clip_frac_low"], torch.tensor(1 / 7, dtype=D))    # token 4
    assert_close(metrics["ratio_cap_frac"], torch.tensor(1 / 7, dtype=D))   # token 7
    # PPO's clip 0.2 drops token 3 (r = 5 > 1.2 with A > 0), the rare token DPPO keeps
    ppo, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    assert g_ppo[0, 2] == 0 and logp.grad[0, 2] != 0
    # no cap: token 7 gets its full ratio 20
    uncapped, m = dppo(logp, old, adv, mask, dppo_delta_low=0.15, dppo_delta_high=0.15, dppo_ratio_cap=None)
    (g,) = torch.autograd.grad(uncapped.sum(), logp)
    assert_close(g[0, 6], torch.tensor(-20.0, dtype=D)) and "ratio_cap_frac" not in m
    with pytest.raises(ValueError, match="dppo_ratio_cap must be >= 1"):
        dppo(logp, old, adv, mask, dppo_delta_low=0.15, dppo_delta_high=0.15, dppo_ratio_cap=0.5)


ON_POLICY_LOSSES = ["cispo", "gmpo", "sapo", "dppo"]


@pytest.mark.parametrize("name", ON_POLICY_LOSSES)
def test_on_policy_gradient_is_the_plain_policy_gradient(name):
    """At r = 1 (old = logp, one update per batch) no clip or gate acts, and the gradient of the summed
    loss is the plain policy gradient's, -A_t on every real token (test_vanilla_pg_by_hand...)."""
    logp, logp_g, _, adv, _, mask = _random_batch(4)
    loss, metrics = POLICY_LOSSES.call(name, logp_g, logp.detach(), adv, mask, **SETTINGS)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, -adv * mask)
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0
    assert_close(metrics["ratio_mean"], torch.tensor(1.0, dtype=D))


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_masked_positions_do_not_matter(name):
    logp, _, old, _, token_adv, mask = _random_batch(3)
    pad = mask == 0
    fn = functools.partial(POLICY_LOSSES.call, name)  # each loss takes the settings it reads
    w = torch.full_like(old, 1.5)
    kwargs = SETTINGS
    loss, metrics = fn(logp, old, token_adv, mask, is_weights=w, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    loss2, metrics2 = fn(
        torch.where(pad, 5.0e3, logp),
        torch.where(pad, -4.0e3, old),
        torch.where(pad, 9.0e3, token_adv),
        mask,
        is_weights=torch.where(pad, 7.0e3, w),
        **kwargs,
    )
    (grad2,) = torch.autograd.grad(loss2.sum(), logp)
    assert_close(loss2, loss)
    assert_close(grad2, grad)
    assert set(metrics) == set(metrics2) and {"clip_frac_low", "clip_frac_high", "ratio_mean"} <= set(metrics)
    for k in metrics:
        assert_close(metrics2[k], metrics[k])
        assert not metrics[k].requires_grad
    assert (loss[pad] == 0).all() and (grad[pad] == 0).all()


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_the_zero_at_zero_advantage_fact_holds(name):
    """An entry that says `zero_at_zero_advantage` gives a row of all-zero advantages loss 0 and gradient 0
    whatever its ratios (the learner then skips the row: PolicyGradient.rows_without_gradient)."""
    if not POLICY_LOSSES.fact(name, "zero_at_zero_advantage"):
        pytest.skip("the entry does not claim it")
    logp, logp_g, old, _, token_adv, mask = _random_batch(5)
    adv = token_adv.clone()
    adv[1] = 0.0
    loss, _ = POLICY_LOSSES.call(name, logp_g, old, adv, mask, **SETTINGS)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert (loss[1] == 0).all() and (grad[1] == 0).all()
    assert grad[0].abs().sum() > 0


def test_huge_log_ratio_stays_finite():
    logp = _leaf([[0.0, -500.0]])
    old = torch.tensor([[-500.0, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    for name in POLICY_LOSSES.names():
        loss, metrics = POLICY_LOSSES.call(name, logp, old, adv, torch.ones(1, 2), **SETTINGS)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name


def test_log_ratio_stats_by_hand():
    # log r = logp - old = [0.5, -1, 0] on the real tokens (padding garbage ignored): mean -1/6,
    # population variance ((2/3)^2 + (5/6)^2 + (1/6)^2) / 3 = (16 + 25 + 1) / 108 = 7/18, max |log r| = 1
    logp = torch.tensor([[-1.0, -2.0, -0.5, GARBAGE]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, -0.5, -GARBAGE]], dtype=D)
    m = log_ratio_stats(logp, old, torch.tensor([[1, 1, 1, 0]]))
    assert_close(m["log_ratio_std"], torch.tensor(math.sqrt(7 / 18), dtype=D))
    assert_close(m["log_ratio_abs_max"], torch.tensor(1.0, dtype=D))
    assert not m["log_ratio_std"].requires_grad
    empty = log_ratio_stats(logp, old, torch.zeros(1, 4))
    assert empty["log_ratio_std"] == 0 and empty["log_ratio_abs_max"] == 0


# The loss at logp = -1, old = -1 - 3e-4 (r = e^3e-4 = 1.0003, nothing clipped), A = 1, in float32.
BF16_EXPECTED = {
    "vanilla_pg": 1.0,                   # -A logp
    "cispo": math.exp(3e-4),             # -sg(r) A logp = 1.0003
    "sapo": -4.0 / (1.0 + math.exp(-(math.exp(3e-4) - 1.0))),   # -4 sigmoid(tau (r - 1)) / tau, tau 1: -2.0003
    "dppo": math.exp(3e-4),              # -A sg(r) M logp = 1.0003 (pi - pi_old ~ 1e-4: kept)
}


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_bf16_logprobs_are_upcast(name):
    # learner log-probs in bf16 (-1.0 is exact), old log-probs float32 = -1 - 3e-4. In float32 the
    # ratio is e^3e-4 = 1.0003 (A = 1, clip 0.2: unclipped, loss -1.0003); had the loss been
    # computed in bf16 (resolution 2^-7 near 1) the ratio would be exactly 1 and the loss -1.
    # The losses whose value is not -A r say theirs in BF16_EXPECTED.
    logp = torch.full((1, 2), -1.0, dtype=torch.bfloat16, requires_grad=True)
    old = torch.full((1, 2), -1.0 - 3e-4)
    loss, _ = POLICY_LOSSES.call(name, logp, old, torch.ones(1, 2), torch.ones(1, 2), **SETTINGS)
    assert loss.dtype == torch.float32
    expected = BF16_EXPECTED.get(name, -math.exp(3e-4))
    assert_close(loss, torch.full((1, 2), expected))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()
