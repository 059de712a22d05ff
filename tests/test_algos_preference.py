"""DPO loss at known margins and group-wise preference pair construction (ties give no pair)."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import dpo_loss, group_preference_pairs, sequence_logps

D = torch.float64


def _softplus(x):
    return math.log1p(math.exp(x))  # -log sigmoid(-x) = log(1 + e^x)


def _pairs():
    # beta = 0.1
    # pair 0: chosen  (pi - ref) = -10 - (-12) = 2  -> reward 0.2
    #         rejected(pi - ref) = -11 - (-10) = -1 -> reward -0.1;  margin h = 0.3
    # pair 1: chosen  (pi - ref) = -5 - (-5) = 0    -> reward 0
    #         rejected(pi - ref) = -8 - (-10) = 2   -> reward 0.2;   margin h = -0.2
    pc = torch.tensor([-10.0, -5.0], dtype=D, requires_grad=True)
    pr = torch.tensor([-11.0, -8.0], dtype=D, requires_grad=True)
    rc = torch.tensor([-12.0, -5.0], dtype=D)
    rr = torch.tensor([-10.0, -10.0], dtype=D)
    return pc, pr, rc, rr


def test_dpo_loss_by_hand():
    pc, pr, rc, rr = _pairs()
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # -log sigma(0.3) = log(1 + e^-0.3) = 0.5543552; -log sigma(-0.2) = log(1 + e^0.2) = 0.7981389
    l0, l1 = _softplus(-0.3), _softplus(0.2)
    assert abs(l0 - 0.5543552) < 1e-7 and abs(l1 - 0.7981389) < 1e-7
    assert_close(loss, torch.tensor((l0 + l1) / 2, dtype=D))
    assert_close(m["reward_accuracy"], torch.tensor(0.5, dtype=D))
    assert_close(m["reward_margin"], torch.tensor(0.05, dtype=D))  # (0.3 - 0.2) / 2
    assert_close(m["chosen_reward"], torch.tensor(0.1, dtype=D))  # (0.2 + 0) / 2
    assert_close(m["rejected_reward"], torch.tensor(0.05, dtype=D))  # (-0.1 + 0.2) / 2
    # d/d pi_c of -log sigma(h) / 2 = -beta sigma(-h) / 2; d/d pi_r = +beta sigma(-h) / 2
    loss.backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert_close(pc.grad, torch.tensor([-0.1 * sig(-0.3) / 2, -0.1 * sig(0.2) / 2], dtype=D))
    assert_close(pr.grad, -pc.grad)


def test_dpo_loss_weighted_mean():
    pc, pr, rc, rr = _pairs()
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, weights=torch.tensor([3.0, 1.0], dtype=D))
    # (3 * 0.5543552 + 1 * 0.7981389) / 4 = 0.6153011
    assert_close(loss, torch.tensor((3 * _softplus(-0.3) + _softplus(0.2)) / 4, dtype=D))


def test_dpo_loss_without_pairs_is_zero_not_nan():
    empty = torch.zeros(0, dtype=D, requires_grad=True)
    loss, m = dpo_loss(empty, empty, empty.detach(), empty.detach(), beta=0.1)
    assert_close(loss, torch.tensor(0.0, dtype=D))
    assert all(torch.isfinite(v) and v == 0 for v in m.values())
    loss.backward()


def test_group_preference_pairs_with_ties():
    # group 0: rewards [1, 0, 1, 0.5] (indices 0..3); group 1: [2, 2] (a tie: no pair); group 2: [3]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 3.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    chosen, rejected, w = group_preference_pairs(rewards, group_ids, bt_weighting=False)
    # r_i > r_j within group 0, row-major: (0,1) (0,3) (2,1) (2,3) (3,1); (0,2) is a tie
    assert chosen.tolist() == [0, 0, 2, 2, 3]
    assert rejected.tolist() == [1, 3, 1, 3, 1]
    assert chosen.dtype == torch.long and rejected.dtype == torch.long
    assert_close(w, torch.ones(5))
    _, _, w_bt = group_preference_pairs(rewards, group_ids, bt_weighting=True)
    # sigma(r_i - r_j): differences [1, 0.5, 1, 0.5, 0.5]
    s1, s05 = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-0.5))
    assert_close(w_bt, torch.tensor([s1, s05, s1, s05, s05]))


def test_group_pairs_feed_dpo():
    rewards = torch.tensor([1.0, 0.0])
    chosen, rejected, w = group_preference_pairs(rewards, torch.tensor([4, 4]), bt_weighting=True)
    token_logps = torch.tensor([[-1.0, -2.0, 99.0], [-3.0, 99.0, 99.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    seq = sequence_logps(token_logps, mask)
    assert_close(seq, torch.tensor([-3.0, -3.0], dtype=D))
    loss, _ = dpo_loss(seq[chosen], seq[rejected], seq[chosen] + 1.0, seq[rejected], beta=0.5, weights=w)
    # h = 0.5 * [(-3 - (-2)) - 0] = -0.5 -> loss = log(1 + e^0.5)
    assert_close(loss, torch.tensor(_softplus(0.5), dtype=D))


def test_ipo_loss_by_hand():
    """IPO (arXiv 2310.12036 eq. 17): L = mean (h - 1/(2 beta))^2, h = chosen log-ratio - rejected log-ratio.
    beta = 0.5 -> target 1/(2*0.5) = 1.
    pair 0: h = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2  -> (2 - 1)^2 = 1
    pair 1: h = (-2 - -2) - (-2 - -2) = 0             -> (0 - 1)^2 = 1
    pair 2: h = (-1 - -1.5) - (-2 - -1.5) = 0.5+0.5=1 -> 0
    mean = 2/3."""
    from grpo_lab.algos import PREFERENCE_LOSSES, ipo_loss

    pc, pr = torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-3.0, -2.0, -2.0])
    rc, rr = torch.tensor([-2.0, -2.0, -1.5]), torch.tensor([-2.0, -2.0, -1.5])
    loss, m = ipo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(2 / 3)
    # implicit rewards are beta-scaled log-ratios: margins 0.5*2, 0, 0.5*1 -> mean 0.5; accuracy 2/3
    assert m["reward_margin"].item() == pytest.approx(0.5)
    assert m["reward_accuracy"].item() == pytest.approx(2 / 3)
    assert PREFERENCE_LOSSES.get("ipo") is ipo_loss and "dpo" in PREFERENCE_LOSSES


def test_pairings_are_registered_with_their_settings():
    from grpo_lab.algos import PAIRINGS

    rewards, groups = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0])
    c, r, w = PAIRINGS.call("all_pairs", rewards, groups, bt_weighting=False, beta=0.1)  # beta: not its setting
    assert sorted(zip(c.tolist(), r.tolist())) == [(0, 1), (0, 2), (2, 1)]
    c, r, w = PAIRINGS.call("best_worst", rewards, groups, bt_weighting=True)
    assert (c.tolist(), r.tolist()) == ([0], [1])
