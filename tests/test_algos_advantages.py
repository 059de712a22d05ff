"""Advantage estimators: hand-computed values, group edge cases, masking and RLOO's identity."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import (
    ADVANTAGE_ESTIMATORS,
    gae,
    group_mean,
    group_mean_batch_std,
    group_zscore,
    reinforce_pp,
    rloo,
)

GARBAGE = 1.0e4  # at masked positions; must never reach a result
D = torch.float64

# Seven sequences, T = 3, three groups with non-contiguous ids:
#   group 10: rewards [0, 1, 1, 0]  (seq 1 spreads its reward over two tokens: 0.5 + 0.5)
#   group 3:  rewards [5]           (size 1)
#   group 8:  rewards [2, 2]        (zero std)
GROUP_IDS = torch.tensor([10, 10, 10, 10, 3, 8, 8])
MASK = torch.tensor(
    [
        [1, 1, 1],
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 1],
        [1, 1, 0],
        [1, 1, 1],
        [1, 0, 0],
    ]
)
TOKEN_REWARDS = torch.tensor(
    [
        [0.0, 0.0, 0.0],
        [0.5, 0.5, GARBAGE],
        [1.0, GARBAGE, GARBAGE],
        [0.0, 0.0, 0.0],
        [0.0, 5.0, GARBAGE],
        [0.0, 0.0, 2.0],
        [2.0, GARBAGE, GARBAGE],
    ],
    dtype=D,
)


def _broadcast(per_seq):
    """Expected [N, T]: the per-sequence value on real tokens, 0 on padding."""
    return torch.tensor(per_seq, dtype=D)[:, None] * MASK.to(D)


def test_group_zscore_by_hand():
    # group 10: mean 0.5; unbiased var = 4 * 0.25 / (4 - 1) = 1/3, std = 0.5773503 (Bessel; the
    # population std 0.5 would give +-1 instead). A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group 3 (size 1) -> 0; group 8 (zero std) -> 0
    adv, ret = group_zscore(TOKEN_REWARDS, MASK, GROUP_IDS)
    expected = _broadcast([-a, a, a, -a, 0.0, 0.0, 0.0])
    assert_close(adv, expected)
    assert_close(ret, expected)
    assert_close(expected[0, 0], torch.tensor(-0.8660239, dtype=D), atol=1e-7, rtol=0)


def test_group_zscore_eps():
    # eps = 0.5: A = 0.5 / (0.5773503 + 0.5) = 0.4641016
    adv, _ = group_zscore(TOKEN_REWARDS, MASK, GROUP_IDS, adv_eps=0.5)
    assert_close(adv[1, 0], torch.tensor(0.5 / (math.sqrt(1 / 3) + 0.5), dtype=D))


def test_group_mean_by_hand():
    # r - mean_g: group 10 -> [-0.5, 0.5, 0.5, -0.5]; singletons and constant groups -> 0
    adv, ret = group_mean(TOKEN_REWARDS, MASK, GROUP_IDS)
    assert_close(adv, _broadcast([-0.5, 0.5, 0.5, -0.5, 0.0, 0.0, 0.0]))
    assert_close(ret, adv)


def test_group_mean_batch_std_by_hand():
    # centred = [-.5, .5, .5, -.5, 0, 0, 0]; batch mean 0; unbiased batch std over the 7
    # sequences = sqrt(4 * 0.25 / 6) = 0.4082483; A = +-0.5 / (0.4082483 + 1e-6) = +-1.2247419
    a = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    adv, ret = group_mean_batch_std(TOKEN_REWARDS, MASK, GROUP_IDS)
    assert_close(adv, _broadcast([-a, a, a, -a, 0.0, 0.0, 0.0]))
    assert_close(ret, adv)


def test_rloo_by_hand():
    # group 10: r=0 -> 0 - mean(1, 1, 0) = -2/3; r=1 -> 1 - mean(0, 1, 0) = 2/3
    adv, ret = rloo(TOKEN_REWARDS, MASK, GROUP_IDS)
    assert_close(adv, _broadcast([-2 / 3, 2 / 3, 2 / 3, -2 / 3, 0.0, 0.0, 0.0]))
    assert_close(ret, adv)


def test_rloo_is_g_over_g_minus_1_times_group_mean():
    gen = torch.Generator().manual_seed(0)
    sizes = [2, 3, 5, 8, 1]
    group_ids = torch.cat([torch.full((g,), i) for i, g in enumerate(sizes)])
    n, t = group_ids.numel(), 6
    mask = torch.ones(n, t)
    scores = torch.randn(n, generator=gen, dtype=D)
    token_rewards = torch.zeros(n, t, dtype=D)
    token_rewards[:, -1] = scores
    a_rloo, _ = rloo(token_rewards, mask, group_ids)
    a_mean, _ = group_mean(token_rewards, mask, group_ids)
    size = torch.tensor(sizes, dtype=D)[group_ids]  # [N]
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    assert_close(a_rloo, factor[:, None] * a_mean)
    assert (a_rloo[-1] == 0).all()  # the size-1 group


def test_constant_groups_are_exactly_zero():
    # 0.1 + 0.1 + 0.1 is not 3 * 0.1 in floating point; the advantage must still be exactly 0
    token_rewards = torch.tensor([[0.1], [0.1], [0.1], [0.7]], dtype=torch.float32)
    mask = torch.ones(4, 1)
    group_ids = torch.tensor([0, 0, 0, 1])
    for name in ["group_zscore", "group_mean", "group_mean_batch_std", "rloo"]:
        adv, _ = ADVANTAGE_ESTIMATORS.get(name)(token_rewards, mask, group_ids)
        assert torch.equal(adv, torch.zeros(4, 1)), name


def test_reinforce_pp_by_hand():
    gamma = 0.5
    token_rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # returns-to-go, G_t = r_t + gamma G_{t+1}:
    #   seq 0: G_2 = 2, G_1 = 0 + 0.5*2 = 1, G_0 = 1 + 0.5*1 = 1.5
    #   seq 1: G_1 = 4, G_0 = 0 + 0.5*4 = 2, padding 0
    returns_expected = torch.tensor([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]], dtype=D)
    # whitening over the 5 real tokens: mean = 10.5/5 = 2.1;
    # deviations [-0.6, -1.1, -0.1, -0.1, 1.9], squares sum 5.2, unbiased var 5.2/4 = 1.3
    std = math.sqrt(1.3)
    adv_expected = torch.tensor([[-0.6, -1.1, -0.1], [-0.1, 1.9, 0.0]], dtype=D) / (std + 1e-6)
    adv, ret = reinforce_pp(token_rewards, mask, torch.tensor([0, 1]), gamma=gamma)
    assert_close(ret, returns_expected)
    assert_close(adv, adv_expected)


def test_gae_by_hand_1x3():
    gamma, lam = 0.9, 0.8
    token_rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=D)
    mask = torch.ones(1, 3)
    # delta_2 = 1 + 0.9*0   - 0.7 = 0.3;   A_2 = 0.3
    # delta_1 = 0 + 0.9*0.7 - 0.6 = 0.03;  A_1 = 0.03 + 0.72*0.3   = 0.246
    # delta_0 = 0 + 0.9*0.6 - 0.5 = 0.04;  A_0 = 0.04 + 0.72*0.246 = 0.21712
    raw = [0.21712, 0.246, 0.3]
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae(token_rewards, mask, torch.tensor([0]), values=values, gamma=gamma, lam=lam)
    assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]], dtype=D))
    # whitened: mean 0.76312/3, unbiased std over the 3 tokens
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 2)
    assert_close(adv, torch.tensor([[(a - mean) / (std + 1e-6) for a in raw]], dtype=D))


def test_gae_padding_and_monte_carlo_limit():
    # Right padding with garbage rewards/values changes nothing; with gamma = lam = 1 and V = 0,
    # raw A_t (= returns) is the undiscounted reward-to-go: [1+2, 2] for [1, 2, pad].
    token_rewards = torch.tensor([[1.0, 2.0, GARBAGE]], dtype=D)
    values = torch.tensor([[0.0, 0.0, GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    _, ret = gae(token_rewards, mask, torch.tensor([0]), values=values)
    assert_close(ret, torch.tensor([[3.0, 2.0, 0.0]], dtype=D))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="'gae' needs critic values"):
        gae(TOKEN_REWARDS, MASK, GROUP_IDS)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_masked_positions_do_not_matter(name):
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(7, 3, generator=gen, dtype=D)
    settings = dict(gamma=0.9, lam=0.95, adv_eps=1e-6)   # all settings; each estimator takes what it reads
    adv, ret = ADVANTAGE_ESTIMATORS.call(name, TOKEN_REWARDS, MASK, GROUP_IDS, values=values, **settings)
    pad = MASK == 0
    other_rewards = torch.where(pad, -7.0e5, TOKEN_REWARDS)
    other_values = torch.where(pad, 3.0e5, values)
    adv2, ret2 = ADVANTAGE_ESTIMATORS.call(name, other_rewards, MASK, GROUP_IDS, values=other_values, **settings)
    assert_close(adv2, adv)
    assert_close(ret2, ret)
    assert (adv[pad] == 0).all() and (ret[pad] == 0).all()
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@pytest.mark.parametrize("name", ["group_zscore", "group_mean", "group_mean_batch_std", "rloo"])
def test_outcome_estimators_are_constant_over_each_sequence(name):
    adv, _ = ADVANTAGE_ESTIMATORS.get(name)(TOKEN_REWARDS, MASK, GROUP_IDS)
    first = adv[:, :1].expand_as(adv)
    assert_close(adv, first * MASK.to(D))


def test_bf16_rewards_are_computed_in_float32():
    adv, _ = group_zscore(TOKEN_REWARDS.to(torch.bfloat16).clamp(max=10), MASK, GROUP_IDS)
    assert adv.dtype == torch.float32
