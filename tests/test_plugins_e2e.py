"""Plug-ins without editing the project: a user's reward function, task factory and model
builder, named by import path in config, run end to end in a single run and in a `-m` sweep under
the joblib launcher (whose workers import them by path too). They live in tests/robust_plugins.py,
which the lab never imports or registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# (the builder's signature takes no model.* sizes, so the tiny_llama values in the config are not passed)
PLUGINS = ["model.builder=robust_plugins.small_llama", "task.source=robust_plugins:make_task", "task.train_size=40", "rollout.max_model_len=64",
           "~reward.weights.correctness_binary", "+reward.weights={robust_plugins.length_penalty: 1.0}"]
RUN = ["rollout=hf", "logger=none", "warmup.max_steps=0", "trainer.total_steps=2", "trainer.prompts_per_step=4",
       "rollout.group_size=4", "trainer.eval_every=0", *PLUGINS]


def train(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "grpo_lab.train", *args, f"cache_dir={cache}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_plugin_reward_task_and_model_in_a_single_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = train([*RUN, f"hydra.run.dir={run_dir}"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "perf/step_time_s" in m]
    assert len(steps) == 2 and all("reward/robust_plugins.length_penalty" in m for m in steps)
    built = json.loads(next((tmp_path / "cache" / "models").glob("*/grpo_lab_build.json")).read_text())
    assert built["hidden_size"] == 32                          # the plug-in builder made the model


@pytest.mark.slow
def test_plugins_in_a_joblib_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train(["-m", *RUN, "seed=0,1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                  f"hydra.sweep.dir={sweep}"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = [json.loads(p.read_text())["status"] for p in sorted(sweep.glob("*/summary.json"))]
    assert statuses == ["completed", "completed"]
