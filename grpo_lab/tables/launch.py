"""Running a table: the multirun and the SFT controls, logged to one file; continuing a stopped launch
(grpo_lab/tables/state.py decides each run's state from disk); the machine description for the
header; what to tell the reader about jobs that died before writing anything."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grpo_lab.tables import state
from grpo_lab.tables.plan import OWNER_CALLBACK, RESUME_KEYS, Plan, merge_overrides
from grpo_lab.tables.spec import ROOT, VARIANT_GROUP, override_key, overrides_parser


def machine_description() -> str:
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    cpu, ram = platform.processor() or platform.machine(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = int(line.split()[1]) / 2**20
                break
    except OSError:
        pass
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20).stdout.strip().splitlines()
            gpu = f"{len(names)}× {names[0]}" if names else gpu
        except (OSError, subprocess.SubprocessError):
            pass
    ram_txt = f"{ram:.0f} GiB RAM" if ram else "RAM unknown"
    return (f"{cores} CPU cores ({usable} usable), {ram_txt}, {cpu}, {gpu}; {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


def archive_previous(runs_dir: Path) -> Path | None:
    """Move an earlier run of this table aside (outputs/.../_archive/<name>-<time>) so rows never mix."""
    if not runs_dir.exists() or not any(runs_dir.iterdir()):
        return None
    stamp = dt.datetime.fromtimestamp(runs_dir.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
    dest = runs_dir.parent / "_archive" / f"{runs_dir.name}-{stamp}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(runs_dir), str(dest))
    return dest


def seeds_on_disk(runs_dir: Path) -> set[int]:
    """Seeds of the runs a table's runs directory already holds (completed or not)."""
    from grpo_lab.report import NoRunsFound, load_runs

    try:
        return {r.seed for r in load_runs([runs_dir])}
    except NoRunsFound:
        return set()


def jobs_but_seeds(command: list[str]) -> list[str]:
    """A multirun command without the parts that may differ between two launches of the same table's jobs
    (the interpreter, seeds, the wandb group's time stamp, how jobs are launched, and the paths of the
    table's own directory, which a launch restored in another checkout names differently, an added
    launch's run directories, Plan.name_runs_apart, and how a job survives a stop, RESUME_KEYS and
    OWNER_CALLBACK, which launches before them lack, and warmup.replay_steps, which an added row sets to start
    as the recorded rows did): equal for launches whose rows may merge."""
    return [c for c in command[1:] if not c.startswith(("seed=", "logger.group=", "hydra/launcher=", "hydra.launcher.",
                                                        "hydra.sweep.dir=", "hydra.sweep.subdir=",
                                                        "hydra.searchpath=", OWNER_CALLBACK.split("=")[0],
                                                        "warmup.replay_steps=", *(f"{k}=" for k in RESUME_KEYS)))]


def launches(meta: dict) -> list[dict]:
    """Every launch a table's table_meta.json records: the first, then each added one (--add-seeds, --add-rows)."""
    return [meta, *meta.get("added_launches", [])]


def single_valued_overrides(command: list[str]) -> dict[str, str]:
    """key -> value of a multirun command's overrides that give their key one value (not a comma list
    or sweep function), past what `jobs_but_seeds` drops. Hydra's parser decides, so `k=[1,2]` (one
    list value) counts and `k=1,2` does not."""
    items = [c for c in jobs_but_seeds(command) if "=" in c and not c.startswith("hydra.")]
    parsed = overrides_parser().parse_overrides(items)
    return {override_key(o.get_key_element()): o.get_value_element_as_str() for o in parsed
            if not o.is_sweep_override()}


def swept_values(command: list[str]) -> dict[str, frozenset[str]]:
    """key -> the values a multirun command runs it at (one for a single value, every value of a comma
    list or sweep function), past what `jobs_but_seeds` drops; an item without `=` is its own key and value."""
    items = jobs_but_seeds(command)
    out = {c: frozenset([c]) for c in items if "=" not in c}
    for o in overrides_parser().parse_overrides([c for c in items if "=" in c]):
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        out[override_key(o.get_key_element())] = frozenset(values)
    return out


def jobs_within(command: list[str], earlier: list[str]) -> bool:
    """Whether every job of `command` is, seeds aside, a job of `earlier`: the same keys, each run at
    values `earlier` ran it at (`--variants grpo` after all of them: more seeds of some rows)."""
    new, old = swept_values(command), swept_values(earlier)
    return new.keys() == old.keys() and all(new[k] <= old[k] for k in new)


def jobs_overlap(command: list[str], earlier: list[str]) -> bool:
    """Whether some job of `command` is, seeds aside, also a job of `earlier`."""
    new, old = swept_values(command), swept_values(earlier)
    return new.keys() == old.keys() and all(new[k] & old[k] for k in new)


def repeated_jobs_problem(earlier: list[list[str]], command: list[str]) -> str | None:
    """Why a launch's jobs might repeat jobs of an earlier launch of the same table, or None.

    Jobs of two launches are disjoint when some key has one value in each and the values differ
    (`-- algorithm.epochs=4` after `-- algorithm.epochs=1`): then no job can be in both, whatever
    the seeds. Anything less (a new key, a wider list) could run a row's seed twice."""
    new = single_valued_overrides(command)
    for cmd in earlier:
        old = single_valued_overrides(cmd)
        if not any(k in old and old[k] != v for k, v in new.items()):
            return shlex.join(cmd)
    return None


def merge_added_launch(previous: dict, added: dict, invocation: str, what: str, inherited: list[str] = ()) -> dict:
    """table_meta.json after `--add-seeds` or `--add-rows` (`what` the launch added, e.g. "seeds 3,4"): the
    first launch's command, machine and date stay the table's; the added launch becomes a launch note
    with its own date, wall time and exit status, and its date and wall time join the header's date line.
    `inherited`: notes the launch repeats from the plan (warnings about the shared `--` overrides), left
    out when the table already has them; every note of its own stays, even one worded as an earlier
    launch's (its jobs failed too, or its SFT control was skipped too)."""
    merged = dict(previous)
    # Seeds run on another machine pair only among themselves (every row of a seed is in one launch),
    # but per-run numbers differ across machines (fp32 kernels): the note names the machine.
    where = f" on {added['machine']}" if added.get("machine") and added["machine"] != previous.get("machine") else ""
    note = f"{what} added by `{invocation}` on {added['date']}{where} (exit {added['exit_code']})"
    repeated = set(previous.get("launch_notes", [])) & set(inherited)
    merged["launch_notes"] = previous.get("launch_notes", []) + [note] + [
        n for n in added.get("launch_notes", []) if n not in repeated]
    merged["date"] = f"{previous['date']}; {what} added {added['date']}"
    merged["added_launches"] = previous.get("added_launches", []) + [added]
    return merged


def run_logged(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """Run `cmd`, streaming its output to the console and to `log`."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **env}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(("$ " + shlex.join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            # Flushed as it comes: the log is what `tail -f` shows and, when the launch is killed, the
            # time of its last write is where the stopped attempt ended (end_stopped_attempts).
            f.write(chunk)
            f.flush()
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return proc.wait()


# Config groups a warm-up checkpoint is built from (train.build_policy: cache_key(model, task, warmup, ...,
# seed)): a table that sweeps one of them needs one warm-up per value and seed.
WARMUP_INPUTS = ("model", "task", "warmup")


def prewarm_overrides(plan: Plan) -> list[str]:
    """The prewarm multirun's overrides: the table's fixed ones, one job per seed and per value of every
    swept key a warm-up depends on (a task sweep: one warm-up per task and seed), no RL steps."""
    swept = [f"{k}={v}" for k, v in plan.sweep.items()
             if override_key(k).split(".")[0] in WARMUP_INPUTS and override_key(k) not in
             {override_key(o) for o in plan.base}]
    return [*merge_overrides(plan.base, ["trainer.total_steps=0", "trainer.total_samples=null", "rollout=hf",
                                         "logger=none", "trainer.save_checkpoint=false"]),
            *swept, "seed=" + ",".join(str(s) for s in plan.seeds)]


def prewarm(plan: Plan, log: Path, attempt: int = 1) -> int:
    """Fill the warm-up cache before the table's parallel jobs start, so that two jobs of one seed (two
    variants) never wait on each other's warm-up. Each prewarm job builds a different entry (a seed, a
    task), so they run with the table's own launcher and parallelism."""
    # One directory per launch (the plan's time-stamped group) and attempt of it: a relaunch of the
    # same seeds would find its job directories holding the last launch's metrics, and the trainer
    # refuses to mix two runs.
    where = plan.runs_dir.parent / "_prewarm" / plan.spec.name / (plan.group + (f"-{attempt}" if attempt > 1 else ""))
    cmd = [sys.executable, "-m", "grpo_lab.train", "-m", *prewarm_overrides(plan), f"hydra.sweep.dir={where}",
           *plan.launcher]
    return run_logged(cmd, log, plan.env)


def runs_of(runs: list, variant: str, block: list[str] = ()) -> list:
    """The runs of `variant` in `block` (e.g. ["task=gcd"]; [] = every run), completed or not."""
    return [r for r in runs if r.override_map.get(VARIANT_GROUP) == variant
            and all(r.override_map.get(override_key(o)) == o.split("=", 1)[1] for o in block)]


def matched_wall_time(runs: list, variant: str, block: list[str] = ()) -> tuple[float | None, list[int]]:
    """(mean, seeds): the mean over the variant's completed runs of `block` of the time spent in RL steps
    (sum of perf/step_time_s), the compute the SFT control gets, and the seeds of the runs it is the mean
    of. Evaluation and engine start-up are excluded on both sides. A run restored from the table's record
    has no step times, so runs of this machine set the budget of the controls that run on it."""
    totals, seeds = [], []
    for r in runs_of(runs, variant, block):
        steps = [row["perf/step_time_s"] for row in r.metrics if row.get("perf/step_time_s") is not None]
        if r.ok and steps:
            totals.append(math.fsum(steps))
            seeds.append(r.seed)
    return (math.fsum(totals) / len(totals) if totals else None), sorted(seeds)


def parallel_jobs(plan: Plan) -> int:
    """How many of the table's jobs run at once (joblib's n_jobs; 1 for the other launchers)."""
    for o in plan.launcher:
        if override_key(o) == "hydra.launcher.n_jobs":
            return max(1, int(o.split("=", 1)[1]))
    return 1


def sft_control_runs(plan: Plan, block: list[str] = (), seeds: list[int] | None = None) -> list[tuple[int, Path]]:
    """(seed, run dir) of each seed's SFT control in `block` (seeds: the plan's unless given): the
    directory on disk when there is one (seeds added later are numbered from 0 again,
    "0_sft_control_s3"), else where it will go."""
    tag = "".join(f"_{o.split('=', 1)[1]}" for o in block)
    root = plan.runs_dir / "sft_control"
    out = []
    for i, seed in enumerate(plan.seeds if seeds is None else seeds):
        found = sorted(root.glob(f"*_sft_control{tag}_s{seed}"))
        out.append((seed, found[0] if found else root / f"{i}_sft_control{tag}_s{seed}"))
    return out


def completed(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "completed"
    except (OSError, ValueError):
        return False


def run_sft_controls(plan: Plan, log: Path, wall_time: float, block: list[str] = (),
                     only_missing: bool = False, seeds: list[int] | None = None) -> dict[int, int]:
    """One SFT control per seed, as many at once as the RL jobs ran (same threads per process: the
    plan's OMP_NUM_THREADS), each trained for `wall_time` seconds. only_missing: just the seeds without
    a completed control; a stopped one's directory is moved to outputs/.../_archive first (nothing is
    deleted, and its lines never mix with the new run's). Returns {seed: exit code}."""
    from concurrent.futures import ThreadPoolExecutor

    sft = plan.spec.sft_control
    assert sft is not None
    # Spelled as Hydra's sweeper records a job's overrides (.hydra/overrides.yaml: `false` -> `False`),
    # so the control's recorded overrides match the RL runs' and only `variant` tells them apart.
    parser = overrides_parser()
    base = []
    for o in plan.base:
        if not override_key(o).startswith("hydra"):
            ov = parser.parse_override(o)
            base.append(f"{ov.get_key_element()}={ov.get_value_element_as_str()}")
    runs = [(seed, d) for seed, d in sft_control_runs(plan, block, seeds) if not (only_missing and completed(d))]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    cmds = []
    for seed, run_dir in runs:
        if run_dir.exists():
            dest = plan.runs_dir.parent / "_archive" / f"{plan.runs_dir.name}-sft-{stamp}" / run_dir.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(run_dir), str(dest))
        overrides = [f"+{VARIANT_GROUP}=sft_control", *base, *block, f"seed={seed}", f"logger.group={plan.group}"]
        # owned_command: owner.json names the control's process while it runs (make table-status).
        cmds.append([*state.owned_command(run_dir), sys.executable, "-m", "grpo_lab.tables.sft_control",
                     "--wall-time", f"{wall_time:.3f}", "--evals", str(sft.evals), "--run-dir", str(run_dir), "--",
                     *overrides])
    with ThreadPoolExecutor(max_workers=parallel_jobs(plan)) as pool:
        codes = list(pool.map(lambda cmd: run_logged(cmd, log, plan.env), cmds))
    return {seed: code for (seed, _), code in zip(runs, codes)}


def sft_controls(plan: Plan, log: Path, launch_notes: list[str], only_missing: bool = False) -> None:
    """The SFT control of every block for the plan's seeds (only_missing: for the seeds of the block's
    matched runs, those without a completed control), trained for the mean RL step time of the block's
    matched runs; what ran (or why not) goes into `launch_notes`."""
    from grpo_lab.report import NoRunsFound, load_runs

    spec = plan.spec
    if spec.sft_control is None:
        return
    match = spec.sft_control.match
    try:
        runs = load_runs([plan.runs_dir])
    except NoRunsFound:
        runs = []
    for block in plan.blocks():
        where = f" of {' '.join(block)}" if block else ""
        # --sft-only: each block's own seeds (the tasks table's basic_arithmetic has 0-4, the others 0-2),
        # not every seed on disk, or a block would get controls for seeds none of its rows ran.
        seeds = sorted({r.seed for r in runs_of(runs, match, block)}) if only_missing else None
        if only_missing and all(completed(d) for _, d in sft_control_runs(plan, block, seeds)):
            continue   # every control of this block is there
        wall, timed = matched_wall_time(runs, match, block)
        how = (f"mean summed RL step time of the completed `{match}` runs{where} that ran on this machine, "
               f"seeds {','.join(map(str, timed))}")
        if spec.sft_control.wall_time_s is not None:
            wall, how = spec.sft_control.wall_time_s, "sft_control.wall_time_s in the table yaml"
        if wall is None:
            launch_notes.append(f"SFT control{where} skipped: no completed `{match}` run with step times to match "
                                "(runs restored from the table's record carry none; run the block's seeds here first).")
            continue
        codes = run_sft_controls(plan, log, wall, block, only_missing=only_missing, seeds=seeds)
        if codes or not only_missing:
            launch_notes.append(f"SFT control{where}: {wall:.1f} s of training per seed ({how}); exit codes "
                                + ", ".join(f"seed {s}: {c}" for s, c in codes.items()) + ".")


def unrecorded_jobs(runs_dir: Path) -> list[Path]:
    """Job dirs Hydra created whose trainer never wrote metrics or a summary (died before it started)."""
    out = []
    for hydra_dir in sorted(runs_dir.rglob(".hydra")):
        job = hydra_dir.parent
        if not (job / "summary.json").exists() and not (job / "metrics.jsonl").exists() and job != runs_dir:
            out.append(job)
    return out



def new_launch(plan: Plan, invocation: str, added_what: str | None = None, previous_meta: dict | None = None) -> dict:
    """The record of a launch about to start (grpo_lab/tables/state.py): what it runs, where each run
    goes, and its attempts; for a launch adding to a table (--add-seeds, --add-rows) what it adds and
    the table_meta.json it adds to. Needs `plan.run_dirs` (preflight)."""
    sft = [d.relative_to(plan.runs_dir).as_posix() for block in plan.blocks()
           for _, d in sft_control_runs(plan, block)] if plan.spec.sft_control else []
    return {"invocation": invocation, "command": plan.command, "group": plan.group, "stamp": plan.stamp,
            "run_dir_prefix": plan.run_dir_prefix, "seeds": plan.seeds, "added_what": added_what,
            "date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "parallel_jobs": parallel_jobs(plan),
            "jobs": [{"overrides": [*job, f"logger.group={plan.group}"], "dir": d.relative_to(plan.runs_dir).as_posix()}
                     for job, d in zip(plan.jobs(), plan.run_dirs)],
            "sft_controls": sft, "variants": variant_contents(plan), "previous_meta": previous_meta, "attempts": []}


def variant_contents(plan: Plan) -> dict[str, list[str]]:
    """Each variant's overrides: what its config file holds, which the multirun command only names."""
    return {v.name: overrides for v, overrides in plan.variants}


def same_launch(record: dict, plan: Plan, added: bool) -> bool:
    """Whether `plan` runs the jobs of the stopped launch `record` (how they are launched aside), its
    variants' overrides included (an edited table yaml makes other jobs); `added`: the plan adds to a
    table (--add-seeds, --add-rows), as the stopped launch must have."""
    return (jobs_but_seeds(record["command"]) == jobs_but_seeds(plan.command) and record["seeds"] == plan.seeds
            and record.get("variants") == variant_contents(plan) and bool(record.get("run_dir_prefix")) == added)


def job_command(plan: Plan, job: dict) -> list[str]:
    """One job of a launch as a multirun of its own, into the directory the launch gave it: recorded as
    the launch's multirun records it (the same overrides, sweep directory and run name)."""
    cmd = [sys.executable, "-m", "grpo_lab.train", "-m"]
    if plan.variants:
        cmd.append(plan.searchpath_override())
    # joblib's workers would add nothing to one job; a cluster launcher still sends it to the cluster.
    launcher = [o for o in plan.launcher if "submitit" in o or override_key(o).startswith("hydra.launcher.")] \
        if any("submitit" in o for o in plan.launcher) else []
    return [*cmd, *job["overrides"], f"hydra.sweep.dir={plan.runs_dir}", f"hydra.sweep.subdir={job['dir']}",
            OWNER_CALLBACK, *launcher]


def move_partial(run_dir: Path, plan: Plan, stamp: str) -> Path:
    """Move a run stopped before its first checkpoint to outputs/.../_archive (it starts over; nothing is
    deleted, and its lines never mix with the new attempt's)."""
    archive = plan.runs_dir.parent / "_archive" / f"{plan.runs_dir.name}-partial-{stamp}"
    dest = archive / run_dir.relative_to(plan.runs_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(dest))
    return dest


def continue_jobs(plan: Plan, record: dict, log: Path, launch_notes: list[str]) -> int:
    """The jobs of a stopped launch that did not finish: an interrupted run continues from its newest
    checkpoint (trainer.resume=auto), one stopped before its first checkpoint starts over, one never
    started starts; finished and failed runs are kept as they are. As many at once as the launch ran.
    Returns the highest exit status (0: every job it ran completed)."""
    from concurrent.futures import ThreadPoolExecutor

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    counts = dict.fromkeys(("kept", "failed", "resumed", "restarted", "started"), 0)
    todo = []
    for job in record["jobs"]:
        run = state.run_state(plan.runs_dir / job["dir"])
        if run.state in (state.DONE, state.FAILED):
            counts["kept" if run.state == state.DONE else "failed"] += 1
            continue
        if run.state == state.RUNNING:   # make_table checks before; a run must never have two processes
            raise RuntimeError(f"{run.path} is still running (pid {run.owner['pid']}); wait for it or stop it")
        if run.state == state.INTERRUPTED and run.resumable_step is None:
            move_partial(run.path, plan, stamp)
            counts["restarted"] += 1
        else:
            counts["resumed" if run.state == state.INTERRUPTED else "started"] += 1
        todo.append(job_command(plan, job))
    if todo and any(o in plan.launcher for o in ("hydra/launcher=joblib", "hydra/launcher=submitit_local")):
        prewarm(plan, log, attempt=len(record["attempts"]))
    with ThreadPoolExecutor(max_workers=max(1, parallel_jobs(plan))) as pool:
        codes = list(pool.map(lambda cmd: run_logged(cmd, log, plan.env), todo))
    attempt = record["attempts"][-1]
    launch_notes.append(
        f"attempt {len(record['attempts'])} (`{attempt['invocation']}`, {attempt['started'][:16].replace('T', ' ')}) "
        f"continued the stopped launch: {counts['kept']} finished runs kept, {counts['resumed']} resumed from "
        f"their newest checkpoint, {counts['restarted']} started over"
        + (f" (stopped before their first checkpoint; moved to _archive/{plan.runs_dir.name}-partial-{stamp})"
           if counts["restarted"] else "") + f", {counts['started']} started"
        + (f"; {counts['failed']} failed runs kept (move a directory away to run it again)" if counts["failed"] else "")
        + (f"; exit codes {sorted(set(codes))}" if any(codes) else ""))
    return max(codes, default=0)


def end_stopped_attempts(record: dict, log: Path) -> None:
    """Give each attempt that was stopped (killed, machine off) its end: its last output to the log. Called
    as a stopped launch continues, before the new attempt writes to the log, so the time the table waited
    for its re-run does not count as its wall time."""
    for attempt in record["attempts"]:
        attempt.setdefault("ended_ts", max(attempt["started_ts"], _mtime(log)))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def run_table(plan: Plan, n_jobs: int, header: dict, launch_notes: list[str], record: dict,
              invocation: str = "") -> tuple[int, float]:
    """Run the multirun (after filling the warm-up cache, for parallel launchers), then the SFT
    controls; add what the reader must know to `launch_notes`, the date and wall time to `header`, and
    write both to <runs dir>/table_meta.json (read back by --report-only).
    `record`: the launch (`new_launch`), or the stopped launch this one continues: then only what did
    not finish runs (`continue_jobs`). make_table removes the record once the table is built.
    Returns the multirun's exit status and the wall time in seconds."""
    spec = plan.spec
    log = plan.runs_dir / "make_table.log"
    fresh = not record["attempts"]
    if not fresh:
        end_stopped_attempts(record, log)
    record["attempts"].append({**state.process_identity(), "invocation": invocation, "started_ts": time.time()})
    state.write_launch(plan.runs_dir, record)
    if not fresh:
        rc = continue_jobs(plan, record, log, launch_notes)
    else:
        if any(o in plan.launcher for o in ("hydra/launcher=joblib", "hydra/launcher=submitit_local")):
            t0 = time.time()
            rc = prewarm(plan, log)
            launch_notes.append(f"warm-up cache filled before the parallel launch, one job per seed and warm-up "
                                f"input ({time.time() - t0:.0f} s, exit {rc})")
        rc = run_logged(plan.command, log, plan.env)
    if rc != 0:
        launch_notes.append(f"the multirun exited with status {rc}: at least one job failed; every job of the "
                            "batch still ran (Hydra's launchers run the whole batch, then re-raise the first "
                            "failure). Failed runs are counted in each row and listed below.")
    sft_controls(plan, log, launch_notes, only_missing=not fresh)
    for job in unrecorded_jobs(plan.runs_dir):
        launch_notes.append(f"job `{job.relative_to(plan.runs_dir)}` failed before the trainer wrote "
                            f"metrics.jsonl/summary.json (see {log.name} and the job's .hydra/ and *.log).")
    record["attempts"][-1]["ended_ts"] = time.time()
    wall_s = sum(a["ended_ts"] - a["started_ts"] for a in record["attempts"])
    tries = len(record["attempts"])
    header["date"] = f"{record['date']}; wall time {wall_s / 60:.1f} min for {n_jobs} jobs" + (
        f" + {len(plan.seeds) * len(plan.blocks())} SFT controls" if spec.sft_control else "") + (
        f" over {tries} attempts (stopped and continued)" if tries > 1 else "")
    (plan.runs_dir / "table_meta.json").write_text(json.dumps(
        {**header, "launch_notes": launch_notes, "wall_time_s": wall_s, "jobs": n_jobs, "exit_code": rc,
         "launch_command": plan.command, "seeds": plan.seeds, "checkout": str(ROOT),
         "attempts": [{k: a[k] for k in ("invocation", "started", "started_ts", "ended_ts")}
                      for a in record["attempts"]]},
        indent=2))
    return rc, wall_s
