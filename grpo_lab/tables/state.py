"""Where a table stands, read from disk alone: each run's state, who owns a run, the launch in progress.

A table's launch can be stopped at any moment (SIGKILL of its process tree, the machine switched off),
so nothing here trusts memory of a previous process. Each run's state is decided from its directory:

    done         summary.json says "completed"
    running      owner.json names a process that is alive now (same machine, same boot, same start time)
    failed       summary.json says "failed" with an error of its own (not a signal): kept, not re-run
    interrupted  a checkpoint, metrics.jsonl or a summary saying a signal stopped it, and no live owner;
                 relaunched with trainer.resume=auto, which continues from the newest checkpoint
    to do        no directory, or one without a record of the run (Hydra made it, the trainer never started)

owner.json is written by `RunOwner`, a Hydra callback every table job runs with, when the job starts,
and removed when it ends; the SFT controls start through `owned_command`, which writes it.
<runs dir>/table_launch.json is the launch in progress: its jobs, their directories, its attempts. It
exists from before the first job starts until the table is built, so a re-run of the same command
finds it and continues the launch instead of starting another.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import socket
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback

OWNER_FILE = "owner.json"
LAUNCH_FILE = "table_launch.json"
DONE, RUNNING, INTERRUPTED, FAILED, TODO = "done", "running", "interrupted", "failed", "to do"
STATES = (DONE, RUNNING, INTERRUPTED, FAILED, TODO)
# The errors a run records when a signal ends it (launch.py has SIGTERM raise SystemExit(143): run_guard).
SIGNAL_ERRORS = ("SystemExit", "KeyboardInterrupt")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of process `pid` from /proc/<pid>/stat (fields 3 and 22; the start in clock
    ticks since boot), or None where there is no /proc entry."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, so that a pid the system gave to another process later is not taken
    for the owner."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def process_identity(pid: int | None = None) -> dict:
    """What identifies a live process across machines and reboots: pid, host, boot id, start time."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start_ticks": _start_ticks(pid),
            "started": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def alive(identity: dict | None) -> bool:
    """Whether the process `identity` names is running now. Another host's process cannot be checked
    from here and counts as alive (a Slurm job's owner); a reboot or a reused pid counts as dead."""
    if not identity or not identity.get("pid"):
        return False
    if identity.get("host") != socket.gethostname():
        return True
    if identity.get("boot_id") and identity["boot_id"] != _boot_id():
        return False
    try:
        os.kill(int(identity["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it exists
        pass
    stat = _proc_stat(int(identity["pid"]))
    if stat is None:
        return True   # no /proc to look closer: os.kill found it
    # A killed process whose parent died stays a zombie until something reaps it (a container's first
    # process may never): it exists for os.kill, but it runs nothing.
    recorded = identity.get("start_ticks")
    return stat[0] not in ("Z", "X") and (recorded is None or stat[1] == recorded)


def write_owner(run_dir: Path, pid: int | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OWNER_FILE).write_text(json.dumps(process_identity(pid)))


def owned_command(run_dir: Path) -> list[str]:
    """The prefix that runs a command as the owner of `run_dir`: this module writes owner.json with its
    own pid, then becomes the command (exec keeps the pid and its start time)."""
    return [sys.executable, "-m", "grpo_lab.tables.state", str(run_dir)]


class RunOwner(Callback):
    """Hydra callback (`hydra.callbacks.run_owner`): owner.json in the job's directory while it runs."""

    def on_job_start(self, config, **kwargs) -> None:
        write_owner(Path(config.hydra.runtime.output_dir))

    def on_job_end(self, config, job_return=None, **kwargs) -> None:
        (Path(config.hydra.runtime.output_dir) / OWNER_FILE).unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _metrics(run_dir: Path) -> list[dict]:
    out = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue   # a line cut by the kill
    return out


def compute_time_s(metrics: list[dict]) -> float:
    """A run's own compute: the sum of its step times. A resumed run's metrics.jsonl holds each step
    once (the lines after its checkpoint are cut before it continues), so no step counts twice."""
    return math.fsum(m["perf/step_time_s"] for m in metrics if isinstance(m.get("perf/step_time_s"), (int, float)))


def mean_host_load(metrics: list[dict]) -> float | None:
    """The machine's mean 1-minute load average over a run's steps (None: not logged): near the number
    of cores the run keeps busy when it ran alone, higher when other jobs shared the machine."""
    loads = [m["perf/host_load_1m"] for m in metrics if isinstance(m.get("perf/host_load_1m"), (int, float))]
    return statistics.fmean(loads) if loads else None


def planned_steps(run_dir: Path) -> int | None:
    """Steps the run's config asks for: trainer.total_steps, or fewer when trainer.total_samples binds
    first at prompts_per_step x group_size samples a step."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    t, r = cfg.get("trainer") or {}, cfg.get("rollout") or {}
    steps = t.get("total_steps")
    per_step = (t.get("prompts_per_step") or 0) * (r.get("group_size") or 0)
    if t.get("total_samples") and per_step:
        by_samples = math.ceil(t["total_samples"] / per_step)
        steps = by_samples if steps is None else min(steps, by_samples)
    return steps


@dataclass
class RunState:
    path: Path
    state: str
    steps_done: int = 0              # steps in metrics.jsonl
    resumable_step: int | None = None   # the newest checkpoint's step: where a resume continues
    steps: int | None = None         # steps planned
    wall_time_s: float | None = None  # summary.json: the time the run ran, over every attempt
    compute_time_s: float = 0.0
    step_times: tuple[float, ...] = ()
    owner: dict | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.path.name


def run_state(run_dir: Path) -> RunState:
    """The state of one run directory (see the module docstring), with its progress and times."""
    from grpo_lab.checkpoint import checkpoints

    run_dir = Path(run_dir)
    summary = _read_json(run_dir / "summary.json")
    owner = _read_json(run_dir / OWNER_FILE)
    metrics = _metrics(run_dir)
    found = checkpoints(run_dir) if run_dir.is_dir() else []
    step_times = tuple(m["perf/step_time_s"] for m in metrics if isinstance(m.get("perf/step_time_s"), (int, float)))
    error = (summary or {}).get("error")
    if summary and summary.get("status") == "completed":
        state = DONE
    elif alive(owner):
        state = RUNNING
    elif summary and not str(error or "").startswith(SIGNAL_ERRORS):
        state = FAILED
    elif found or metrics or summary:
        state = INTERRUPTED
    else:
        state = TODO
    return RunState(run_dir, state, steps_done=max((int(m.get("step", 0)) for m in metrics if "perf/step_time_s" in m),
                                                   default=0),
                    resumable_step=int(found[-1].name.split("_")[1]) if found else None,
                    steps=(summary or {}).get("steps") if state == DONE else planned_steps(run_dir),
                    wall_time_s=(summary or {}).get("wall_time_s"), compute_time_s=math.fsum(step_times),
                    step_times=step_times, owner=owner if state == RUNNING else None, error=error)


def read_launch(runs_dir: Path) -> dict | None:
    """The launch in progress in `runs_dir` (table_launch.json), or None."""
    return _read_json(Path(runs_dir) / LAUNCH_FILE)


def write_launch(runs_dir: Path, record: dict) -> None:
    path = Path(runs_dir) / LAUNCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)   # a kill while writing leaves the previous record, never half of one


def finish_launch(runs_dir: Path) -> None:
    (Path(runs_dir) / LAUNCH_FILE).unlink(missing_ok=True)


def planned_runs(record: dict, runs_dir: Path) -> list[Path]:
    """Every run directory a launch record plans: its jobs', then its SFT controls'."""
    return [Path(runs_dir) / j["dir"] for j in record.get("jobs", [])] + [
        Path(runs_dir) / d for d in record.get("sft_controls", [])]


def time_left_s(states: list[RunState]) -> dict[Path, float | None]:
    """Estimated seconds each run still needs: a finished run none; one that has not started the
    median wall time of the finished runs (else its steps at the median step time); an interrupted
    or running one the median step time times the steps left (from its checkpoint when interrupted,
    whose later steps are redone), plus what finished runs spent outside steps (start-up, evaluation)."""
    done = [s for s in states if s.state == DONE and s.wall_time_s is not None]
    all_steps = [t for s in states for t in s.step_times]
    step_time = statistics.median(all_steps) if all_steps else None
    overhead = statistics.median([max(0.0, s.wall_time_s - s.compute_time_s) for s in done]) if done else 0.0
    known_steps = [s.steps for s in states if s.steps]
    out: dict[Path, float | None] = {}
    for s in states:
        steps = s.steps or (statistics.median(known_steps) if known_steps else None)
        if s.state in (DONE, FAILED):
            out[s.path] = 0.0
        elif s.state == TODO and done:
            out[s.path] = statistics.median(s.wall_time_s for s in done)
        elif step_time is None or steps is None:
            out[s.path] = None
        else:
            start = s.steps_done if s.state == RUNNING else (s.resumable_step or 0)
            mine = statistics.median(s.step_times) if s.step_times else step_time
            out[s.path] = max(0.0, steps - start) * mine + (0.0 if s.state == RUNNING else overhead)
    return out


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def status_text(runs_dir: Path, name: str, planned_jobs: int) -> str:
    """What `make table-status` prints: one line per run (state, steps, wall and compute time, time
    left), then the counts and the time left at the launch's parallelism. The runs are those of the
    launch in progress (its record), else those on disk (a finished table)."""
    from grpo_lab.report.runs import find_run_dirs

    runs_dir = Path(runs_dir)
    record = read_launch(runs_dir)
    if record:
        dirs = planned_runs(record, runs_dir)
        last = (record.get("attempts") or [None])[-1]
        launcher = ("launcher alive: pid " + str(last["pid"]) if alive(last) else
                    f"stopped: run `{record['invocation']}` again to continue it")
        head = f"table {name}: launch of {record['date']} ({len(record.get('attempts', []))} attempt(s)), {launcher}"
    elif (runs_dir / "table_meta.json").exists():
        dirs = [d for d in find_run_dirs([runs_dir]) if "_archive" not in d.parts]
        head = f"table {name}: finished launch ({runs_dir / 'table_meta.json'})"
    else:
        return f"table {name}: not launched ({runs_dir} holds no launch); {planned_jobs} jobs to do"
    states = [run_state(d) for d in dirs]
    left = time_left_s(states)
    width = max([len(d.relative_to(runs_dir).as_posix()) for d in dirs] + [3])
    lines = [head, f"  {'run':{width}}  {'state':11}  {'steps':>9}  {'wall':>9}  {'compute':>9}  {'left':>9}"]
    for s in states:
        steps = f"{s.steps_done}/{s.steps if s.steps is not None else '?'}"
        wall = _minutes(s.wall_time_s) if s.state in (DONE, FAILED) else "–"
        compute = _minutes(s.compute_time_s) if s.step_times else "–"
        rest = "–" if s.state in (DONE, FAILED) else _minutes(left[s.path])
        extra = f"  pid {s.owner['pid']}" if s.owner else (f"  resumes at step {s.resumable_step}"
                                                            if s.state == INTERRUPTED and s.resumable_step else "")
        lines.append(f"  {s.path.relative_to(runs_dir).as_posix():{width}}  {s.state:11}  {steps:>9}  {wall:>9}  "
                     f"{compute:>9}  {rest:>9}{extra}")
    counts = ", ".join(f"{k} {sum(s.state == k for s in states)}" for k in STATES)
    parallel = max(1, int((record or {}).get("parallel_jobs") or 1))
    unknown = [p for p, v in left.items() if v is None]
    total = math.fsum(v for v in left.values() if v is not None) / parallel
    lines.append(f"  {counts}; time left ≈ {_minutes(total)}"
                 + (f" at {parallel} jobs at once" if parallel > 1 else "")
                 + (f" (+ {len(unknown)} runs without an estimate yet)" if unknown else ""))
    return "\n".join(lines)


if __name__ == "__main__":   # owned_command: python -m grpo_lab.tables.state <run dir> <command...>
    write_owner(Path(sys.argv[1]))
    os.execv(sys.argv[2], sys.argv[2:])
