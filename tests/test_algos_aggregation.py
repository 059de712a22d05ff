"""Loss aggregation modes on a padded example, and NaN-safety (the micro-batch invariance lives in
test_algos_microbatch.py)."""

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import AGGREGATIONS, aggregate

GARBAGE = 1.0e4  # at masked positions; must never reach a result

# Two sequences, T = 3; the second has one padding token.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, GARBAGE]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # (1+2+3+4+5) / 5 tokens = 15/5
        ("token_mean", 3.0),
        # seq means: (1+2+3)/3 = 2 and (4+5)/2 = 4.5; mean over 2 seqs = 3.25
        ("seq_mean_token_mean", 3.25),
        # seq sums: 6 and 9; mean over 2 seqs = 7.5
        ("seq_mean_token_sum", 7.5),
        # 15 / (2 seqs * max_len T=3) = 2.5
        ("seq_mean_token_sum_norm", 2.5),
    ],
)
def test_modes_by_hand(mode, expected):
    assert_close(aggregate(LOSS, MASK, mode), torch.tensor(expected, dtype=torch.float64))
    # a bool or float mask gives the same
    assert_close(aggregate(LOSS, MASK.bool(), mode), torch.tensor(expected, dtype=torch.float64))
    assert_close(aggregate(LOSS, MASK.double(), mode), torch.tensor(expected, dtype=torch.float64))
    assert_close(AGGREGATIONS.get(mode)(LOSS, MASK), torch.tensor(expected, dtype=torch.float64))


def test_explicit_global_counts():
    # token_mean with num_tokens=10 (a minibatch twice this size): 15/10
    assert_close(aggregate(LOSS, MASK, "token_mean", num_tokens=10), torch.tensor(1.5, dtype=torch.float64))
    # seq_mean_token_mean with num_seqs=4: (2 + 4.5)/4 = 1.625
    assert_close(
        aggregate(LOSS, MASK, "seq_mean_token_mean", num_seqs=4), torch.tensor(1.625, dtype=torch.float64)
    )
    # seq_mean_token_sum with num_seqs=5: 15/5 = 3
    assert_close(
        aggregate(LOSS, MASK, "seq_mean_token_sum", num_seqs=5), torch.tensor(3.0, dtype=torch.float64)
    )
    # Dr.GRPO normaliser with the generation budget max_len=5: 15/(2*5) = 1.5
    assert_close(
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm", max_len=5), torch.tensor(1.5, dtype=torch.float64)
    )
    # counts given as tensors work too: 15/(3*5) = 1
    assert_close(
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm", num_seqs=torch.tensor(3.0), max_len=5),
        torch.tensor(1.0, dtype=torch.float64),
    )


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_masked_values_do_not_matter(mode):
    other = LOSS.clone()
    other[1, 2] = -123456.0
    assert_close(aggregate(other, MASK, mode), aggregate(LOSS, MASK, mode))


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_all_padding_row_is_ignored_and_never_nan(mode):
    # An extra all-padding row: not counted as a sequence, no 0/0; same value as without it.
    loss = torch.cat([LOSS, torch.full((1, 3), GARBAGE, dtype=torch.float64)]).requires_grad_()
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    value = aggregate(loss, mask, mode)
    assert_close(value, aggregate(LOSS, MASK, mode))
    value.backward()
    assert torch.isfinite(loss.grad).all() and (loss.grad[2] == 0).all() and loss.grad[1, 2] == 0


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_fully_masked_batch_is_zero_not_nan(mode):
    loss = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    value = aggregate(loss, torch.zeros(2, 3), mode)
    assert_close(value, torch.tensor(0.0, dtype=torch.float64))
    value.backward()
    assert_close(loss.grad, torch.zeros(2, 3, dtype=torch.float64))


def test_gradients_by_hand():
    # d/dl_{i,t}: token_mean 1/5 everywhere real; seq_mean_token_mean 1/(2*len_i) -> 1/6 and 1/4
    loss = LOSS.clone().requires_grad_()
    aggregate(loss, MASK, "token_mean").backward()
    assert_close(loss.grad, torch.tensor([[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]], dtype=torch.float64))
    loss.grad = None
    aggregate(loss, MASK, "seq_mean_token_mean").backward()
    assert_close(loss.grad, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [0.25, 0.25, 0.0]], dtype=torch.float64))


def test_unknown_mode_names_choices():
    with pytest.raises(KeyError, match="unknown loss aggregation 'seq_mean'; valid choices: token_mean"):
        aggregate(LOSS, MASK, "seq_mean")
