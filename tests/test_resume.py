"""Runs that survive: `kill -9` a run after a checkpoint, resume it, and its metrics.jsonl equals an
uninterrupted run's line for line (every metric except wall-clock timings); a finished run's
directory is never appended to; a run that fails validation still leaves a record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, TINY_RUN, read_metrics, run_train

RUN = [*TINY_RUN, "rollout=hf", "trainer.total_steps=6", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2",
       "trainer.eval_every=3"]
# Wall-clock measurements differ between any two runs; everything else must match exactly.
TIMING = ("wall_time_s", "perf/")


def comparable(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in lines]


def progress_lines(stdout: str, after: int) -> list[str]:
    """The plain progress lines (no TTY) of the steps after `after`, less their step time."""
    return [line.rsplit(" | ", 1)[0] for line in stdout.splitlines()
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) > after]


def train_cmd(overrides: list[str], run_dir: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "grpo_lab.train", *overrides, f"hydra.run.dir={run_dir}", f"cache_dir={cache}"]


def kill_after_step(overrides: list[str], run_dir: Path, cache: Path, step: int, timeout: float = 300) -> None:
    """Start a run and SIGKILL it (no cleanup at all) once metrics.jsonl has a line for `step`."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(train_cmd(overrides, run_dir, cache), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            f = run_dir / "metrics.jsonl"
            if f.is_file() and any(json.loads(s)["step"] >= step for s in f.read_text().splitlines() if s.strip()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, warm_cache):
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    proc = run_train(RUN, ref_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_stdout = proc.stdout

    kill_after_step(RUN, run_dir, warm_cache, step=5)       # checkpoints at 2 and 4; step 5 is lost
    assert not (run_dir / "summary.json").exists()           # SIGKILL: nothing was recorded at exit
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_2", "step_4"]

    # `make resume RUN=<dir>`: the run's own overrides, replayed into its directory with resume=auto
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"].endswith("step_4")

    resumed, reference = read_metrics(run_dir), read_metrics(ref_dir)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert comparable(resumed) == comparable(reference)
    # The progress lines after the resume show the newest evaluation (step 3's, kept in the step-4
    # checkpoint), as the uninterrupted run's do, not the one before training.
    assert reference[3]["eval/accuracy"] != reference[0]["eval/accuracy"]
    assert progress_lines(proc.stdout, after=4) == progress_lines(ref_stdout, after=4) != []
    # keep_checkpoints=2: the oldest was deleted as step 6's was written
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_4", "step_6"]


# Offline group DPO: every step's groups drawn from one pool of the starting policy's 16 prompts' groups.
POOL_RUN = [*TINY_RUN, "rollout=hf", "algorithm=group_dpo", "algorithm.preference.pairs=start_policy",
            "algorithm.preference.pool_prompts=16", "trainer.total_steps=4", "trainer.checkpoint_every=2",
            "trainer.log_samples_every=1", "trainer.samples_per_log=1000"]


def test_offline_group_dpo_trains_on_one_pool_of_the_starting_policys_groups(tmp_path, warm_cache):
    """pairs=start_policy samples and scores the groups of pool_prompts prompts once, at step 1, and every
    step draws its groups from that pool: 4 steps x 8 prompts from a pool of 16 are exactly its 16 prompts,
    each twice, with the very completions sampled at step 1."""
    run_dir = tmp_path / "run"
    proc = run_train(POOL_RUN, run_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [m for m in read_metrics(run_dir) if "rollout/preference_pairs" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and sum(m["rollout/preference_pairs"] for m in train) > 0
    assert "rollout/pool_groups" in train[0] and all("rollout/pool_groups" not in m for m in train[1:])
    rows = [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:
        if r["kind"] == "train":
            by_step.setdefault(r["step"], []).append((r["prompt"], r["completion"]))
    prompts = [p for step in sorted(by_step) for p, _ in by_step[step][::4]]   # G=4 rows per group
    assert len(prompts) == 32 and len(set(prompts)) == 16 and all(prompts.count(p) == 2 for p in prompts)
    first_pass = {p: sorted(c for q, c in by_step[1] + by_step[2] if q == p) for p in set(prompts)}
    second_pass = {p: sorted(c for q, c in by_step[3] + by_step[4] if q == p) for p in set(prompts)}
    assert first_pass == second_pass      # the same groups again, not new samples of the same prompts


@pytest.mark.slow
def test_offline_group_dpo_resumes_with_its_pool(tmp_path, warm_cache):
    """The pool is in the checkpoint: killed after step 3 and resumed from step 2, the run equals an
    uninterrupted one (a resampled pool, from the engine's later policy, would differ)."""
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    assert run_train(POOL_RUN, ref_dir, warm_cache).returncode == 0
    kill_after_step(POOL_RUN, run_dir, warm_cache, step=3)
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(run_dir)], cwd=REPO,
                          env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(ref_dir))


@pytest.mark.slow
def test_a_finished_run_directory_is_not_appended_to(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "rollout=hf", "trainer.total_steps=1"]
    assert run_train(overrides, run_dir, warm_cache).returncode == 0
    before = (run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()
    proc = run_train(overrides, run_dir, warm_cache)
    assert proc.returncode != 0 and "already holds a run's metrics.jsonl" in proc.stderr
    assert "trainer.resume=auto" in proc.stderr
    assert ((run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()) == before


def test_a_run_that_fails_validation_is_recorded_as_failed(tmp_path):
    """A sweep job with a bad value must show up as failed in the report, not be missing from it."""
    from grpo_lab.report.runs import load_runs

    run_dir = tmp_path / "run"
    proc = run_train(["logger=none", "algorithm.clip_low=1.5"], run_dir, tmp_path / "cache", timeout=120)
    assert proc.returncode != 0 and "algorithm.clip_low=1.5 must lie in (0, 1)" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "clip_low" in summary["error"]
    assert [r.status for r in load_runs(run_dir)] == ["failed"]
    assert not (tmp_path / "cache").exists()                 # failed before any model was built


def test_a_config_refused_for_its_values_is_refused_before_torch_loads(tmp_path):
    """`python -m grpo_lab.train` checks the config's own values before it imports torch, transformers or
    vLLM (the refusal then takes about a second, not the imports' several): -X importtime lists every module
    the process imported, and none of them may be loaded; the refusal is still recorded as failed, named
    without the objective's knobs (which would need torch)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-X", "importtime", "-m", "grpo_lab.train", "logger=none", "learner.lr=-1",
           "rollout.top_p=2", f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "learner.lr=-1.0 must be > 0" in proc.stderr and "rollout.top_p=2.0 must lie in (0, 1]" in proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "grpo_lab.launch" in imported and "omegaconf" in imported       # the listing is read as meant
    assert not {"torch", "transformers", "vllm"} & imported, sorted({"torch", "transformers", "vllm"} & imported)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "learner.lr" in summary["error"]
    assert summary["run_name"] == "chain_sum_tiny_llama_grpo_G8_s0"


def test_a_name_no_registry_holds_is_refused_before_torch_loads_once_a_launch_has_indexed_them(tmp_path):
    """A launch whose config passes validation leaves the registries' names in <cache_dir>/name_index.json (a
    refused one writes nothing: tests/test_config.py's test_bad_values_fail_before_any_model_is_loaded); the
    next launch with an unknown name refuses it from that index, in the registries' own words, without
    importing torch, transformers or vLLM (grpo_lab/name_index.py). The valid launch here is stopped cheaply
    after validation: its directory already holds another run's metrics."""
    def launch(i: int, *overrides: str):
        cmd = [sys.executable, "-X", "importtime", "-m", "grpo_lab.train", "logger=none", *overrides,
               f"hydra.run.dir={tmp_path / f'run_{i}'}", f"cache_dir={tmp_path / 'cache'}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0
        return proc.stderr, {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                             if line.startswith("import time:")}

    message = "algorithm.policy_loss='clipped_surogate' is not registered; valid choices: "
    (tmp_path / "run_1").mkdir()
    (tmp_path / "run_1" / "metrics.jsonl").write_text('{"step": 1}\n')
    valid, _ = launch(1)
    assert "already holds a run's metrics.jsonl" in valid and (tmp_path / "cache" / "name_index.json").is_file()
    second, second_imports = launch(2, "algorithm.policy_loss=clipped_surogate", "+reward.weights.corectness=1.0")
    assert message in second and "reward.weights.corectness='corectness' is not registered" in second
    assert "the other checks run once these are fixed" in second
    assert "grpo_lab.name_index" in second_imports
    assert not {"torch", "transformers", "vllm"} & second_imports, sorted({"torch", "transformers", "vllm"} & second_imports)
    assert json.loads((tmp_path / "run_2" / "summary.json").read_text())["status"] == "failed"


def test_libraries_are_quiet_unless_v_asks(tmp_path, monkeypatch):
    """Without -v the launcher turns the libraries' start-up output off through variables the engine's
    processes inherit (a variable the user set wins); -v is taken off the command line before Hydra, which
    would refuse it, and keeps vLLM's log at INFO."""
    from grpo_lab.launch import quiet_libraries

    for var in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    quiet_libraries(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO" and "ignore::FutureWarning" in os.environ["PYTHONWARNINGS"]
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    quiet_libraries(verbose=True)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.train", "-v", "logger=none", "learner.lr=-1",
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "learner.lr=-1.0 must be > 0" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["overrides"] == ["logger=none", "learner.lr=-1"]


@pytest.mark.parametrize("value", ["nan", pytest.param("inf", marks=pytest.mark.slow),
                                   pytest.param("-inf", marks=pytest.mark.slow)])
def test_non_finite_config_values_are_rejected(tmp_path, value):
    proc = run_train(["logger=none", f"learner.lr={value}"], tmp_path / "run", tmp_path / "cache", timeout=120)
    assert proc.returncode != 0 and "learner.lr=" in proc.stderr and "is not a finite number" in proc.stderr


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "rollout=hf", "logger=wandb", "trainer.checkpoint_every=1"]
    assert run_train(overrides, run_dir, warm_cache).returncode == 0
    first = {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}
    proc = run_train([*overrides, f"trainer.resume={run_dir / 'checkpoints' / 'step_1'}"], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {p.name.rsplit("-", 1)[-1] for p in runs} == first   # one id, two sessions
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2, 2]                # cut back, not appended


@pytest.mark.slow
def test_resume_finds_a_config_group_the_launch_found_through_its_searchpath(tmp_path, warm_cache):
    """A table's rows are `+variant=<name>` groups in a directory of their own, found through
    `hydra.searchpath`: `grpo_lab.resume` replays the searchpath with the run's overrides."""
    (tmp_path / "confs" / "variant").mkdir(parents=True)
    (tmp_path / "confs" / "variant" / "shorter_answers.yaml").write_text(
        "# @package _global_\nrollout:\n  max_new_tokens: 6\n")
    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "rollout=hf", "trainer.checkpoint_every=1",
                 f"hydra.searchpath=[file://{tmp_path / 'confs'}]", "+variant=shorter_answers"]
    assert run_train(overrides, run_dir, warm_cache).returncode == 0
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(run_dir),
                           f"trainer.resume={run_dir / 'checkpoints' / 'step_1'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"].endswith("step_1")
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2, 2]
    assert "max_new_tokens: 6" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.vllm
def test_resume_with_vllm_matches_within_seeded_sampling_tolerance(tmp_path, warm_cache):
    """With rollout=vllm every request carries its own seed, so a resumed run samples the same tokens as
    the uninterrupted one; the engine's logprobs after a fresh start + weight push may differ from the
    long-running engine's in the last float bits. Tolerance: identical steps/samples/rewards, and every
    other metric within 1e-4 relative, far above such last-bit differences."""
    run = ["rollout=vllm", *RUN]
    run_dir = tmp_path / "run"
    assert run_train(run, run_dir, warm_cache).returncode == 0
    reference = comparable(read_metrics(run_dir))
    proc = run_train([*run, f"trainer.resume={run_dir / 'checkpoints' / 'step_4'}"], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = comparable(read_metrics(run_dir))
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    for a, b in zip(resumed, reference):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(("reward/", "step", "samples", "rollout/completion_len")):
                assert a[key] == b[key], key
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
