"""The sampling pipeline around the math: group-size schedule, dynamic sampling's control flow, where the
scalar reward lands, overlong filtering, and preference pairing."""

from types import SimpleNamespace as NS

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.learner.batch import collate
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.sampling import (PromptStream, RewardNormalizer, ScoredRollout, collect_phase,
                               group_size_at)
from grpo_lab.rollout import Rollout
from grpo_lab.schema import AlgorithmConfig

ALGO = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), {
    "advantage": "group_zscore", "adv_eps": 1e-6, "gamma": 1.0, "lam": 1.0, "reward_ema_decay": None,
    "kl": {"coef": 0.0, "estimator": "k3", "placement": "loss"}, "overlong": {"filter": False},
    "sft_anchor_coef": 0.0, "sft_anchor_warmup": 0,
    "preference": {"loss": "dpo", "pairing": "best_worst", "bt_weighting": False}})


def test_group_size_schedule():
    cfg = OmegaConf.create({"group_size": 4, "group_size_schedule": {10: 8, 20: 16}})
    assert [group_size_at(s, cfg) for s in (1, 9, 10, 19, 20, 500)] == [4, 4, 8, 8, 16, 16]
    assert group_size_at(3, OmegaConf.create({"group_size": 4, "group_size_schedule": None})) == 4


def test_prompt_stream_covers_every_item_once_per_pass():
    stream = PromptStream(list(range(10)), seed=0)
    first, second = stream.take(10), stream.take(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second


def scored(rewards_per_group: list[list[float]]) -> ScoredRollout:
    groups = [g for g, rs in enumerate(rewards_per_group) for _ in rs]
    rewards = torch.tensor([r for rs in rewards_per_group for r in rs])
    n = len(groups)
    roll = Rollout([[1]] * n, [[5, 2]] * n, [[-0.1, -0.2]] * n, ["x"] * n, groups, [False] * n)
    return ScoredRollout(roll, [None] * n, rewards, (rewards > 0.5).float())


def test_dynamic_sampling_keeps_informative_groups_until_full():
    # Round 1: groups [1,1] (agree) and [0,1] (informative); round 2: [0,0] and [1,0]; need 2 groups.
    rounds = iter([scored([[1, 1], [0, 1]]), scored([[0, 0], [1, 0]])])
    batch, metrics = collect_phase(lambda k: next(rounds), 2, dynamic=True, max_rounds=4)
    assert batch.rewards.tolist() == [0, 1, 1, 0]
    assert len(set(batch.rollout.group_ids)) == 2                      # ids stay distinct across rounds
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/generated_samples"] == 8
    assert metrics["rollout/informative_groups"] == 2
    assert metrics["rollout/zero_adv_group_frac"] == 0.5               # of the first round, as logged


def test_dynamic_sampling_trains_on_the_groups_found_when_its_rounds_run_out():
    # Needs 3 informative groups; 2 rounds find [1,0] and [0,1] among groups that agree: the step trains on
    # those 2 groups (4 samples) instead of failing the run.
    rounds = iter([scored([[1, 1], [1, 0], [1, 1]]), scored([[0, 0], [0, 1], [0, 0]])])
    batch, metrics = collect_phase(lambda k: next(rounds), 3, dynamic=True, max_rounds=2)
    assert batch.rewards.tolist() == [1, 0, 0, 1]
    assert metrics["rollout/informative_groups"] == 2 and metrics["rollout/sampling_rounds"] == 2
    assert metrics["rollout/generated_samples"] == 12


def test_dynamic_sampling_without_any_informative_group_gives_up_with_a_clear_error():
    with pytest.raises(RuntimeError, match="found 0 of 2 informative groups in 3 rounds.*dynamic_sampling.max_rounds"):
        collect_phase(lambda k: scored([[1, 1], [0, 0]]), 2, dynamic=True, max_rounds=3)


def learner_batch(rewards, lengths, truncated):
    n = len(rewards)
    b = collate([[1]] * n, [[7] * L for L in lengths], pad_id=0, sampler_logprobs=[[-0.5] * L for L in lengths])
    b["group_ids"] = torch.tensor([i // 2 for i in range(n)])
    b["rewards"] = torch.tensor(rewards)
    b["truncated"] = torch.tensor(truncated)
    b["old_logprobs"] = b["sampler_logprobs"]
    return b


def test_advantages_broadcast_over_real_tokens_and_overlong_filter_masks_truncated():
    # Group 0: rewards 1, 0 -> z-scores +0.7071, -0.7071 (std with Bessel: sqrt(0.5) = 0.7071).
    b = learner_batch([1.0, 0.0, 0.5, 0.5], lengths=[3, 1, 2, 2], truncated=[False, True, False, False])
    algo = OmegaConf.merge(ALGO, {"overlong": {"filter": True}})
    b, metrics = OBJECTIVES.get("policy_gradient").prepare(b, algo, normalizer=RewardNormalizer(None), step=1)
    adv = b["advantages"]
    torch.testing.assert_close(adv[0], torch.tensor([0.7071, 0.7071, 0.7071]), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[1], torch.tensor([-0.7071, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert adv[2:].abs().max() == 0                                    # group 1 agrees: no signal
    assert b["loss_mask"][1].sum() == 0 and b["loss_mask"][0].sum() == 3   # truncated sequence filtered
    assert metrics["rollout/overlong_filtered_frac"] == pytest.approx(1 / 8)


def test_an_objective_bound_for_a_run_equals_the_registered_one_and_rebinds_for_another_section():
    # for_run binds the section's registered functions once; the same section gives the registered
    # instance's batch exactly, and another section (here group_mean: no division by the std) its own.
    objective = OBJECTIVES.get("policy_gradient")
    bound = objective.for_run(ALGO)
    assert bound.bound.algo is ALGO and objective.bound is None
    first = bound.prepare(learner_batch([1.0, 0.0, 0.5, 0.5], [3, 1, 2, 2], [False] * 4), ALGO,
                          normalizer=RewardNormalizer(None), step=1)[0]
    again = objective.prepare(learner_batch([1.0, 0.0, 0.5, 0.5], [3, 1, 2, 2], [False] * 4), ALGO,
                              normalizer=RewardNormalizer(None), step=1)[0]
    torch.testing.assert_close(first["advantages"], again["advantages"], rtol=0, atol=0)
    other = OmegaConf.merge(ALGO, {"advantage": "group_mean"})
    mean_only = bound.prepare(learner_batch([1.0, 0.0, 0.5, 0.5], [3, 1, 2, 2], [False] * 4), other,
                              normalizer=RewardNormalizer(None), step=1)[0]
    torch.testing.assert_close(mean_only["advantages"][0], torch.tensor([0.5, 0.5, 0.5]), rtol=0, atol=1e-6)


def test_preference_pairs_best_against_worst():
    b = learner_batch([1.0, 0.0, 0.3, 0.3], lengths=[2, 2, 2, 2], truncated=[False] * 4)
    pairs, metrics = OBJECTIVES.get("preference").prepare(b, ALGO, normalizer=RewardNormalizer(None), step=1)
    assert len(pairs) == 1 and metrics["rollout/preference_pairs"] == 1
    assert pairs["chosen/rewards"].tolist() == [1.0] and pairs["rejected/rewards"].tolist() == [0.0]


def test_a_step_whose_groups_all_agree_gives_an_empty_preference_batch_the_learner_skips():
    """One DPO step without pairs must not kill the run: it is an empty batch."""
    b = learner_batch([1.0, 1.0, 0.0, 0.0], lengths=[2, 2, 2, 2], truncated=[False] * 4)
    pairs, metrics = OBJECTIVES.get("preference").prepare(b, ALGO, normalizer=RewardNormalizer(None), step=1)
    assert len(pairs) == 0 and metrics["rollout/preference_pairs"] == 0
