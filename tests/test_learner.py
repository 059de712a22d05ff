"""The learner: the reference model exists only when read, gradient accumulation does not change
the update, several updates per batch make clipping bind, the critic trains, and the rollout
correction's weights reach every policy loss (and change nothing when engine and learner agree)."""

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.algos import POLICY_LOSSES
from grpo_lab.schema import AlgorithmConfig, LearnerConfig
from grpo_lab.learner.learner import Learner
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.models import MODEL_BUILDERS

import fsdp_common  # tests/ is on sys.path (pytest rootdir conftest)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=", seed=0)


def make_learner(model_dir, micro_batch_size=64, **algo):
    algo_cfg = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), algo)
    learner_cfg = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                                  {"device": "cpu", "micro_batch_size": micro_batch_size, "grad_clip": 0.0})
    return Learner(model_dir, objective=OBJECTIVES.get(algo_cfg.objective), learner_cfg=learner_cfg, algo_cfg=algo_cfg,
                   temperature=1.0, seed=0,
                   max_completion_len=6)


def toy_batch(seed=0, n=10):
    batch = fsdp_common.toy_batch(seed, n)      # the same toy rows the FSDP equivalence tests use
    batch["returns"] = batch["advantages"]
    return batch


def test_reference_model_only_when_kl_is_used(model_dir):
    assert make_learner(model_dir).ref is None
    learner = make_learner(model_dir, kl={"coef": 0.04})
    assert learner.ref is not None and not any(p.requires_grad for p in learner.ref.parameters())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm"])
def test_micro_batch_size_does_not_change_the_update(model_dir, aggregation):
    """Plain SGD with lr 1 makes the parameter change equal to minus the accumulated gradient."""
    deltas = []
    for micro in (10, 3):
        learner = make_learner(model_dir, micro_batch_size=micro, aggregation=aggregation, entropy_coef=0.01)
        learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=1.0)
        before = copy.deepcopy(learner.policy.state_dict())
        batch = toy_batch()
        learner.score(batch)
        learner.update(batch)
        deltas.append({k: learner.policy.state_dict()[k] - before[k] for k in before})
    for k in deltas[0]:
        torch.testing.assert_close(deltas[0][k], deltas[1][k], atol=1e-6, rtol=1e-4)
    assert max(d.abs().max() for d in deltas[0].values()) > 0


def test_several_updates_per_batch_make_clipping_bind(model_dir):
    one = make_learner(model_dir, epochs=1)
    many = make_learner(model_dir, epochs=4, minibatches=2)
    for learner in (one, many):
        learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=2.0)
    metrics = []
    for learner in (one, many):
        batch = toy_batch()
        with torch.no_grad():   # on-policy: the engine sampled from exactly the learner's policy
            batch["sampler_logprobs"] = learner.policy_logprobs(batch)[0]
        learner.score(batch)
        metrics.append(learner.update(batch))
    # μ=1 on-policy: the ratio is 1 on the only pass (old logprobs = the learner's own), nothing clips.
    assert metrics[0]["actor/clip_frac_low"] + metrics[0]["actor/clip_frac_high"] == 0
    assert metrics[1]["actor/clip_frac_low"] + metrics[1]["actor/clip_frac_high"] > 0


def test_critic_trains_on_returns(model_dir):
    learner = make_learner(model_dir, advantage="gae", critic={"enabled": True, "lr": 1e-3})
    losses = []
    for _ in range(4):
        batch = toy_batch()
        learner.score(batch)
        losses.append(learner.update(batch)["critic/value_loss"])
    assert losses[-1] < losses[0]


def _on_policy_batch(learner, seed=0):
    """toy_batch whose sampler logprobs are the learner's own (the engine sampled from exactly this policy)."""
    batch = toy_batch(seed)
    with torch.no_grad():
        batch["sampler_logprobs"] = learner.policy_logprobs(batch)[0]
    return batch


def _sgd_delta(learner, batch):
    learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=1.0)
    before = copy.deepcopy(learner.policy.state_dict())
    metrics = {**learner.score(batch), **learner.update(batch)}
    return {k: learner.policy.state_dict()[k] - before[k] for k in before}, metrics


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES.names())
def test_rollout_correction_weights_enter_every_policy_loss(model_dir, policy_loss):
    """With a correction on, score() makes π_old the learner's own logprobs and the weights the loss's
    is_weights; the update runs for every registered policy loss and reports the correction."""
    learner = make_learner(model_dir, policy_loss=policy_loss, minibatches=2,
                           rollout_correction={"level": "token", "mode": "truncate", "upper": 2.0})
    batch = toy_batch()          # sampler logprobs -1.5 everywhere: far from the model's own
    delta, metrics = _sgd_delta(learner, batch)
    assert torch.equal(batch["old_logprobs"], batch["learner_logprobs"])
    ratio = torch.exp(batch["learner_logprobs"] - batch["sampler_logprobs"]).clamp(max=2.0)
    torch.testing.assert_close(batch["is_weights"], ratio * batch["response_mask"])
    for key in ("rollout/correction_weight_mean", "rollout/correction_truncated_frac", "rollout/correction_ess",
                "rollout/logprob_abs_diff_mean", "rollout/kl_k3", "actor/log_ratio_std"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["rollout/correction_masked_frac"] == 0
    assert max(d.abs().max() for d in delta.values()) > 0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_a_perfect_engine_match_leaves_the_update_as_without_correction(model_dir, level):
    """Engine and learner agree: every weight is 1 and π_old is the same logprobs either way, so the
    update equals the uncorrected one (plain SGD: the change is minus the gradient)."""
    deltas = []
    for correction in ({}, {"level": level, "mode": "mask", "upper": 1.001, "lower": 0.999}):
        learner = make_learner(model_dir, rollout_correction=correction)
        deltas.append(_sgd_delta(learner, _on_policy_batch(learner))[0])
    for k in deltas[0]:
        torch.testing.assert_close(deltas[1][k], deltas[0][k], atol=1e-6, rtol=1e-4)


def test_masking_every_answer_leaves_the_policy_where_it_was(model_dir):
    """mode=mask with bounds no answer meets: every weight is 0, the loss is 0 and nothing moves."""
    learner = make_learner(model_dir, rollout_correction={"level": "sequence", "mode": "mask", "upper": 1.0001,
                                                          "lower": 0.9999})
    delta, metrics = _sgd_delta(learner, toy_batch())     # sampler logprobs far from the learner's
    assert metrics["rollout/correction_masked_frac"] == 1 and metrics["rollout/correction_ess"] == 0
    assert max(d.abs().max() for d in delta.values()) == 0
