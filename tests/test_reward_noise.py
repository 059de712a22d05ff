"""Reward and preference-label noise (grpo_lab/rewards/noise.py), checked by hand and by rate."""

import pytest
import torch

from grpo_lab.rewards.noise import REWARD_NOISE, flip_pairs, noise_metrics


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_none_is_the_clean_reward_and_draws_nothing():
    clean = torch.tensor([0.0, 1.0, 1.0])
    g = gen()
    before = g.get_state().clone()
    noisy, metrics = REWARD_NOISE.call("none", clean, generator=g, flip_prob=0.3, std=1.0)
    assert noisy is clean and metrics == {}
    assert torch.equal(g.get_state(), before)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.3])
def test_flip_rate_is_p_within_four_standard_errors(p):
    n = 200_000
    clean = (torch.arange(n) % 2).float()
    noisy, metrics = REWARD_NOISE.call("flip", clean, generator=gen(1), flip_prob=p)
    flipped = noisy != clean
    se = (p * (1 - p) / n) ** 0.5
    assert abs(flipped.float().mean().item() - p) <= 4 * se + 1e-12
    assert metrics["noise_flipped_frac"] == pytest.approx(flipped.float().mean().item())
    # a flip is 1 − r; the rest is untouched
    assert torch.equal(noisy[flipped], 1 - clean[flipped]) and torch.equal(noisy[~flipped], clean[~flipped])
    # both classes are flipped at the same rate (symmetric label noise)
    for cls in (0.0, 1.0):
        assert abs(flipped[clean == cls].float().mean().item() - p) <= 4 * (2 ** 0.5) * se + 1e-12


def test_flip_is_seeded():
    clean = torch.ones(64)
    a, _ = REWARD_NOISE.call("flip", clean, generator=gen(7), flip_prob=0.5)
    b, _ = REWARD_NOISE.call("flip", clean, generator=gen(7), flip_prob=0.5)
    c, _ = REWARD_NOISE.call("flip", clean, generator=gen(8), flip_prob=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_flip_refuses_a_graded_reward_naming_the_key():
    with pytest.raises(ValueError, match=r"reward.noise.kind=flip needs a 1/0 reward, got 0.75"):
        REWARD_NOISE.call("flip", torch.tensor([1.0, 0.75]), generator=gen(), flip_prob=0.1)
    assert REWARD_NOISE.fact("flip", "binary_only") and not REWARD_NOISE.fact("gaussian", "binary_only")


def test_gaussian_adds_zero_mean_noise_of_the_given_std():
    clean = torch.zeros(100_000)
    noisy, _ = REWARD_NOISE.call("gaussian", clean, generator=gen(2), std=0.5)
    assert abs(noisy.mean().item()) < 4 * 0.5 / 100_000 ** 0.5
    assert noisy.std().item() == pytest.approx(0.5, rel=0.02)


def test_judge_like_by_hand():
    # Without random parts: r + length_bias * len / L = [1 + 0.5*8/32, 0 + 0.5*32/32] = [1.125, 0.5].
    clean = torch.tensor([1.0, 0.0])
    noisy, m = REWARD_NOISE.call("judge_like", clean, generator=gen(), prompt_keys=torch.tensor([3, 3]),
                                 lengths=torch.tensor([8, 32]), max_new_tokens=32, seed=0,
                                 prompt_bias_std=0.0, std=0.0, length_bias=0.5)
    assert torch.allclose(noisy, torch.tensor([1.125, 0.5]))
    assert m["noise_length_term"] == pytest.approx((0.125 + 0.5) / 2)


def test_judge_like_bias_is_fixed_per_prompt_across_steps_and_draws():
    kw = dict(lengths=torch.zeros(4), max_new_tokens=16, seed=5, prompt_bias_std=1.0, std=0.0, length_bias=0.0)
    clean = torch.zeros(4)
    a, _ = REWARD_NOISE.call("judge_like", clean, generator=gen(1), prompt_keys=torch.tensor([11, 11, 12, 12]), **kw)
    b, _ = REWARD_NOISE.call("judge_like", clean, generator=gen(2), prompt_keys=torch.tensor([12, 11, 13, 11]), **kw)
    assert a[0] == a[1] and a[2] == a[3] and a[0] != a[2]           # one bias per prompt
    assert b[1] == a[0] and b[3] == a[0] and b[0] == a[2]            # the same prompt, the same bias


def test_noise_metrics_by_hand():
    clean = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert noise_metrics(clean, clean) == {"clean_mean": 0.5, "noisy_mean": 0.5, "noise_corr": 1.0}
    # one of four flipped: centred clean (-.5,.5,.5,-.5), noisy (1,1,1,0) centred (.25,.25,.25,-.75):
    # cov = -.125+.125+.125+.375 = .5; |c| = 1, |n| = sqrt(.75) -> corr = .5/.866 = 0.5774
    m = noise_metrics(clean, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert m["noisy_mean"] == 0.75 and m["noise_corr"] == pytest.approx(0.5 / 0.75 ** 0.5)


def test_flip_pairs_swaps_at_rate_p():
    p, n = 0.2, 100_000
    chosen, rejected = torch.arange(n), torch.arange(n) + n
    c, r, flipped = flip_pairs(chosen, rejected, generator=gen(3), flip_prob=p)
    assert abs(flipped.float().mean().item() - p) <= 4 * (p * (1 - p) / n) ** 0.5
    assert torch.equal(c[flipped], rejected[flipped]) and torch.equal(r[flipped], chosen[flipped])
    assert torch.equal(c[~flipped], chosen[~flipped]) and torch.equal(r[~flipped], rejected[~flipped])


def test_a_prompt_keeps_its_judge_bias_across_steps_of_a_run():
    """judge_like's bias belongs to the judge: the same prompt text met in two steps (two rollout seeds)
    gets the same bias, from the run's seed; the per-sample draws still follow the rollout's seed."""
    from omegaconf import OmegaConf

    from grpo_lab.sampling import noisy_rewards
    from grpo_lab.rollout import Rollout
    from grpo_lab.tasks.base import TaskItem

    noise = OmegaConf.create({"kind": "judge_like", "flip_prob": 0.0, "std": 0.0, "prompt_bias_std": 1.0,
                              "length_bias": 0.0})
    items = [TaskItem(prompt="12+3=", answer="15", solution="15"), TaskItem(prompt="7-9=", answer="-2", solution="-2")]
    rollout = Rollout([[1]] * 2, [[5]] * 2, [[0.0]] * 2, ["15", "3"], [0, 1], [False, False])
    clean = torch.tensor([1.0, 0.0])
    step_a, _ = noisy_rewards(clean, rollout, items, noise, seed=101, judge_seed=3, max_new_tokens=8)
    step_b, _ = noisy_rewards(clean, rollout, items, noise, seed=202, judge_seed=3, max_new_tokens=8)
    other_run, _ = noisy_rewards(clean, rollout, items, noise, seed=101, judge_seed=4, max_new_tokens=8)
    assert torch.equal(step_a, step_b) and not torch.equal(step_a, other_run)
    assert step_a[0] - 1.0 != step_a[1]          # two prompts, two biases
