"""A run directory holds one run, whole: a resume cannot change what defines the run (only the keys
grpo_lab/run_guard.py's RESUMABLE_CHANGES lists, and those are recorded); a refused launch leaves every
file of the directory byte-identical; one process owns the directory (a second fails at once, naming
the owner; `kill -9` leaves no stale lock); checkpoints carry a manifest, a damaged one is skipped with
a warning naming the file, an explicit `trainer.resume=<checkpoint>` is honoured; the warm-up cache
follows a dataset's content; SIGTERM always ends a run with a failed summary.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, TINY_RUN, read_metrics, run_train

from grpo_lab import checkpoint, run_guard
from grpo_lab.schema import ConfigError
from grpo_lab.resume import resume_command

RUN = [*TINY_RUN, "rollout=hf", "trainer.total_steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"]


def tree(run_dir: Path) -> dict[str, bytes]:
    """Every file under `run_dir` (the lock file included), by relative path."""
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def resume_args(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpo_lab.resume", str(run_dir), *extra]


def resume(run_dir: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(resume_args(run_dir, *extra), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------ what a resume may change
@pytest.mark.slow
def test_a_resume_refuses_what_defines_the_run_and_records_what_it_may_change(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    assert run_train(RUN, run_dir, warm_cache).returncode == 0
    before = tree(run_dir)

    # A second launch into the directory is refused, and Hydra's rewrite of .hydra/ is undone: the
    # resume below must not continue this GRPO checkpoint as RLOO.
    proc = run_train([*RUN, "algorithm=rloo"], run_dir, warm_cache)
    assert proc.returncode != 0 and "already holds a run's metrics.jsonl" in proc.stderr
    assert tree(run_dir) == before

    proc = resume(run_dir, "learner.lr=1e-3", "rollout.group_size=2")
    assert proc.returncode != 0
    assert "learner.lr: 0.0001 -> 0.001" in proc.stderr and "rollout.group_size: 4 -> 2" in proc.stderr
    assert "Loading weights" not in proc.stdout + proc.stderr          # refused before any model loads
    assert tree(run_dir) == before

    proc = resume(run_dir, "trainer.total_steps=3")                   # extending the run is allowed
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["algorithm"]["name"] == "grpo" and config["trainer"]["total_steps"] == 3
    assert {"step": 2, "key": "trainer.total_steps", "old": 2, "new": 3} in config["resume_changes"]
    lines = read_metrics(run_dir)
    marks = [m for m in lines if "resume_changes" in m]
    assert len(marks) == 1 and marks[0]["step"] == 2
    assert marks[0]["resume_changes"]["trainer.total_steps"] == {"old": 2, "new": 3}
    assert [m["step"] for m in lines if "resume_changes" not in m] == [0, 1, 2, 3, 3]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_resume_changes_name_every_refused_key():
    old = {"learner": {"lr": 1e-4, "lr_schedule": "constant", "total_steps": 6}, "rollout": {"group_size": 8},
           "trainer": {"total_steps": 6, "resume": None}, "logger": {"project": "a"}, "resume_changes": []}
    new = json.loads(json.dumps(old))
    del new["resume_changes"]
    new["trainer"].update(total_steps=8, resume="auto")
    new["learner"]["total_steps"] = 8          # follows trainer.total_steps; unused by a constant schedule
    new["logger"]["project"] = "b"
    from omegaconf import OmegaConf

    changes = run_guard.resume_changes(OmegaConf.create(new), old, step=4)
    assert {(c["key"], c["old"], c["new"]) for c in changes} == {
        ("trainer.total_steps", 6, 8), ("learner.total_steps", 6, 8), ("logger.project", "a", "b")}
    new["learner"].update(lr=1e-3, lr_schedule="cosine")
    new["rollout"]["group_size"] = 4
    with pytest.raises(ConfigError) as err:
        run_guard.resume_changes(OmegaConf.create(new), old, step=4)
    for refused in ("learner.lr: 0.0001 -> 0.001", "rollout.group_size: 8 -> 4", "learner.total_steps: 6 -> 8",
                    "learner.lr_schedule: 'constant' -> 'cosine'"):
        assert refused in str(err.value)


def test_a_section_the_schema_gained_since_the_checkpoint_resumes_at_its_default():
    """A checkpoint written before the schema had a section (its config lacks the key) resumes when the
    section holds the schema's default, which is what the old code did; any other value is refused."""
    from omegaconf import OmegaConf

    from grpo_lab.schema import Config

    new = OmegaConf.to_container(OmegaConf.structured(Config), resolve=True)
    old = json.loads(json.dumps(new))
    del old["interaction"]
    changes = run_guard.resume_changes(OmegaConf.create(new), old, step=4)
    assert [(c["key"], c["old"]) for c in changes] == [("interaction", run_guard.ABSENT)]
    new["interaction"]["max_turns"] = 2
    with pytest.raises(ConfigError, match=r"interaction: '\(absent\)' -> "):
        run_guard.resume_changes(OmegaConf.create(new), old, step=4)


def test_resume_replays_the_runs_own_overrides_and_honours_an_explicit_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["algorithm=rloo"]))   # a refused launch's
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump(["algorithm=grpo", "trainer.total_steps=6",
                                                            "trainer.resume=auto"]))
    cmd = resume_command(run_dir, ["trainer.total_steps=8", "trainer.resume=/x/step_2"])
    assert cmd[3:] == ["algorithm=grpo", "trainer.total_steps=8", f"hydra.run.dir={run_dir.resolve()}",
                       "trainer.resume=/x/step_2"]
    assert resume_command(run_dir)[-1] == "trainer.resume=auto"


# ------------------------------------------------------------------ one process per run directory
@pytest.mark.slow
def test_one_process_owns_a_run_directory(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    assert run_train(RUN, run_dir, warm_cache).returncode == 0
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    owner = subprocess.Popen(resume_args(run_dir, "trainer.total_steps=400"), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = run_dir / run_guard.LOCK_FILE
    try:
        deadline = time.time() + 300
        while time.time() < deadline and lock.read_text().strip() != str(owner.pid):
            assert owner.poll() is None, "the first resume ended early"
            time.sleep(0.1)
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        second = resume(run_dir, "trainer.total_steps=400", timeout=120)
        assert owner.poll() is None, "the first resume ended before the second tried"
        assert second.returncode != 0 and f"is in use by process {owner.pid}" in second.stderr
        assert "Loading weights" not in second.stdout + second.stderr
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
    finally:
        owner.send_signal(signal.SIGKILL)        # no cleanup at all: the kernel drops the lock
        owner.wait(timeout=30)
    newest = checkpoint.checkpoints(run_dir)[-1]
    proc = resume(run_dir, f"trainer.total_steps={checkpoint.load_step(newest) + 1}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir) if "perf/step_time_s" in m]
    assert steps == list(range(1, len(steps) + 1))             # no step twice, none lost


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from grpo_lab.run_guard import RunLock; "
         "RunLock(sys.argv[1]).mark_owner(); print('locked', flush=True); time.sleep(600)", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(run_guard.RunDirInUse, match=f"in use by process {holder.pid}"):
            run_guard.RunLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    run_guard.RunLock(tmp_path).release()


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_run_name_that_is_no_plain_directory_name_is_refused_before_hydra_writes(tmp_path, sweep):
    """run_name becomes part of the run directory's path (hydra.run.dir / hydra.sweep.subdir):
    `x/../../../escaped` wrote a refused launch's record outside outputs/. It is refused while Hydra
    resolves that path, before it creates anything. trainer.total_steps=-1 makes a launch that does not
    check run_name fail validation at once instead of training."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "grpo_lab.train", *(["-m"] if sweep else []), *TINY_RUN,
           "trainer.total_steps=-1", "run_name=x/../../../escaped", f"cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert not (tmp_path / "escaped").exists() and not (cwd / "escaped").exists()
    assert not (cwd / "outputs" / "runs").exists()            # no run directory at all
    assert "run_name='x/../../../escaped'" in proc.stderr and "one plain path component" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ checkpoints
class FakeLearner:
    def save(self, path: Path, tokenizer) -> None:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(os.urandom(256))

    def state_dict(self) -> dict:
        return {"weights": torch.arange(4)}


def test_a_checkpoint_verifies_against_its_manifest(tmp_path, capsys):
    for step in (2, 4):
        checkpoint.save(tmp_path, step, learner=FakeLearner(), tokenizer=None, state={}, keep=2)
    newest = tmp_path / "checkpoints" / "step_4"
    assert set(json.loads((newest / checkpoint.MANIFEST).read_text())["files"]) == {
        checkpoint.STATE_FILE, "policy/model.safetensors"}
    assert checkpoint.resolve("auto", tmp_path) == newest

    weights = newest / "policy" / "model.safetensors"
    weights.write_bytes(b"x" + weights.read_bytes()[1:])          # same size, other bytes
    assert checkpoint.resolve("auto", tmp_path) == tmp_path / "checkpoints" / "step_2"
    assert f"skipping checkpoint step_4: {weights} is corrupt" in capsys.readouterr().err
    with pytest.raises(checkpoint.CheckpointError, match=str(weights)):   # chosen explicitly: no fallback
        checkpoint.resolve(str(newest), tmp_path)

    state = tmp_path / "checkpoints" / "step_2" / checkpoint.STATE_FILE
    state.write_bytes(state.read_bytes()[:10])
    with pytest.raises(checkpoint.CheckpointError, match="none of the checkpoints"):
        checkpoint.resolve("auto", tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=f"{state} cannot be loaded"):
        checkpoint.load(state.parent)


def test_a_checkpoint_from_before_manifests_is_accepted_and_a_killed_write_is_cleaned_up(tmp_path):
    ckpt = checkpoint.save(tmp_path, 2, learner=FakeLearner(), tokenizer=None, state={}, keep=2)
    (ckpt / checkpoint.MANIFEST).unlink()
    assert checkpoint.resolve("auto", tmp_path) == ckpt             # has its state file: back-compat
    partial = tmp_path / "checkpoints" / ".step_4.tmp-killed"
    partial.mkdir()
    checkpoint.save(tmp_path, 3, learner=FakeLearner(), tokenizer=None, state={}, keep=2)
    assert not partial.exists()
    (ckpt / checkpoint.STATE_FILE).unlink()                          # no manifest, no state: incomplete
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_3"]


@pytest.mark.slow
def test_resume_falls_back_from_a_corrupt_checkpoint_and_honours_an_explicit_one(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    run = [*TINY_RUN, "rollout=hf", "trainer.total_steps=4", "trainer.checkpoint_every=2"]
    assert run_train(run, run_dir, warm_cache).returncode == 0
    ckpts = run_dir / "checkpoints"
    partial = ckpts / ".step_6.tmp-killed"
    partial.mkdir()

    proc = resume(run_dir, f"trainer.resume={ckpts / 'step_2'}")     # not overridden by resume=auto
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == str(ckpts / "step_2")
    assert not partial.exists()

    state = ckpts / "step_4" / checkpoint.STATE_FILE
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    proc = resume(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping checkpoint step_4: {state} is corrupt" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == str(ckpts / "step_2")
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2, 3, 4, 4]


# ------------------------------------------------------------------ the warm-up cache
def test_the_warmup_cache_follows_the_datasets_content(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    import grpo_lab.run_setup as run_setup
    from grpo_lab.config import finalize, register_configs
    from grpo_lab.tasks import build_task

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=[
            "task.source=local_dataset", f"task.path={data}", "task.dev_size=5", "task.test_size=5",
            "task.answer_format=plain", f"cache_dir={tmp_path / 'cache'}", "rollout=hf"]))
    built = []
    monkeypatch.setattr(run_setup, "warmup_sft", lambda base, out, *a, **k: built.append(out) or {"steps": 0})

    run_setup.build_policy(cfg, build_task(cfg.task), torch.device("cpu"))
    run_setup.build_policy(cfg, build_task(cfg.task), torch.device("cpu"))
    rows[0]["answer"] = "3"                                       # the file edited in place: same path
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_setup.build_policy(cfg, build_task(cfg.task), torch.device("cpu"))
    assert built[0] == built[1] != built[2]


# ------------------------------------------------------------------ SIGTERM
STUCK_RUN = ["rollout=hf", "logger=none", "warmup.max_steps=0", "trainer.total_steps=2", "trainer.prompts_per_step=4",
             "rollout.group_size=2", "trainer.eval_every=0", "model.builder=robust_plugins.small_llama",
             "task.source=robust_plugins:make_task", "task.train_size=40", "rollout.max_model_len=64",
             "~reward.weights.correctness_binary"]


@pytest.mark.parametrize("stuck_in", ["in_c_call", "in_thread_join"])
def test_sigterm_ends_a_stuck_run_with_a_failed_summary(tmp_path, stuck_in):
    summary = _sigterm_once_stuck(tmp_path, ["grpo_lab.train", *STUCK_RUN,
                                             f"+reward.weights={{stuck_plugins.{stuck_in}: 1.0}}"])
    assert summary["status"] == "failed" and ("SIGTERM" in summary["error"] or "143" in summary["error"])


def test_sigterm_ends_a_reward_model_training_stuck_in_its_gold_scorer_with_a_failed_summary(tmp_path):
    """make train-rm under a scheduler's cancel: the pair sampler's gold scorer is stuck in C, and the entry
    point still ends with 143 and a failed summary.json, as a run does."""
    summary = _sigterm_once_stuck(tmp_path, ["grpo_lab.train_reward_model", *STUCK_RUN[:-1],
                                             "reward_model.data.gold=stuck_plugins.in_c_call",
                                             "reward_model.data.pairs=8", "reward_model.data.held_out_pairs=4"])
    assert summary["status"] == "failed" and ("SIGTERM" in summary["error"] or "143" in summary["error"])


def _sigterm_once_stuck(tmp_path: Path, module_and_overrides: list[str]) -> dict:
    """Start `python -m <module> <overrides>` in tmp_path/run, SIGTERM it once a stuck plug-in has touched its
    marker, check it ends with 143 within the grace, and return its summary.json."""
    run_dir, marker = tmp_path / "run", tmp_path / "mid_step"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1",
           "STUCK_MARKER": str(marker)}
    cmd = [sys.executable, "-m", *module_and_overrides, f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), proc.stderr.read()[-3000:] if proc.poll() is not None else "never reached a step"
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=run_guard.SIGTERM_GRACE_S + 60) == 128 + signal.SIGTERM
        assert time.time() - sent < run_guard.SIGTERM_GRACE_S + 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return json.loads((run_dir / "summary.json").read_text())
