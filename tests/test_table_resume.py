"""Tables survive interruption: each run's state is read from disk (done / running / interrupted /
failed / to do), `--status` reports it with the time left, and a table killed mid-run (SIGKILL of its
whole process group) continues when its command runs again: the finished run is not re-run, the
interrupted one resumes from its checkpoint, and the table equals the one made without a stop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, TASK, WARMUP
from omegaconf import OmegaConf

from grpo_lab.tables import state
from grpo_lab.tables.launch import jobs_but_seeds, new_launch, same_launch
from grpo_lab.tables.plan import OWNER_CALLBACK, make_plan, preflight
from grpo_lab.tables.spec import load_spec

# Two rows of one seed, five steps each, a checkpoint after every step: small enough to run three times.
TINY_TABLE = {
    "title": "resume check", "paper_finding": "none: a test table", "seeds": [0], "checkpoint_every": 1,
    "fixed": ["rollout=hf", "logger=none", "trainer.total_steps=5", "trainer.eval_every=2",
              "trainer.prompts_per_step=8", "rollout.group_size=4", "trainer.save_checkpoint=false", *TASK, *WARMUP],
    "variants": [{"name": "a", "overrides": ["algorithm.clip_low=0.2"]},
                 {"name": "b", "overrides": ["algorithm.clip_low=0.1"]}],
    # No timing column: the two tables must agree on every cell.
    "columns": ["final_acc", "best_acc", "gain", "zero_adv_frac", "final_entropy", "wrong_len", "steps"],
}
# Keys of a metrics line that measure time, not what the run computed.
TIMINGS = ("wall_time_s", "perf/")


def write_run(d: Path, *, status: str | None = None, error: str | None = None, steps: int = 0,
              checkpoint: int | None = None, total_steps: int = 10, wall: float = 100.0) -> Path:
    """A hand-made run directory: config, `steps` metric lines of 2 s each, a summary, a checkpoint."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"trainer": {"total_steps": total_steps}}))
    if steps:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "perf/step_time_s": 2.0}) + "\n"
                                                 for s in range(1, steps + 1)))
    if status:
        (d / "summary.json").write_text(json.dumps({"status": status, "error": error, "steps": steps,
                                                    "wall_time_s": wall}))
    if checkpoint is not None:
        (d / "checkpoints" / f"step_{checkpoint}").mkdir(parents=True)
        (d / "checkpoints" / f"step_{checkpoint}" / "trainer_state.pt").write_bytes(b"")
    return d


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_runs_state_is_read_from_its_directory(tmp_path):
    done = write_run(tmp_path / "done", status="completed", steps=10)
    failed = write_run(tmp_path / "failed", status="failed", error="NonFiniteError: NaN", steps=3, checkpoint=2)
    killed = write_run(tmp_path / "killed", steps=4, checkpoint=3)                  # SIGKILL: no summary
    early = write_run(tmp_path / "early", steps=0)                                  # before its first step
    (early / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
    termed = write_run(tmp_path / "termed", status="failed", error="SystemExit: 143", steps=4, checkpoint=4)
    running = write_run(tmp_path / "running", steps=2)
    state.write_owner(running)                                                       # this process owns it
    orphan = write_run(tmp_path / "orphan", steps=2, checkpoint=2)
    (orphan / state.OWNER_FILE).write_text(json.dumps({**state.process_identity(), "pid": dead_pid()}))
    hydra_only = tmp_path / "hydra_only" / ".hydra"
    hydra_only.mkdir(parents=True)
    expected = {done: state.DONE, failed: state.FAILED, killed: state.INTERRUPTED, early: state.INTERRUPTED,
                termed: state.INTERRUPTED, running: state.RUNNING, orphan: state.INTERRUPTED,
                hydra_only.parent: state.TODO, tmp_path / "never": state.TODO}
    got = {d: state.run_state(d) for d in expected}
    assert {d: s.state for d, s in got.items()} == expected
    assert got[killed].resumable_step == 3 and got[killed].steps_done == 4 and got[early].resumable_step is None
    assert got[running].owner["pid"] == os.getpid() and got[orphan].owner is None
    assert got[done].compute_time_s == 20.0 and got[done].steps == 10


def test_an_owner_is_alive_only_while_its_process_is(tmp_path):
    me = state.process_identity()
    assert state.alive(me)
    assert not state.alive({**me, "pid": dead_pid()})
    assert not state.alive({**me, "boot_id": "another boot"})                       # the machine restarted
    assert not state.alive({**me, "start_ticks": (me["start_ticks"] or 0) + 1})    # the pid was given again
    assert state.alive({**me, "host": "another-host"})      # a cluster node's job cannot be checked from here
    assert not state.alive(None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = state.process_identity(child.pid)
    assert state.alive(owner)
    child.kill()
    deadline = time.time() + 30
    while state.alive(owner):   # killed and not reaped yet: a zombie runs nothing
        assert time.time() < deadline
        time.sleep(0.05)
    assert Path(f"/proc/{child.pid}").exists()
    child.wait()


def test_the_run_owner_callback_marks_a_job_while_it_runs(tmp_path):
    config = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "job")}}})
    owner = state.RunOwner()
    owner.on_job_start(config)
    assert state.run_state(tmp_path / "job").state == state.RUNNING
    owner.on_job_end(config)
    assert not (tmp_path / "job" / state.OWNER_FILE).exists()


def test_time_left_from_finished_runs_and_step_times(tmp_path):
    done = [write_run(tmp_path / f"done{i}", status="completed", steps=10, wall=30.0 + 10 * i) for i in range(3)]
    killed = write_run(tmp_path / "killed", steps=6, checkpoint=4)
    todo = tmp_path / "todo"
    left = state.time_left_s([state.run_state(d) for d in [*done, killed, todo]])
    # 6 steps from the checkpoint at 2 s each, plus the finished runs' median time outside steps (40 - 20)
    assert left[killed] == 6 * 2.0 + 20.0
    assert left[todo] == 40.0 and left[done[0]] == 0.0


def test_a_runs_conditions_are_the_mean_host_load_over_its_steps():
    steps = [{"step": 1, "perf/host_load_1m": 2.0}, {"step": 2, "perf/host_load_1m": 3.5}, {"step": 2, "eval/acc": 0.5}]
    assert state.mean_host_load(steps) == 2.75
    assert state.mean_host_load([{"step": 1, "perf/step_time_s": 1.0}]) is None   # a run from before it was logged


def tiny_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_TABLE))
    return path


def test_every_job_resumes_and_records_its_owner_and_launches_compare_without_them(tmp_path):
    plan = make_plan(load_spec(tiny_spec(tmp_path)), runs_root=tmp_path / "runs")
    assert "trainer.resume=auto" in plan.base and "trainer.checkpoint_every=1" in plan.base
    assert OWNER_CALLBACK in plan.command
    # A launch from before these overrides existed runs the same jobs.
    older = [c for c in plan.command if c != OWNER_CALLBACK and not c.startswith(("trainer.resume", "trainer.checkp"))]
    assert jobs_but_seeds(older) == jobs_but_seeds(plan.command)
    assert preflight(plan) == 2 and [d.name for d in plan.run_dirs] == ["0_a_s0", "1_b_s0"]
    record = new_launch(plan, "python scripts/make_table.py tiny")
    assert [j["dir"] for j in record["jobs"]] == ["0_a_s0", "1_b_s0"]
    again = make_plan(load_spec(tiny_spec(tmp_path)), runs_root=tmp_path / "runs")
    assert same_launch(record, again, added=False) and not same_launch(record, again, added=True)
    again.continue_launch(record)
    assert f"logger.group={record['group']}" in again.command
    other = make_plan(load_spec(tiny_spec(tmp_path)), runs_root=tmp_path / "runs", extra=["trainer.total_steps=6"])
    assert not same_launch(record, other, added=False)
    edited = load_spec(tiny_spec(tmp_path))
    edited.variants[1].overrides = ["algorithm.clip_low=0.15"]      # the yaml changed between the attempts
    assert not same_launch(record, make_plan(edited, runs_root=tmp_path / "runs"), added=False)


def test_status_lists_every_planned_run_and_a_second_launch_waits_for_a_live_one(tmp_path):
    plan = make_plan(load_spec(tiny_spec(tmp_path)), runs_root=tmp_path / "runs")
    preflight(plan)
    record = new_launch(plan, "python scripts/make_table.py tiny")
    record["attempts"].append({**state.process_identity(), "invocation": "x", "started_ts": time.time()})
    state.write_launch(plan.runs_dir, record)
    write_run(plan.runs_dir / "0_a_s0", status="completed", steps=5, total_steps=5)

    def make_table(*args):
        return subprocess.run([sys.executable, "scripts/make_table.py", str(tiny_spec(tmp_path)), "--runs-root",
                               str(tmp_path / "runs"), "--tables-root", str(tmp_path / "tables"), *args], cwd=REPO,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)

    proc = make_table("--status")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "launcher alive: pid" in lines[0]
    assert any(line.split()[:2] == ["0_a_s0", "done"] for line in lines), proc.stdout
    assert any(line.split()[:3] == ["1_b_s0", "to", "do"] for line in lines), proc.stdout
    assert "done 1, running 0, interrupted 0, failed 0, to do 1; time left ≈ 1.7 min" in proc.stdout
    proc = make_table()                          # this test process is the "launcher": still alive
    assert proc.returncode == 2 and "is being made now (make_table pid" in proc.stderr, proc.stderr
    assert not (plan.runs_dir / "1_b_s0").exists()


def _table(tmp_path: Path, root: str, cache: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "scripts/make_table.py", str(tiny_spec(tmp_path)),
         "--runs-root", str(tmp_path / root / "runs"), "--tables-root", str(tmp_path / root / "tables"),
         "--", f"cache_dir={cache}"],
        cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, **kw)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


def _without_timings(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(TIMINGS)} for line in lines]


@pytest.mark.slow
def test_a_killed_table_continues_to_the_same_table(warm_cache, tmp_path):
    _finish(_table(tmp_path, "whole", warm_cache))
    proc = _table(tmp_path, "stopped", warm_cache, start_new_session=True)
    runs = tmp_path / "stopped" / "runs" / "tiny"
    first, second = runs / "0_a_s0", runs / "1_b_s0"
    deadline = time.time() + 900
    while not (state.run_state(first).state == state.DONE and state.run_state(second).resumable_step):
        assert proc.poll() is None and time.time() < deadline, "the table ended before it could be stopped"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)          # the launcher, the multirun and the job: the machine stopped
    proc.communicate()
    while state.run_state(second).state == state.RUNNING:   # until the kill has reached the job's process
        assert time.time() < deadline
        time.sleep(0.05)
    stopped = state.run_state(second)
    assert stopped.state == state.INTERRUPTED and stopped.resumable_step < 5
    finished_at = (first / "summary.json").stat().st_mtime_ns

    status = subprocess.run([sys.executable, "scripts/make_table.py", str(tiny_spec(tmp_path)), "--status",
                             "--runs-root", str(tmp_path / "stopped" / "runs")], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert "stopped: run `" in status.stdout and f"resumes at step {stopped.resumable_step}" in status.stdout
    assert "done 1, running 0, interrupted 1" in status.stdout, status.stdout

    out = _finish(_table(tmp_path, "stopped", warm_cache))
    assert "continuing the stopped launch" in out
    assert (first / "summary.json").stat().st_mtime_ns == finished_at                # not run again
    summary = json.loads((second / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{stopped.resumable_step}")
    for name in ("0_a_s0", "1_b_s0"):   # the same run, line for line: no step twice, none lost
        assert _without_timings(runs / name) == _without_timings(tmp_path / "whole" / "runs" / "tiny" / name)
    whole, again = tmp_path / "whole" / "tables", tmp_path / "stopped" / "tables"
    assert (again / "tiny.csv").read_text() == (whole / "tiny.csv").read_text()
    assert ((again / "tiny_runs.csv").read_text().replace(str(tmp_path / "stopped"), "")
            == (whole / "tiny_runs.csv").read_text().replace(str(tmp_path / "whole"), ""))
    assert "| a | 1 ok / 0 failed |" in (again / "tiny.md").read_text()
    meta = json.loads((runs / "table_meta.json").read_text())
    assert len(meta["attempts"]) == 2 and "over 2 attempts (stopped and continued)" in meta["date"]
    assert meta["run_times"]["1_b_s0"]["resumed"] and meta["run_times"]["1_b_s0"]["compute_time_s"] > 0
    assert meta["run_times"]["1_b_s0"]["mean_host_load_1m"] > 0
    assert not (runs / state.LAUNCH_FILE).exists()


@pytest.mark.slow
def test_a_killed_table_recorded_here_continues_in_a_checkout_without_its_runs(warm_cache, tmp_path):
    """A table longer than a session: stopped after its first run, recorded (--report-only; the interrupted
    run moved aside, as it starts over anyway), its run directories then gone. The same command restores the
    finished run and the launch from the record and runs only the other run, to the same table."""
    _finish(_table(tmp_path, "whole", warm_cache))
    proc = _table(tmp_path, "stopped", warm_cache, start_new_session=True)
    runs = tmp_path / "stopped" / "runs" / "tiny"
    first, second = runs / "0_a_s0", runs / "1_b_s0"
    deadline = time.time() + 900
    while state.run_state(first).state != state.DONE:
        assert proc.poll() is None and time.time() < deadline, "the table ended before it could be stopped"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    while state.run_state(second).state == state.RUNNING:
        assert time.time() < deadline
        time.sleep(0.05)
    shutil.rmtree(second, ignore_errors=True)
    report = subprocess.run([sys.executable, "scripts/make_table.py", str(tiny_spec(tmp_path)), "--report-only",
                             "--runs-root", str(tmp_path / "stopped" / "runs"), "--tables-root",
                             str(tmp_path / "stopped" / "tables")], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    meta = json.loads((tmp_path / "stopped" / "tables" / "tiny_meta.json").read_text())
    assert [j["dir"] for j in meta["stopped_launch"]["jobs"]] == ["0_a_s0", "1_b_s0"]
    assert "stopped before it finished" in meta["date"]

    shutil.rmtree(tmp_path / "stopped" / "runs")                  # another checkout: only the record
    out = _finish(_table(tmp_path, "stopped", warm_cache))
    assert "1 runs (seeds 0) restored from" in out and "continuing the stopped launch" in out, out[-3000:]
    whole, again = tmp_path / "whole" / "tables", tmp_path / "stopped" / "tables"
    assert ("1 finished runs kept, 0 resumed from their newest checkpoint, 0 started over, 1 started"
            in (again / "tiny.md").read_text())
    assert json.loads((first / "summary.json").read_text())["restored_from"]
    assert _without_timings(second) == _without_timings(tmp_path / "whole" / "runs" / "tiny" / "1_b_s0")
    assert (again / "tiny.csv").read_text() == (whole / "tiny.csv").read_text()
    meta = json.loads((again / "tiny_meta.json").read_text())   # the record of a finished table
    assert "over 2 attempts (stopped and continued)" in meta["date"] and "stopped_launch" not in meta
    assert not (runs / state.LAUNCH_FILE).exists()


def test_a_continued_launch_runs_only_what_did_not_finish(tmp_path, monkeypatch):
    """Finished and failed runs are kept; an interrupted run resumes in its directory; one stopped before
    its first checkpoint moves to the archive and starts over; one never started starts. Each job runs
    as a multirun of its own into the directory the launch gave it, as many at once as the launch ran."""
    from grpo_lab.tables import launch

    spec = TINY_TABLE | {"variants": [{"name": n, "overrides": [f"algorithm.clip_low=0.{i + 1}"]}
                                      for i, n in enumerate("abcde")]}
    path = tmp_path / "five.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = make_plan(load_spec(path), runs_root=tmp_path / "runs", launcher="joblib", jobs=2)
    preflight(plan)
    record = new_launch(plan, "python scripts/make_table.py five")
    record["attempts"].append({**state.process_identity(), "invocation": "again", "started_ts": time.time()})
    done, failed, killed, early, todo = plan.run_dirs
    write_run(done, status="completed", steps=5)
    write_run(failed, status="failed", error="NonFiniteError: NaN", steps=2)
    write_run(killed, steps=3, checkpoint=3)
    write_run(early, steps=1)
    ran = []
    monkeypatch.setattr(launch, "run_logged", lambda cmd, log, env: ran.append(cmd) or 0)
    monkeypatch.setattr(launch, "prewarm", lambda plan, log, attempt: ran.append(["prewarm", attempt]) or 0)
    notes = []
    assert launch.continue_jobs(plan, record, tmp_path / "log", notes) == 0
    assert ran[0] == ["prewarm", 1]
    subdirs = [next(c for c in cmd if c.startswith("hydra.sweep.subdir=")) for cmd in ran[1:]]
    assert subdirs == [f"hydra.sweep.subdir={d.name}" for d in (killed, early, todo)]
    job = record["jobs"][2]
    assert all(o in ran[1] for o in job["overrides"]) and OWNER_CALLBACK in ran[1]
    assert not any(o.startswith("hydra/launcher=") for o in ran[1])     # one job needs no joblib workers
    assert not early.exists()
    assert list((tmp_path / "runs" / "_archive").glob(f"five-partial-*/{early.name}/metrics.jsonl"))
    assert killed.exists() and done.exists() and failed.exists()
    assert ("1 finished runs kept, 1 resumed from their newest checkpoint, 1 started over (stopped before their "
            "first checkpoint; moved to _archive/five-partial-") in notes[0]
    assert "1 started; 1 failed runs kept" in notes[0]


def test_a_launchs_log_holds_each_line_as_the_job_writes_it(tmp_path):
    """Not when a buffer fills: a killed launch's log must end where its jobs stopped, since that is where
    the stopped attempt's wall time ends (and what `tail -f` on the log shows)."""
    import threading

    from grpo_lab.tables import launch

    log, go_on = tmp_path / "make_table.log", tmp_path / "go_on"
    # The line is made when the job runs: the command, which the log starts with, does not hold it.
    job = [sys.executable, "-c", "import os, time; print('step %d/32' % 1, flush=True)\n"
           f"while not os.path.exists({str(go_on)!r}): time.sleep(0.05)"]
    written = lambda: log.read_text() if log.exists() else ""   # noqa: E731
    run = threading.Thread(target=launch.run_logged, args=(job, log, {}))
    run.start()
    try:
        deadline = time.time() + 30
        while "step 1/32" not in written() and time.time() < deadline:
            time.sleep(0.05)
        assert "step 1/32" in written()                 # while the job still runs
    finally:
        go_on.touch()
        run.join(timeout=30)


def test_a_continued_launchs_wall_time_leaves_out_the_wait_between_attempts(tmp_path, monkeypatch):
    """The stopped attempt counts until its last output to the log, not until the re-run began: a table
    killed at night and continued in the morning does not report the night as its wall time."""
    from grpo_lab.tables import launch

    plan = make_plan(load_spec(tiny_spec(tmp_path)), runs_root=tmp_path / "runs", launcher="joblib", jobs=2)
    preflight(plan)
    record = new_launch(plan, "python scripts/make_table.py tiny")
    started = time.time() - 3600                      # the first attempt began an hour ago ...
    record["attempts"].append({**state.process_identity(), "invocation": "first", "started_ts": started,
                               "started": "then"})
    log = plan.runs_dir / "make_table.log"
    log.write_text("output of the first attempt\n")
    os.utime(log, (started + 60, started + 60))       # ... and wrote its last line a minute later
    for d in plan.run_dirs:
        write_run(d, status="completed", steps=5)
    monkeypatch.setattr(launch, "run_logged", lambda cmd, log, env: 0)
    monkeypatch.setattr(launch, "sft_controls", lambda *a, **k: None)
    header: dict = {}
    rc, wall_s = launch.run_table(plan, 2, header, [], record, "python scripts/make_table.py tiny")
    assert rc == 0
    first, again = record["attempts"]
    assert first["ended_ts"] == pytest.approx(started + 60)
    assert 60 <= wall_s < 60 + 30                     # the minute it ran and this attempt's few seconds
    assert "wall time 1.0 min for 2 jobs over 2 attempts" in header["date"]
    meta = json.loads((plan.runs_dir / "table_meta.json").read_text())
    assert meta["wall_time_s"] == pytest.approx(wall_s) and meta["attempts"][1]["ended_ts"] >= again["started_ts"]
