"""A task whose problem space is too small for its splits is refused when it is built, before any model is
built or trained: the distinct prompts of each split are counted after train items overlapping dev/test are
removed, and too few distinct train prompts, or dev and test sharing prompts, is a ConfigError with the counts,
what to change and the override (task.min_distinct_train_prompts=0, task.allow_split_overlap=true)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError
from grpo_lab.tasks import build_task

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()
# gcd of two numbers up to 20 (400 pairs): 3,000 train items repeat a few hundred prompts, and dev and test
# share many of theirs.
TINY_GCD = ["task=gcd", "task.dataset_kwargs.max_value=20", "task.train_size=3000", "task.dev_size=100",
            "task.test_size=100"]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def test_a_tiny_problem_space_is_refused_with_the_counts_before_any_model(monkeypatch):
    from grpo_lab import run_setup

    cfg = compose_cfg(TINY_GCD)
    validate(cfg, machine=False)   # each value is valid on its own: the data is what is wrong
    monkeypatch.setattr(run_setup, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError) as err:
        run_setup.start_run(cfg)
    msg = str(err.value)
    assert msg.startswith("task gcd: the train split has ")
    removed = 3000 - int(msg.split("among its ")[1].split(" items")[0].replace(",", ""))
    assert f"({removed:,} of 3,000 removed as overlapping dev/test)" in msg
    assert "fewer than task.min_distinct_train_prompts=1000" in msg
    assert "dev and test share " in msg and " of 100 test prompts, more than the 5 tolerated" in msg
    for fix in ("task.dataset_kwargs", "task.train_size", "task.dev_size", "task.test_size", "task.train_seed",
                "task.min_distinct_train_prompts=0 and task.allow_split_overlap=true"):
        assert fix in msg


def test_the_override_lets_it_through_with_a_warning_carrying_the_counts(capsys, caplog):
    cfg = compose_cfg([*TINY_GCD, "task.min_distinct_train_prompts=0", "task.allow_split_overlap=true"])
    validate(cfg, machine=False)
    task = build_task(cfg.task)
    distinct, shared = task.info["distinct_prompts"], task.info["dev_test_overlap"]
    assert distinct["train"] < 400 and shared > 5
    err = capsys.readouterr().err
    assert (f"warning: task gcd: the train split has {distinct['train']:,} distinct prompts among its "
            f"{len(task.splits['train']):,} items") in err and "(task.min_distinct_train_prompts=0)" in err
    assert f"warning: task gcd: dev and test share {shared} of 100 test prompts" in err
    # Only one of the two refusals overridden: the other still refuses, and names only its own override.
    with pytest.raises(ConfigError, match="set task.allow_split_overlap=true$"):
        build_task(compose_cfg([*TINY_GCD, "task.min_distinct_train_prompts=0"]).task)
    with pytest.raises(ConfigError, match="task.min_distinct_train_prompts=-1 must be >= 0"):
        validate(compose_cfg(["task.min_distinct_train_prompts=-1"]), machine=False)


def test_the_default_chain_sum_task_passes_with_its_counts_recorded(caplog):
    cfg = compose_cfg([])
    task = build_task(cfg.task)   # the lab's default sizes: 20,000 / 200 / 200
    distinct = task.info["distinct_prompts"]
    assert distinct["train"] > 10 * cfg.task.min_distinct_train_prompts > 0
    assert distinct["dev"] == distinct["test"] == 200
    # Its chance repeats (2 of 200) stay under the 5 % tolerance: logged as before, not refused.
    assert 0 < task.info["dev_test_overlap"] <= 10
    assert "test prompts also appear in dev" in caplog.text


def test_a_local_jsonl_with_few_distinct_prompts_is_refused(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i % 20}+1=", "answer": str(i % 20 + 1)}) + "\n"
                            for i in range(300)))
    task_cfg = {"source": "local_dataset", "name": "few", "path": str(path), "dev_size": 2, "test_size": 2}
    with pytest.raises(ConfigError, match=r"task few: the train split has \d+ distinct prompts among its \d+ "
                                          r"items .*fewer than half the \d+ train items asked for"):
        build_task(task_cfg)
    task = build_task({**task_cfg, "min_distinct_train_prompts": 0})
    assert task.info["distinct_prompts"]["train"] <= 20
