"""A few RL steps with rollout=vllm on several reasoning-gym generators in question form:
their prompts are ~15x longer than chain_sum's compact ones, so one step's prefill passes vLLM's
4,096-token CPU budget (the case that crashed before: "CPU Generator does not use offset")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import VLLM_KV, run_train

# A random tiny model answers nothing correctly; the digit-count plug-in gives every group a signal.
RUN = ["rollout=vllm", "logger=none", "warmup.max_steps=0", "trainer.total_steps=2", "trainer.prompts_per_step=8",
       "rollout.group_size=8", "trainer.eval_every=0", "task.train_size=300", "task.dev_size=10", "task.test_size=10",
       "~reward.weights.correctness_binary", "+reward.weights={robust_plugins.length_penalty: 1.0}", *VLLM_KV]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("task", ["gcd", "simple_equations", "leg_counting"])
def test_a_few_vllm_steps_on_question_form_generators(task, tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo / "tests"), str(repo)]))  # the plug-in reward
    run_dir = tmp_path / "run"
    proc = run_train([f"task={task}", *RUN], run_dir, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "perf/step_time_s" in m]
    assert len(steps) == 2 and all(m["rollout/samples"] == 64 for m in steps)
