"""Reward noise in real runs: p = 0 changes no number, evaluation and the `correct` flag stay clean while
the trainer sees noisy rewards, and a resumed run draws exactly the noise of an uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, TINY_RUN, read_metrics, run_train
from test_resume import comparable, kill_after_step

RUN = [*TINY_RUN, "rollout=hf", "trainer.eval_every=2", "trainer.total_steps=2"]
NOISE_KEYS = ("reward/noise_", "reward/clean_mean", "reward/noisy_mean")


def train_samples(run_dir):
    return [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines()
            if s.strip() and json.loads(s).get("kind") == "train"]


@pytest.mark.slow
def test_zero_flip_changes_nothing_and_evaluation_never_sees_noise(tmp_path, warm_cache):
    runs = {"none": [], "flip0": ["reward.noise.kind=flip", "reward.noise.flip_prob=0.0"],
            "flip1": ["reward.noise.kind=flip", "reward.noise.flip_prob=1.0"]}
    lines = {}
    for name, extra in runs.items():
        proc = run_train([*RUN, *extra], tmp_path / name, warm_cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines[name] = read_metrics(tmp_path / name)

    # p = 0: every metric of the noise-free run, bit for bit; the noise metrics say nothing happened
    strip = lambda ls: [{k: v for k, v in m.items() if not k.startswith(NOISE_KEYS)} for m in comparable(ls)]
    assert strip(lines["flip0"]) == strip(lines["none"])
    trained = [m for m in lines["flip0"] if "reward/noise_flipped_frac" in m]
    assert trained and all(m["reward/noise_flipped_frac"] == 0.0 and m["reward/noise_corr"] == 1.0 for m in trained)

    # p = 1: the trainer's reward is 1 − correct on every sample; `correct` and its clean reward are the verifier's
    for row in train_samples(tmp_path / "flip1"):
        assert row["clean_reward"] == float(row["correct"]) and row["reward"] == 1.0 - float(row["correct"])
    flipped = [m for m in lines["flip1"] if "reward/noise_flipped_frac" in m]
    assert flipped and all(m["reward/noise_flipped_frac"] == 1.0 for m in flipped)
    assert all(m["reward/mean"] == pytest.approx(1.0 - m["reward/correct_frac"]) for m in flipped)
    # evaluation at step 0 (before any update) is the same whatever the training reward's noise
    evals = {n: [m for m in ls if m["step"] == 0 and any(k.startswith("eval/") for k in m)] for n, ls in lines.items()}
    first = {n: {k: v for k, v in e[0].items() if k.startswith("eval/") and "time" not in k} for n, e in evals.items()}
    assert first["flip1"] == first["none"] and first["none"]


@pytest.mark.slow
def test_noise_is_identical_under_resume(tmp_path, warm_cache):
    run = [*TINY_RUN, "rollout=hf", "trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=0",
           "reward.noise.kind=judge_like", "reward.noise.std=0.3", "reward.noise.prompt_bias_std=0.5",
           "reward.noise.length_bias=0.2"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    proc = run_train(run, ref, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kill_after_step(run, killed, warm_cache, step=3)
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(killed)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert comparable(read_metrics(killed)) == comparable(read_metrics(ref))
    assert any(m.get("reward/noise_corr", 1.0) < 1.0 for m in read_metrics(ref))
