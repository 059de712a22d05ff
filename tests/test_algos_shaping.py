"""DAPO shaping parts and training tricks, by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import (
    best_of_group_mask,
    ema_reward_normalize,
    group_stats,
    informative_group_mask,
    linear_warmup,
    soft_overlong_penalty,
)


def test_soft_overlong_penalty_region_boundaries():
    # L_max = 20, L_cache = 5 -> expected length 15
    #   |y| = 0, 15      -> 0                    (at the boundary still 0)
    #   |y| = 16         -> (15 - 16)/5 = -0.2
    #   |y| = 18         -> (15 - 18)/5 = -0.6
    #   |y| = 20 = L_max -> (15 - 20)/5 = -1.0
    #   |y| = 21 > L_max -> -1
    lengths = torch.tensor([0, 15, 16, 18, 20, 21])
    expected = torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    assert_close(soft_overlong_penalty(lengths, max_len=20, buffer_len=5), expected)
    assert_close(soft_overlong_penalty(lengths, max_len=20, buffer_len=5, penalty=0.5), 0.5 * expected)


def test_soft_overlong_penalty_validates_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=0)
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)


REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.3, 0.3 + 1e-8, 7.0], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 4])
# group 0: all 1 (agree); group 1: [0, 1] (informative); group 2: size 1 (agrees);
# group 3: [0.3, 0.3 + 1e-8] agree within atol 1e-6; group 4: size 1


def test_informative_group_mask():
    keep = informative_group_mask(REWARDS, GROUPS)
    assert keep.tolist() == [False, False, False, True, True, False, False, False, False]


def test_dynamic_sampling_and_advantages_share_one_definition_of_agreeing_rewards():
    """A group dynamic sampling drops (rewards agree within REWARD_ATOL) gets advantage exactly 0 from
    every group estimator, and every group it keeps gets a non-zero advantage somewhere."""
    from grpo_lab.algos import ADVANTAGE_ESTIMATORS

    keep = informative_group_mask(REWARDS, GROUPS)
    token_rewards, mask = REWARDS[:, None], torch.ones(len(REWARDS), 1)
    for name in ("group_zscore", "group_mean", "group_mean_batch_std", "rloo"):
        adv, _ = ADVANTAGE_ESTIMATORS.call(name, token_rewards, mask, GROUPS, adv_eps=1e-6)
        assert (adv[~keep] == 0).all(), name
        assert (adv[keep] != 0).all(), name


def test_group_stats():
    stats = group_stats(REWARDS, GROUPS)
    # 5 groups, 4 agree (0, 2, 3, 4) -> 0.8
    assert_close(stats["zero_adv_group_frac"], torch.tensor(0.8, dtype=torch.float64))
    # within-group unbiased std: g0 0; g1 [0, 1]: sqrt(0.5) = 0.7071068; g2 0; g3 sqrt(0.5) * 1e-8; g4 0
    expected_std = (math.sqrt(0.5) + math.sqrt(0.5) * 1e-8) / 5
    assert_close(stats["group_reward_std"], torch.tensor(expected_std, dtype=torch.float64))


def test_best_of_group_mask_ties_to_first():
    # group 0: [1, 1, 1] tie -> index 0; group 1: [0, 1] -> index 4; group 2 -> 5;
    # group 3: max 0.3 + 1e-8 -> index 7 (float64 keeps it distinct); group 4 -> 8
    mask = best_of_group_mask(REWARDS, GROUPS)
    assert mask.tolist() == [True, False, False, False, True, True, False, True, True]
    # ids need not be sorted or contiguous
    mask2 = best_of_group_mask(torch.tensor([0.2, 0.9, 0.9, 0.1]), torch.tensor([7, 3, 7, 3]))
    assert mask2.tolist() == [False, True, True, False]


def test_ema_reward_normalize_by_hand():
    # first call initialises from the batch: mean 2, population var ((1)^2 + 0 + 1)/3 = 2/3
    r1 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    n1, mean, var, count = ema_reward_normalize(r1, 0.0, 1.0, 0, decay=0.9)
    assert (mean, count) == (2.0, 3)
    assert abs(var - 2 / 3) < 1e-12
    assert_close(n1, (r1 - 2.0) / math.sqrt(2 / 3 + 1e-8))
    # second call: batch [4, 6] has mean 5, var 1
    #   mean' = 0.9 * 2 + 0.1 * 5 = 2.3;  var' = 0.9 * 2/3 + 0.1 * 1 = 0.7
    r2 = torch.tensor([4.0, 6.0], dtype=torch.float64)
    n2, mean2, var2, count2 = ema_reward_normalize(r2, mean, var, count, decay=0.9)
    assert abs(mean2 - 2.3) < 1e-12 and abs(var2 - 0.7) < 1e-12 and count2 == 5
    assert_close(n2, (r2 - 2.3) / math.sqrt(0.7 + 1e-8))


def test_linear_warmup():
    assert linear_warmup(0, 10, 0.5) == 0.0
    assert linear_warmup(4, 10, 0.5) == pytest.approx(0.2)  # 0.5 * 4/10
    assert linear_warmup(10, 10, 0.5) == 0.5
    assert linear_warmup(25, 10, 0.5) == 0.5
    assert linear_warmup(3, 0, 0.5) == 0.5  # no warmup
