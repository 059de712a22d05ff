"""Long phases print progress: a short warm-up prints a start line (what, how much) and step lines
with the loss and time left; an opaque call (engine start, evaluation) prints a start line, a line
at least every `EVERY_S` seconds while it runs and an end line."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lab import progress
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.tasks.base import Task, TaskItem
from grpo_lab.warmup import warmup_sft

ITEMS = [TaskItem(f"{a}+{b}=", str(a + b), str(a + b)) for a in range(4) for b in range(4)]


def test_a_short_warmup_prints_a_start_line_and_progress_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "EVERY_S", 0.0)   # every step is "30 s later"
    base = Path(MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet="0123456789+=", seed=0))
    task = Task(name="sums", splits={"train": ITEMS, "dev": ITEMS[:4], "test": ITEMS[:4]})
    cfg = SimpleNamespace(cache=True, lr=1e-3, max_steps=4, batch_size=2, eval_every=2, target_sampled_dev_accuracy=1.0)
    stats = warmup_sft(base, tmp_path / "warm", task, cfg, max_new_tokens=3, seed=0, device="cpu")
    out = capsys.readouterr().out
    assert stats["steps"] == 4
    assert "warm-up SFT: up to 4 steps of 2 worked solutions (16 train items)" in out
    steps = [line for line in out.splitlines() if line.startswith("warm-up SFT step ")]
    assert [line.split()[3] for line in steps if "s left" in line] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("loss" in line for line in steps if "s left" in line)


def test_a_warmup_that_misses_its_target_warns_before_rl_starts(tmp_path, capsys):
    """build_policy (the RL starting point): a warm-up that ends at warmup.max_steps below its target says so,
    naming the accuracy reached, the target and what to change, once it is done and again when cached."""
    from hydra import compose, initialize_config_dir

    from grpo_lab.config import finalize, register_configs
    from grpo_lab.run_setup import build_policy
    from grpo_lab.tasks import build_task

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=[
            "task.train_size=16", "task.dev_size=4", "task.test_size=4", "warmup.max_steps=2",
            "warmup.eval_every=1", "warmup.target_sampled_dev_accuracy=1.0", f"cache_dir={tmp_path}"]))
    task = build_task(cfg.task)
    for cached in (False, True):
        _, stats = build_policy(cfg, task, torch.device("cpu"))
        assert stats["cached"] is cached and stats["reached_target"] is False
        err = capsys.readouterr().err
        warnings = [line for line in err.splitlines() if line.startswith("warning: the warm-up")]
        assert len(warnings) == 1, err
        assert (f"after 2 steps at sampled dev accuracy {stats['sampled_dev_accuracy']:.3g}, short of "
                "warmup.target_sampled_dev_accuracy=1" in warnings[0])
        assert "Raise warmup.max_steps (now 2) or lower warmup.target_sampled_dev_accuracy" in warnings[0]
    # a warm-up that reached its target warns of nothing
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=[
            "task.train_size=16", "task.dev_size=4", "task.test_size=4", "warmup.max_steps=2",
            "warmup.eval_every=1", "warmup.target_sampled_dev_accuracy=0", f"cache_dir={tmp_path}"]))
    _, stats = build_policy(cfg, task, torch.device("cpu"))
    assert stats["reached_target"] is True and "warning" not in capsys.readouterr().err


def test_counted_progress_prints_every_tenth_even_when_fast(capsys):
    p = progress.CountedProgress("evaluation", 100, unit="item", every_s=3600)
    for done in range(1, 101):
        p.update(done)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == [f"{10 * k}/100" for k in range(1, 11)]


def test_a_heartbeat_prints_while_an_opaque_call_runs(capsys):
    with progress.heartbeat("rollout engine: starting vllm", every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rollout engine: starting vllm ..."
    assert sum("still running" in line for line in lines) >= 2
    assert lines[-1].startswith("rollout engine: starting vllm: done in")


def test_a_heartbeat_says_when_the_call_failed(capsys):
    with pytest.raises(RuntimeError), progress.heartbeat("model: building", every_s=10):
        raise RuntimeError("boom")
    assert "model: building: failed after" in capsys.readouterr().out


def test_a_training_step_line_shows_entropy_only_when_the_objective_logs_it(capsys):
    from grpo_lab.train import ProgressLine
    step = {"reward/mean": 0.5, "perf/step_time_s": 0.2}
    ProgressLine(total=1, desc="dpo").update(step, {"eval/accuracy": 0.6}, group_size=8)        # a preference step
    ProgressLine(total=1, desc="grpo").update({**step, "actor/entropy": 0.4}, {"eval/accuracy": 0.6}, group_size=8)
    preference, policy_gradient = capsys.readouterr().out.splitlines()
    assert preference == "step 1/1 | reward 0.50 | eval acc 60.0% | G 8 | 0.20s/step"
    assert policy_gradient == "step 1/1 | reward 0.50 | eval acc 60.0% | entropy 0.400 | G 8 | 0.20s/step"
