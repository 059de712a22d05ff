"""Rollout correction (grpo_lab/algos/rollout_correction.py): the weights of every level and mode on one
example computed by hand, the effective sample size, a perfect engine/learner match left untouched,
and the sampler/learner mismatch metrics."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    effective_sample_size,
    logprob_mismatch_metrics,
    rollout_correction_weights,
)

D = torch.float64
GARBAGE = 1.0e4

# rho_t = pi_learner / pi_engine per real token:
#   seq 0: [2, 0.5, 3]   -> product 3,   geometric mean 3^(1/3) = 1.4422496
#   seq 1: [0.25, 0.8]   -> product 0.2, geometric mean 0.2^(1/2) = 0.4472136   (third token: padding)
RHO = [[2.0, 0.5, 3.0], [0.25, 0.8, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
GEO0, GEO1 = 3 ** (1 / 3), 0.2 ** 0.5


def _logprobs():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -GARBAGE]], dtype=D)
    learner = sampler + torch.log(torch.tensor(RHO, dtype=D))
    learner[1, 2] = GARBAGE                                   # padding: never read
    return learner, sampler


def _weights(level, mode, upper, lower=None):
    learner, sampler = _logprobs()
    return rollout_correction_weights(learner, sampler, MASK, level=level, mode=mode, upper=upper, lower=lower)


def test_token_truncate_by_hand():
    # min(rho, 2.5): [2, 0.5, 2.5], [0.25, 0.8]; one of 5 tokens truncated (the 3)
    # mean 6.05 / 5 = 1.21; ESS = 6.05^2 / (5 (4 + 0.25 + 6.25 + 0.0625 + 0.64)) = 36.6025 / 56.0125
    w, m = _weights("token", "truncate", upper=2.5)
    assert_close(w, torch.tensor([[2.0, 0.5, 2.5], [0.25, 0.8, 0.0]], dtype=D))
    assert_close(m["correction_truncated_frac"], torch.tensor(1 / 5, dtype=D))
    assert m["correction_masked_frac"] == 0
    assert_close(m["correction_weight_mean"], torch.tensor(1.21, dtype=D))
    assert_close(m["correction_ess"], torch.tensor(36.6025 / 56.0125, dtype=D))
    assert not w.requires_grad


def test_token_truncate_with_a_lower_bound():
    # clamp to [0.4, 2.5]: the 0.25 is raised to 0.4; two of 5 tokens changed
    w, m = _weights("token", "truncate", upper=2.5, lower=0.4)
    assert_close(w, torch.tensor([[2.0, 0.5, 2.5], [0.4, 0.8, 0.0]], dtype=D))
    assert_close(m["correction_truncated_frac"], torch.tensor(2 / 5, dtype=D))


def test_token_mask_by_hand():
    # outside [0.4, 2.5]: the 3 and the 0.25 get weight 0, the rest keep rho: [2, 0.5, 0], [0, 0.8]
    # mean 3.3 / 5 = 0.66; ESS = 3.3^2 / (5 (4 + 0.25 + 0.64)) = 10.89 / 24.45
    w, m = _weights("token", "mask", upper=2.5, lower=0.4)
    assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [0.0, 0.8, 0.0]], dtype=D))
    assert_close(m["correction_masked_frac"], torch.tensor(2 / 5, dtype=D))
    assert m["correction_truncated_frac"] == 0
    assert_close(m["correction_weight_mean"], torch.tensor(0.66, dtype=D))
    assert_close(m["correction_ess"], torch.tensor(10.89 / 24.45, dtype=D))


def test_sequence_truncate_by_hand():
    # product per answer: 3 -> min(3, 2) = 2 on each of seq 0's tokens; 0.2 on seq 1's two
    # units are the 2 answers: one truncated; mean (2 + 0.2) / 2 = 1.1; ESS 2.2^2 / (2 (4 + 0.04)) = 4.84 / 8.08
    w, m = _weights("sequence", "truncate", upper=2.0)
    assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [0.2, 0.2, 0.0]], dtype=D))
    assert_close(m["correction_truncated_frac"], torch.tensor(1 / 2, dtype=D))
    assert_close(m["correction_weight_mean"], torch.tensor(1.1, dtype=D))
    assert_close(m["correction_ess"], torch.tensor(4.84 / 8.08, dtype=D))


def test_sequence_mask_by_hand():
    # verl's Seq-MIS bounds [0.5, 2]: 3 and 0.2 both lie outside, so both answers are dropped
    w, m = _weights("sequence", "mask", upper=2.0, lower=0.5)
    assert (w == 0).all()
    assert m["correction_masked_frac"] == 1 and m["correction_ess"] == 0 and m["correction_weight_mean"] == 0
    # [0.1, 5]: both kept, each with its own product
    w, m = _weights("sequence", "mask", upper=5.0, lower=0.1)
    assert_close(w, torch.tensor([[3.0, 3.0, 3.0], [0.2, 0.2, 0.0]], dtype=D))
    assert m["correction_masked_frac"] == 0


def test_geometric_by_hand():
    # exp(mean log rho): 3^(1/3) = 1.4422496 and 0.2^(1/2) = 0.4472136
    assert abs(GEO0 - 1.4422496) < 1e-7 and abs(GEO1 - 0.4472136) < 1e-7
    w, m = _weights("geometric", "mask", upper=1.5, lower=0.4)                 # both inside
    assert_close(w, torch.tensor([[GEO0, GEO0, GEO0], [GEO1, GEO1, 0.0]], dtype=D))
    assert m["correction_masked_frac"] == 0
    w, m = _weights("geometric", "mask", upper=1.001, lower=0.999)             # verl's Geo-RS: both out
    assert (w == 0).all() and m["correction_masked_frac"] == 1
    w, m = _weights("geometric", "truncate", upper=1.2, lower=0.5)             # both clamped
    assert_close(w, torch.tensor([[1.2, 1.2, 1.2], [0.5, 0.5, 0.0]], dtype=D))
    assert m["correction_truncated_frac"] == 1


@pytest.mark.parametrize(("level", "mode"), list(itertools.product(ROLLOUT_CORRECTION_LEVELS.names(),
                                                                   ROLLOUT_CORRECTION_MODES.names())))
def test_a_perfect_match_is_left_alone(level, mode):
    """Engine and learner agree (rho = 1): weight 1 on every real token, 0 on padding, nothing bounded, ESS 1."""
    _, sampler = _logprobs()
    w, m = rollout_correction_weights(sampler, sampler, MASK, level=level, mode=mode, upper=1.001, lower=0.999)
    assert_close(w, MASK.to(D))
    assert m["correction_truncated_frac"] == 0 and m["correction_masked_frac"] == 0
    assert_close(m["correction_ess"], torch.tensor(1.0, dtype=D))


def test_a_long_answers_product_does_not_overflow():
    # 400 tokens of rho = e^5: the product e^2000 overflows float64; the bounds are applied in log space.
    learner, sampler = torch.full((1, 400), -1.0, dtype=D), torch.full((1, 400), -6.0, dtype=D)
    w, m = rollout_correction_weights(learner, sampler, torch.ones(1, 400), level="sequence", mode="truncate",
                                      upper=2.0)
    assert (w == 2.0).all() and torch.isfinite(m["correction_ess"])
    w, _ = rollout_correction_weights(learner, sampler, torch.ones(1, 400), level="sequence", mode="mask", upper=2.0)
    assert (w == 0).all()


def test_an_empty_row_is_not_a_unit():
    # seq 1 has no real token: the sequence level counts one answer, so nothing is truncated at 5
    learner, sampler = _logprobs()
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    w, m = rollout_correction_weights(learner, sampler, mask, level="sequence", mode="truncate", upper=5.0)
    assert_close(w, torch.tensor([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]], dtype=D))
    assert m["correction_truncated_frac"] == 0 and m["correction_ess"] == 1


def test_bounds_that_would_change_a_perfect_match_are_refused():
    learner, sampler = _logprobs()
    with pytest.raises(ValueError, match="upper bound must be >= 1"):
        rollout_correction_weights(learner, sampler, MASK, level="token", mode="truncate", upper=0.5)
    with pytest.raises(ValueError, match="lower bound must lie in"):
        rollout_correction_weights(learner, sampler, MASK, level="token", mode="mask", upper=2.0, lower=1.5)


def test_effective_sample_size_by_hand():
    units = torch.ones(4, dtype=torch.bool)
    # equal weights: (4)^2 / (4 * 4) = 1; one weight carries everything: 16 / (4 * 16) = 1/4; none: 0
    assert_close(effective_sample_size(torch.ones(4, dtype=D), units), torch.tensor(1.0, dtype=D))
    assert_close(effective_sample_size(torch.tensor([4.0, 0, 0, 0], dtype=D), units), torch.tensor(0.25, dtype=D))
    assert effective_sample_size(torch.zeros(4, dtype=D), units) == 0
    # a weight outside the units does not count: [1, 3] over 2 units -> 16 / (2 * 10) = 0.8
    w = torch.tensor([1.0, 3.0, GARBAGE], dtype=D)
    assert_close(effective_sample_size(w, torch.tensor([True, True, False])), torch.tensor(0.8, dtype=D))


def test_logprob_mismatch_metrics_by_hand():
    learner = torch.tensor([[-1.0, -2.0, -0.5, GARBAGE]], dtype=D)
    sampler = torch.tensor([[-1.5, -1.0, -0.5, -GARBAGE]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])
    m = logprob_mismatch_metrics(learner, sampler, mask)
    # |diff| = [0.5, 1.0, 0] -> mean 0.5, max 1.0
    assert_close(m["logprob_abs_diff_mean"], torch.tensor(0.5, dtype=D))
    assert_close(m["logprob_abs_diff_max"], torch.tensor(1.0, dtype=D))
    # k3 of KL(sampler || learner), x = learner - sampler = [0.5, -1, 0]:
    # (e^0.5 - 0.5 - 1) + (e^-1 + 1 - 1) + 0 = 0.1487213 + 0.3678794 -> mean over 3 = 0.1722002
    expected = ((math.exp(0.5) - 1.5) + math.exp(-1.0)) / 3
    assert_close(m["kl_k3"], torch.tensor(expected, dtype=D))
    assert abs(expected - 0.1722002) < 1e-7
