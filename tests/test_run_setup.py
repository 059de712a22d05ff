"""The matched-compute SFT control computes with the RL learner's threads: both runs start through
grpo_lab.run_setup.start_run, so the control cannot drift from the trainer's thread rule."""

import json
import os

import pytest
import torch

from helpers import TINY_RUN, train_in_process


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", ["null", "1"])
def test_the_sft_control_gets_the_rl_learners_threads(num_threads, warm_cache, tmp_path, monkeypatch,
                                                      restore_threads):
    from grpo_lab.tables import sft_control

    # No OMP_NUM_THREADS budget and at least two cores: with rollout=hf nothing computes beside the RL
    # learner, so learner.num_threads=null gives it every core, not the half an engine would leave.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = max(os.cpu_count() or 1, 2)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    expected = cores if num_threads == "null" else int(num_threads)
    overrides = [*TINY_RUN, "rollout=hf", f"cache_dir={warm_cache}", f"learner.num_threads={num_threads}"]

    torch.set_num_threads(1 if expected > 1 else 2)   # neither run may inherit the count it should set
    code = train_in_process([*overrides, "trainer.total_steps=0", "trainer.save_checkpoint=false",
                             f"hydra.run.dir={tmp_path / 'rl'}"], monkeypatch)
    assert code == 0, json.loads((tmp_path / "rl" / "summary.json").read_text())["traceback"]
    rl_threads = torch.get_num_threads()

    torch.set_num_threads(1 if expected > 1 else 2)
    assert sft_control.main(["--wall-time", "0.5", "--evals", "0", "--run-dir", str(tmp_path / "sft"), "--",
                             *overrides]) == 0
    sft_threads = torch.get_num_threads()

    assert rl_threads == sft_threads == expected
    for run in ("rl", "sft"):   # and each run's summary.json records it
        assert json.loads((tmp_path / run / "summary.json").read_text())["learner_threads"] == expected
