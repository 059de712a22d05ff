"""Extending the lab without editing it: a new policy loss or advantage estimator is one function
(registered from this file) plus one YAML file (in a directory on Hydra's search path), and runs two
steps end to end. Also what the registries' facts and the non-finite guard do with such parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from grpo_lab.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from grpo_lab.config import register_configs, validate
from grpo_lab.schema import ConfigError
from grpo_lab.rewards import REWARDS
from helpers import train_in_process

REPO = Path(__file__).resolve().parents[1]
TINY = ["rollout=hf", "logger=none", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.group_size=4",
        "task.train_size=300", "task.dev_size=10", "task.test_size=10", "warmup.max_steps=0", "trainer.eval_every=0",
        "~reward.weights.correctness_binary", "+reward.weights.digit_count_toy=1.0",
        "hydra/job_logging=none", "hydra/hydra_logging=none"]


def digit_count_toy(completions: list[str], **_) -> list[float]:
    """A random model never answers correctly; digits per completion give every group a signal."""
    return [sum(ch.isdigit() for ch in c) / 8.0 for c in completions]


def toy_linear(logprobs, old_logprobs, advantages, response_mask, *, clip_low: float, is_weights=None):
    """A new loss: -A * clip(r, 1 - clip_low, inf) per token (reads one existing setting)."""
    mask = response_mask.bool()
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20)).clamp(min=1 - clip_low)
    loss = torch.where(mask, -advantages * ratio, torch.zeros_like(ratio))
    return loss, {"toy_ratio_mean": (ratio * mask).sum().detach() / mask.sum().clamp(min=1)}


def toy_centered(token_rewards, response_mask, group_ids, *, adv_eps: float):
    """A new estimator: reward minus the batch mean, scaled by 1 / (1 + adv_eps)."""
    scores = (token_rewards * response_mask).sum(-1)
    adv = (scores - scores.mean()) / (1 + adv_eps)
    return adv[:, None] * response_mask, adv[:, None] * response_mask


def toy_nan(logprobs, old_logprobs, advantages, response_mask, *, is_weights=None):
    """A broken loss: NaN everywhere (what a bad reward scale or an overflow produces)."""
    return logprobs * float("nan"), {}


@pytest.fixture(scope="module", autouse=True)
def registered_toys():
    """Register this file's parts as a user would (one decorator call each), and only while its tests
    run, so other test files see the lab's own registries."""
    entries = [(REWARDS, "digit_count_toy", digit_count_toy, {}), (POLICY_LOSSES, "toy_linear", toy_linear, {}),
               (ADVANTAGE_ESTIMATORS, "toy_centered", toy_centered, {"min_group_size": 2}),
               (POLICY_LOSSES, "toy_nan", toy_nan, {})]
    for registry, name, fn, facts in entries:
        registry.register(name, **facts)(fn)
    yield
    for registry, name, _, _ in entries:
        registry.unregister(name)


TOY_RECIPE = """\
# A user's recipe, outside conf/: the new loss and estimator by name.
name: toy
advantage: toy_centered
policy_loss: toy_linear
aggregation: token_mean
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_cache")


def test_a_new_loss_and_estimator_are_one_function_and_one_yaml_each(tmp_path, cache, monkeypatch, one_thread):
    conf = tmp_path / "my_conf"
    (conf / "algorithm").mkdir(parents=True)
    (conf / "algorithm" / "toy.yaml").write_text(TOY_RECIPE)
    run_dir = tmp_path / "run"
    code = train_in_process(["algorithm=toy", f"hydra.searchpath=[file://{conf}]", *TINY, f"hydra.run.dir={run_dir}",
                     f"cache_dir={cache}"], monkeypatch)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert code == 0 and summary["status"] == "completed", summary["traceback"]
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "perf/step_time_s" in m]
    assert len(steps) == 2 and all(m["actor/toy_ratio_mean"] > 0 and m["actor/grad_norm"] > 0 for m in steps)
    assert "advantage: toy_centered" in (run_dir / "config.yaml").read_text()


def test_facts_registered_with_a_new_estimator_reach_validation():
    """min_group_size=2 on the toy estimator's registration is all validate() needs to refuse G=1."""
    from hydra import compose, initialize_config_dir

    from grpo_lab.config import finalize

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=["algorithm.advantage=toy_centered", "rollout.group_size=1"]))
    GlobalHydra.instance().clear()
    with pytest.raises(ConfigError, match="rollout.group_size=1 gives every group fewer than 2 samples"):
        validate(cfg)


def test_non_finite_loss_steps_are_skipped_counted_and_fail_the_run_past_the_limit(tmp_path, cache, monkeypatch,
                                                                                 one_thread):
    """A NaN loss never reaches the weights: the step is skipped and counted (actor/skipped_steps), and
    past trainer.max_bad_steps the run fails clearly, without a final checkpoint."""
    ok_dir, bad_dir = tmp_path / "tolerated", tmp_path / "failed"
    common = ["algorithm.policy_loss=toy_nan", *TINY, f"cache_dir={cache}"]
    assert train_in_process([*common, "trainer.max_bad_steps=5", f"hydra.run.dir={ok_dir}"], monkeypatch) == 0
    lines = [json.loads(s) for s in (ok_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["actor/skipped_steps"] for m in lines if "perf/step_time_s" in m] == [1.0, 2.0]
    from safetensors.torch import load_file
    assert all(torch.isfinite(t).all() for t in load_file(str(ok_dir / "checkpoints/final/model.safetensors")).values())

    assert train_in_process([*common, "trainer.max_bad_steps=1", f"hydra.run.dir={bad_dir}"], monkeypatch) != 0
    summary = json.loads((bad_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer.max_bad_steps=1" in summary["error"]
    assert not (bad_dir / "checkpoints" / "final").exists()
