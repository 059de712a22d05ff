"""Contained rewards, plug-in rewards and tasks, task switching, local-dataset errors and the early
validation of reward/rollout/task values. No model or engine is loaded here."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs
from grpo_lab.rewards import REWARDS, RewardError, compute_rewards
from grpo_lab.tasks import TASKS, TaskItem, build_task
from grpo_lab.validation_io import validate_rollout_reward_task

register_configs()  # what every entry point does before Hydra composes

CONF = Path(__file__).resolve().parents[1] / "conf"
ITEM = TaskItem("1+1=", "2", "2", {"answer_format": "plain"})


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def errors_of(overrides) -> list[str]:
    errors: list[str] = []
    validate_rollout_reward_task(make(overrides), errors)
    return errors


# ------------------------------------------------------------------ contained rewards
def test_a_raising_reward_scores_only_its_samples_on_error():
    comps = ["2", "x", "2", "2"]
    total, per = res = compute_rewards(comps, [ITEM] * 4, [("robust_plugins:raises_on_x", 1.0)],
                                       on_error=-1.0, max_error_frac=0.5)
    assert total == [1.0, -1.0, 1.0, 1.0]
    assert res.metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/failed_frac": 0.25}


def test_nan_rewards_are_counted_not_summed():
    res = compute_rewards(["y", "2"], [ITEM] * 2, [("robust_plugins:nan_on_y", 1.0), ("correctness", 1.0)],
                          max_error_frac=0.5)
    assert res.total == [0.0, 2.0] and all(math.isfinite(x) for x in res.total)
    assert res.metrics["reward/errors"] == 1.0


def test_too_many_failures_fail_with_a_clear_message():
    with pytest.raises(RewardError, match=r"2 of 4 samples .*reward.max_error_frac=0.25.*'robust_plugins:raises_on_x'"):
        compute_rewards(["x", "x", "2", "2"], [ITEM] * 4, [("robust_plugins:raises_on_x", 1.0)], max_error_frac=0.25)


def test_a_hanging_reward_is_interrupted_in_the_main_thread():
    # hangs_on_h sleeps 60 s and swallows Exception: the timeout must still stop it.
    t0 = time.monotonic()
    res = compute_rewards(["h", "2", "2", "2"], [ITEM] * 4, [("robust_plugins:hangs_on_h", 1.0)],
                          timeout_s=0.5, max_error_frac=0.5)
    assert time.monotonic() - t0 < 5
    assert res.total == [0.0, 1.0, 1.0, 1.0]
    assert res.metrics["reward/timeouts"] == 1.0


def test_a_spinning_reward_is_interrupted_in_a_worker_thread():
    box = {}

    def run():
        box["res"] = compute_rewards(["h", "2"], [ITEM] * 2, [("robust_plugins:spins_on_h", 1.0)],
                                     timeout_s=0.5, max_error_frac=0.5)

    t0 = time.monotonic()
    th = threading.Thread(target=run)
    th.start()
    th.join(20)
    assert not th.is_alive() and time.monotonic() - t0 < 10
    assert box["res"].total == [0.0, 1.0] and box["res"].metrics["reward/timeouts"] == 1.0


def test_a_reward_hanging_on_every_sample_gives_up_early():
    # max_error_frac=0.25 of 8 samples tolerates 2: the 3rd timeout ends it (batch + 3 = 4 timeouts).
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="timeouts: 3"):
        compute_rewards(["h"] * 8, [ITEM] * 8, [("robust_plugins:hangs_on_h", 1.0)], timeout_s=0.3,
                        max_error_frac=0.25)
    assert time.monotonic() - t0 < 4


# ------------------------------------------------------------------ plug-ins
def test_plugin_reward_by_import_path():
    total, per = compute_rewards(["2", "22"], [ITEM] * 2, [("correctness", 1.0), ("robust_plugins:length_penalty", 0.5)])
    assert total == pytest.approx([1.0 - 0.05, 0.0 - 0.1])


@pytest.mark.parametrize("name, match", [
    ("no_such_pkg.rewards:fn", "cannot import module 'no_such_pkg.rewards'"),
    ("robust_plugins:nope", "has no attribute 'nope'"),
    ("robust_plugins:NOT_CALLABLE", "not a callable reward"),
    ("corectness", "valid choices: .*correctness.*package.module:function"),
])
def test_bad_reward_names_say_what_to_fix(name, match):
    with pytest.raises(ValueError, match=match):
        REWARDS.get(name)


def test_plugin_reward_and_task_through_hydra_overrides():
    # New keys need Hydra's '+'; ':' in a dict key must be escaped, the dotted spelling needs nothing.
    cfg = make(["+reward.weights={robust_plugins.length_penalty: 0.5, robust_plugins\\:nan_on_y: 0.1}",
                "task.source=robust_plugins:make_task", "task.train_size=7"])
    assert dict(cfg.reward.weights) == {"correctness_binary": 1.0, "robust_plugins.length_penalty": 0.5,
                                        "robust_plugins:nan_on_y": 0.1}
    assert errors_of(["+reward.weights={robust_plugins.length_penalty: 0.5}",
                      "task.source=robust_plugins.make_task"]) == []
    task = build_task(cfg.task)
    assert len(task.splits["train"]) == 7
    # The plugin's info, with the split check's counts added (grpo_lab.tasks.base.check_splits).
    assert task.info == {"source": "plugin", "distinct_prompts": {"train": 7, "dev": 5, "test": 5},
                         "dev_test_overlap": 0}


def test_unimportable_plugins_fail_validation():
    errs = errors_of(["+reward.weights={nope_pkg.f: 1.0}", "task.source=nope_pkg.tasks:make"])
    assert any(e.startswith("reward.weights.nope_pkg.f") and "cannot import module 'nope_pkg'" in e for e in errs)
    assert any(e.startswith("task.source") and "cannot import module 'nope_pkg.tasks'" in e for e in errs)


# ------------------------------------------------------------------ task switching
@pytest.mark.parametrize("task", ["gcd", "leg_counting", "basic_arithmetic", "simple_equations"])
def test_one_override_switches_to_a_generator(task):
    cfg = make([f"task={task}"])
    assert cfg.task.name == task and "min_digits" not in cfg.task.dataset_kwargs or task == "basic_arithmetic"
    assert errors_of([f"task={task}"]) == []
    built = build_task({**dict(cfg.task), "train_size": 20, "dev_size": 3, "test_size": 3})
    assert len(built.splits["test"]) == 3 and built.info["generator"] == task


def test_task_name_alone_keeps_old_kwargs_and_says_so():
    errs = errors_of(["task.name=gcd", "task.prompt_format=question"])
    assert len(errs) == 1 and errs[0].startswith("task.dataset_kwargs has ['max_digits', 'max_terms'")
    assert "task=<file>" in errs[0]


# ------------------------------------------------------------------ validation catalogue
@pytest.mark.parametrize("override, key", [
    ("task.test_size=0", "task.test_size"),
    ("task.dev_size=0", "task.dev_size"),
    ("task.train_size=0", "task.train_size"),
    ("task.name=chain_sums", "task.name"),
    ("task.prompt_format=short", "task.prompt_format"),
    ("task.answer_format=xml", "task.answer_format"),
    ("task.prompt_template=Q:", "task.prompt_template"),
    ("task.max_completion_tokens=0", "task.max_completion_tokens"),
    ("task.dev_seed=1000005", "task.*_seed"),
    ("task.source=hub", "task.source"),
    ("+task.dataset_kwargs.seed=3", "task.dataset_kwargs"),
    ("reward.timeout_s=0", "reward.timeout_s"),
    ("reward.timeout_s=nan", "reward.timeout_s"),
    ("reward.on_error=inf", "reward.on_error"),
    ("reward.max_error_frac=1.5", "reward.max_error_frac"),
    ("reward.weights.correctness_binary=nan", "reward.weights['correctness_binary']"),
    ("rollout.generate_timeout_s=-1", "rollout.generate_timeout_s"),
    ("rollout.sync_timeout_s=0", "rollout.sync_timeout_s"),
    ("rollout.max_model_len=8", "rollout.max_new_tokens"),
])
def test_bad_values_name_their_key(override, key):
    errs = errors_of([override])
    assert errs and any(e.startswith(key) for e in errs), errs


def test_local_dataset_needs_a_path():
    errs = errors_of(["task.source=local_dataset", "task.name=mine"])
    assert any("task.path" in e for e in errs)


# ------------------------------------------------------------------ local datasets
def _local(path, **kw):
    return TASKS.get("local_dataset")(path=str(path), dev_size=1, test_size=1, **kw)


def test_empty_jsonl_is_a_clear_error(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl holds no rows .*task.path"):
        _local(p)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + '{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not valid JSON"):
        _local(p)


@pytest.mark.parametrize("field", ["prompt", "answer"])
def test_rows_missing_a_field_name_it(tmp_path, field):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    del rows[3][field]
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=rf"rows.jsonl, line 4: .*no '{field}' field"):
        _local(p)
