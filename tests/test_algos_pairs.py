"""best_worst_pairs: one (best, worst) pair per group, none for groups whose rewards agree."""

import torch

from grpo_lab.algos import best_worst_pairs


def test_one_pair_per_informative_group():
    # group 0: rewards [0, 1, 0.5] -> best index 1, worst index 0 (first of the minimum)
    # group 1: rewards [1, 1]      -> all agree, no pair
    # group 2: rewards [0.2, 0.9]  -> best 6, worst 5
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.2, 0.9])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    chosen, rejected, weights = best_worst_pairs(rewards, groups)
    assert chosen.tolist() == [1, 6]
    assert rejected.tolist() == [0, 5]
    assert weights.tolist() == [1.0, 1.0]


def test_no_pairs_when_every_group_agrees():
    chosen, rejected, weights = best_worst_pairs(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert chosen.numel() == rejected.numel() == weights.numel() == 0
