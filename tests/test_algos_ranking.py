"""Reward-model ranking losses (grpo_lab/algos/ranking.py), computed by hand."""

import math

import pytest
import torch

from grpo_lab.algos import RANKING_LOSSES, bradley_terry_loss, plackett_luce_loss


def test_bradley_terry_on_pairs_by_hand():
    # Two pairs: s_w - s_l = 1 and -2. loss = mean(-log σ(1), -log σ(-2)) = (0.31326 + 2.12693) / 2
    scores = torch.tensor([[2.0, 1.0], [0.0, 2.0]])
    loss, m = bradley_terry_loss(scores, torch.ones(2, 2))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(2))) / 2, rel=1e-6)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == pytest.approx(-0.5)


def test_bradley_terry_margin_shifts_each_pair_by_its_rows_margin():
    # Llama 2's margin: -log σ(s_w - s_l - m); pair 1 has m = 1 so its difference 1 becomes 0: log 2.
    scores = torch.tensor([[2.0, 1.0], [0.0, 2.0]])
    loss, _ = bradley_terry_loss(scores, torch.ones(2, 2), margin=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx((math.log(2) + math.log1p(math.exp(2))) / 2, rel=1e-6)


def test_bradley_terry_on_a_ranked_list_uses_adjacent_pairs_and_skips_padding():
    # Row [3, 1, 2] (best first) has adjacent pairs (3,1), (1,2); the padded third entry of row 2 is ignored.
    scores = torch.tensor([[3.0, 1.0, 2.0], [1.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = bradley_terry_loss(scores, mask)
    expected = sum(math.log1p(math.exp(-d)) for d in (2.0, -1.0, 1.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["accuracy"].item() == pytest.approx(2 / 3)


def test_plackett_luce_by_hand_and_equal_to_bradley_terry_for_pairs():
    # Ranking [a, b, c] with scores [2, 1, 0]:
    #   -log(e^2 / (e^2 + e + 1)) - log(e / (e + 1)); the last choice is certain.
    scores = torch.tensor([[2.0, 1.0, 0.0]])
    loss, _ = plackett_luce_loss(scores, torch.ones(1, 3))
    e = math.e
    expected = -math.log(e**2 / (e**2 + e + 1)) - math.log(e / (e + 1))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    pairs = torch.tensor([[2.0, 1.0], [0.0, 2.0]])
    pl, _ = plackett_luce_loss(pairs, torch.ones(2, 2))
    bt, _ = bradley_terry_loss(pairs, torch.ones(2, 2))
    assert pl.item() == pytest.approx(bt.item(), rel=1e-6)


def test_plackett_luce_ignores_padding_and_gives_finite_gradients():
    scores = torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])     # row 2 ranks two items: a pair
    loss, _ = plackett_luce_loss(scores, mask)
    e = math.e
    row1 = -math.log(e**2 / (e**2 + e + 1)) - math.log(e / (e + 1))
    row2 = math.log1p(math.exp(2.0))                # -log σ(1 - 3)
    assert loss.item() == pytest.approx((row1 + row2) / 2, rel=1e-6)
    loss.backward()
    assert torch.isfinite(scores.grad).all() and scores.grad[1, 2] == 0


def test_registry_names_and_margin_refused_by_plackett_luce():
    assert set(RANKING_LOSSES.names()) == {"bradley_terry", "plackett_luce"}
    with pytest.raises(ValueError, match="margin"):
        plackett_luce_loss(torch.zeros(1, 2), torch.ones(1, 2), margin=torch.zeros(1))
