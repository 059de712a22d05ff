"""Rewards that hang end: a worker process runs the rewards that may hang and is killed at
reward.timeout_s (a regex stuck in C code, a sleep in the max_staleness=1 sampling thread), a reward
timing out again and again fails the run after reward.max_consecutive_timeouts, and SIGTERM during a
hung reward ends the run at once with a failed summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from grpo_lab.rewards import (REWARDS, RewardError, RewardScorer, RewardWorkerStopped, compute_rewards,
                              stop_reward_worker)
from grpo_lab.tasks import TaskItem

REPO = Path(__file__).resolve().parents[1]
ITEM = TaskItem("1+1=", "2", "2", {"answer_format": "plain"})


def in_thread(fn, limit_s: float = 30.0):
    """``fn()`` in a background thread (as the max_staleness=1 sampler runs rewards): (result or
    exception, seconds taken); fails if the thread is still running after ``limit_s``."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            box["out"] = err

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"the reward call was still running after {limit_s} s"
    return box["out"], time.monotonic() - t0


# ------------------------------------------------------------------ the worker process
def test_a_regex_stuck_in_c_code_is_killed_in_a_background_thread():
    res, took = in_thread(lambda: compute_rewards(["a", "2"], [ITEM] * 2, [("robust_plugins:regex_hangs", 1.0)],
                                                  timeout_s=0.5, max_error_frac=1.0, isolation="process"))
    assert took < 15
    assert res.total == [0.0, 0.0] and res.metrics["reward/timeouts"] == 2.0


def test_a_sleeping_plugin_in_a_background_thread_is_killed_under_auto():
    res, took = in_thread(lambda: compute_rewards(["h"], [ITEM], [("robust_plugins:sleeps_forever", 1.0)],
                                                  timeout_s=0.5, max_error_frac=1.0, isolation="auto"))
    assert took < 15 and res.metrics["reward/timeouts"] == 1.0


def test_auto_runs_plugins_in_the_worker_and_the_cheap_builtins_here():
    res = compute_rewards(["2", "3"], [ITEM] * 2, [("robust_plugins:worker_pid", 1.0), ("correctness", 1.0)],
                          timeout_s=30, isolation="auto")
    worker = res.per_reward["robust_plugins:worker_pid"]
    assert worker[0] == worker[1] != float(os.getpid())
    assert res.per_reward["correctness"] == [1.0, 0.0]
    assert not any(REWARDS.fact(n, "may_hang") for n in ("correctness", "correctness_binary", "format"))
    assert REWARDS.fact("robust_plugins:worker_pid", "may_hang") and REWARDS.fact("math_verify", "may_hang")
    again = compute_rewards(["2"], [ITEM], [("robust_plugins:worker_pid", 1.0)], isolation="process")
    assert again.total == [worker[0]]   # one long-lived worker, not one per call


def test_a_runs_scorer_resolves_its_rewards_once_and_scores_as_compute_rewards():
    # A run's reward section, looked up once: the plug-in (which may hang) still runs in the worker under
    # auto, the built-in here, with the section's containment settings.
    section = NS(weights={"robust_plugins:worker_pid": 1.0, "correctness": 1.0}, timeout_s=30, on_error=0.0,
                 max_error_frac=0.0, isolation="auto", max_consecutive_timeouts=None, judge={}, reward_model={})
    scorer = RewardScorer(section)
    assert {name: may_hang for name, (_, may_hang) in scorer.resolved.items()} == {
        "robust_plugins:worker_pid": True, "correctness": False}
    res = scorer(["2", "3"], [ITEM] * 2)
    assert res.per_reward["correctness"] == [1.0, 0.0]
    assert res.per_reward["robust_plugins:worker_pid"][0] != float(os.getpid())
    same = compute_rewards(["2", "3"], [ITEM] * 2, list(section.weights.items()), timeout_s=30, isolation="auto")
    assert res.total == same.total


def test_failures_in_the_worker_read_as_in_this_process():
    args = (["x", "2"], [ITEM] * 2, [("robust_plugins:raises_on_x", 1.0)])
    with pytest.raises(RewardError) as here:
        compute_rewards(*args, isolation="thread")
    with pytest.raises(RewardError) as there:
        compute_rewards(*args, isolation="process")
    assert str(there.value) == str(here.value) and "ValueError: cannot score 'x'" in str(there.value)


def test_a_reward_that_keeps_timing_out_fails_after_n_in_a_row():
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'robust_plugins:sleeps_forever' timed out 3 times in a row .*"
                                          r"reward.timeout_s=0.3.*reward.max_consecutive_timeouts=3"):
        compute_rewards(["h"] * 64, [ITEM] * 64, [("robust_plugins:sleeps_forever", 1.0)], timeout_s=0.3,
                        max_error_frac=0.5, isolation="auto", max_consecutive_timeouts=3)
    assert time.monotonic() - t0 < 15   # 3 timeouts, not the 33 that max_error_frac=0.5 of 64 would take


def test_stopping_the_worker_ends_a_call_that_hangs_without_a_limit():
    threading.Timer(1.0, stop_reward_worker).start()
    out, took = in_thread(lambda: compute_rewards(["h"], [ITEM], [("robust_plugins:sleeps_forever", 1.0)],
                                                  timeout_s=None, isolation="process"))
    assert isinstance(out, RewardWorkerStopped) and took < 15


def test_a_closure_cannot_go_to_the_worker_and_says_what_to_do(monkeypatch):
    monkeypatch.setitem(REWARDS._entries, "_test_local", lambda completions, **_: [1.0] * len(completions))
    monkeypatch.setitem(REWARDS._facts, "_test_local", dict(REWARDS.defaults))
    with pytest.raises(ValueError, match="reward '_test_local' cannot run in a worker process .*reward.isolation=thread"):
        compute_rewards(["2"], [ITEM], [("_test_local", 1.0)], isolation="process")
    assert compute_rewards(["2"], [ITEM], [("_test_local", 1.0)], isolation="thread").total == [1.0]


@pytest.mark.parametrize("override, key", [("reward.isolation=fork", "reward.isolation"),
                                           ("reward.max_consecutive_timeouts=0", "reward.max_consecutive_timeouts")])
def test_bad_isolation_settings_name_their_key(override, key):
    from test_robust_rewards_tasks import errors_of

    errs = errors_of([override])
    assert any(e.startswith(key) for e in errs), errs


# ------------------------------------------------------------------ whole runs
# A small plug-in model and task (tests/robust_plugins.py), no warm-up: start-up in seconds.
RUN = ["rollout=hf", "logger=none", "warmup.max_steps=0", "trainer.total_steps=3", "trainer.prompts_per_step=2",
       "rollout.group_size=2", "trainer.eval_every=0", "model.builder=robust_plugins.small_llama",
       "task.source=robust_plugins:make_task", "task.train_size=20", "rollout.max_model_len=64",
       "~reward.weights.correctness_binary", "+reward.weights={robust_plugins.sleeps_forever: 1.0}",
       "hydra/job_logging=none", "hydra/hydra_logging=none"]


def start_run(overrides: list[str], tmp_path: Path, **env) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1",
           **env}
    cmd = [sys.executable, "-m", "grpo_lab.train", *RUN, *overrides, f"hydra.run.dir={tmp_path / 'run'}",
           f"cache_dir={tmp_path / 'cache'}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp_path / "log.txt", "w"), stderr=subprocess.STDOUT)


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def hang_from_step_2(tmp_path: Path) -> dict:
    """Environment for sleeps_forever: step 1's reward returns, later calls hang (tests/robust_plugins.py)."""
    return {"REWARD_CALLS_FILE": str(tmp_path / "reward_calls"), "REWARD_HANG_AFTER": "1"}


def hung_calls(tmp_path: Path) -> int:
    calls = tmp_path / "reward_calls"
    return len(calls.read_text().splitlines()) - 1 if calls.exists() else 0


@pytest.mark.slow
def test_an_overlapped_run_whose_reward_hangs_fails_within_a_few_timeouts(tmp_path):
    # Step 2 is sampled in the background thread while step 1 trains: its reward hangs there.
    proc = start_run(["trainer.max_staleness=1", "reward.timeout_s=1", "reward.max_error_frac=1.0"], tmp_path,
                     **hang_from_step_2(tmp_path))
    assert proc.wait(timeout=300) != 0, (tmp_path / "log.txt").read_text()[-3000:]
    s = summary(tmp_path)
    assert s["status"] == "failed"
    assert "'robust_plugins.sleeps_forever' timed out 3 times in a row" in s["error"], s["error"]
    assert "reward.timeout_s=1" in s["error"] and hung_calls(tmp_path) == 3


@pytest.mark.parametrize("staleness", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_sigterm_during_a_hung_reward_ends_the_run_with_a_failed_summary(tmp_path, staleness):
    proc = start_run([f"trainer.max_staleness={staleness}", "reward.timeout_s=null"], tmp_path,
                     **hang_from_step_2(tmp_path))
    deadline = time.monotonic() + 300
    while hung_calls(tmp_path) < 1:
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its reward"
        time.sleep(0.2)
    time.sleep(1.0)   # staleness=1: the main thread now waits on the sampling thread
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 10 and code != 0
    assert summary(tmp_path)["status"] == "failed"
