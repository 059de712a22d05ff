"""Clipped value loss (PPO / OpenAI baselines) and entropy_from_logits, by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import clipped_value_loss, entropy_from_logits

D = torch.float64


def test_clipped_value_loss_by_hand():
    # clip = 0.2
    #  1. V=1.0, V_old=0.9, R=1.5: V-V_old = 0.1 inside -> V_clip = 1.0; 0.5 * 0.25 = 0.125
    #  2. V=1.5, V_old=1.0, R=2.0: V_clip = 1.2; (V-R)^2 = 0.25, (V_clip-R)^2 = 0.64 -> 0.32 clipped
    #  3. V=1.5, V_old=1.0, R=1.0: V_clip = 1.2; 0.25 vs 0.04 -> 0.125 (unclipped is larger)
    #  4. padding (garbage) -> 0
    values = torch.tensor([[1.0, 1.5, 1.5, 1e4]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.9, 1.0, 1.0, -1e4]], dtype=D)
    returns = torch.tensor([[1.5, 2.0, 1.0, 3e4]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip=0.2)
    assert_close(loss, torch.tensor([[0.125, 0.32, 0.125, 0.0]], dtype=D))
    assert_close(metrics["value_clip_frac"], torch.tensor(1 / 3, dtype=D))
    # gradient: V - R on the unclipped branch (-0.5, +0.5); 0 where the clipped error is used
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[-0.5, 0.0, 0.5, 0.0]], dtype=D))


def test_clipped_value_loss_rejects_negative_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="value clip must be >= 0"):
        clipped_value_loss(x, x, x, x, clip=-0.1)


def test_entropy_by_hand():
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.0397208
    # uniform over 3 (logits shifted by 1000, which must not matter): ln 3
    # [0, 0, -inf]: a banned token contributes 0: ln 2
    logits = torch.tensor(
        [[[math.log(0.5), math.log(0.25), math.log(0.25)], [1000.0, 1000.0, 1000.0], [0.0, 0.0, -math.inf]]],
        dtype=D,
        requires_grad=True,
    )
    h = entropy_from_logits(logits)
    assert h.shape == (1, 3)
    assert_close(h, torch.tensor([[1.5 * math.log(2), math.log(3), math.log(2)]], dtype=D))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_categorical():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert_close(entropy_from_logits(logits), expected)
