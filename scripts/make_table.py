#!/usr/bin/env python
"""Make one paper table: conf/table/<name>.yaml -> one Hydra multirun -> tables/<name>.md|csv|png.

    python scripts/make_table.py group_size             # the lab-scale table (long: see the yaml)
    SMOKE=1 python scripts/make_table.py group_size     # same pipeline: one seed, two steps, tiny warm-up
    LAUNCHER=joblib JOBS=2 python scripts/make_table.py clip   # jobs in parallel (hydra/launcher=joblib)
    python scripts/make_table.py dapo --report-only     # rebuild the table from the runs on disk
    python scripts/make_table.py std_norm --add-seeds 3,4   # more seeds into the same table (same extras)
    python scripts/make_table.py clip --add-rows -- algorithm.epochs=4   # rows a first launch's extras left out
    python scripts/make_table.py tasks --sft-only       # run the SFT controls a launch did not complete
    python scripts/make_table.py dapo --dry-run         # print the command, launch nothing
    python scripts/make_table.py dapo --status          # each run: done / running / interrupted / to do, time left
    python scripts/make_table.py dapo --scale full      # the paper-scale recipe (conf/experiment/...)
    python scripts/make_table.py dapo -- cache_dir=/tmp/c   # extra overrides for every job

One `python -m grpo_lab.train -m ...` multirun per table into `hydra.sweep.dir=outputs/tables/<name>`
(SMOKE: outputs/smoke/runs/<name>); sweeps are Hydra's comma lists, variants one config file each
swept as `+variant=a,b,c` (grpo_lab/tables/plan.py). Before launching, every job's config is composed
and checked with grpo_lab.config.validate, so a bad value fails here in seconds and not as a table of
failed runs. A job that fails does not stop the batch (Hydra's launchers run all of it, then exit
non-zero); the table is built anyway and counts and lists failed runs, and jobs that died before
writing anything.

A launch that was stopped (killed, the machine switched off) continues when the same command runs
again: finished runs are kept, interrupted ones resume from their newest checkpoint (every job runs
with trainer.resume=auto and the table's `checkpoint_every`), the others start; each run's state is
read from its directory (grpo_lab/tables/state.py), and `--status` prints it. A launch of other jobs,
or one after the table was built, moves the earlier runs aside. The header states the command, the
machine, the date and the wall time (summed over a stopped launch's attempts), what the paper found
and what we found, computed from the runs (grpo_lab/tables/findings.py).
This file is the command line only; the library is grpo_lab/tables/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

# This checkout's package ahead of the environment's editable install (which names one checkout): a table
# launched from a second worktree, kept as a snapshot while the first is edited, must run that worktree's
# code, and its jobs (started in the package's root) too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_lab.tables import TableSpecError, load_spec, make_plan, preflight, state
from grpo_lab.tables.findings import build
from grpo_lab.tables.launch import (archive_previous, jobs_but_seeds, jobs_overlap, jobs_within, launches,
                                    machine_description, merge_added_launch, new_launch, repeated_jobs_problem,
                                    run_table, same_launch, seeds_on_disk, sft_controls)
from grpo_lab.tables import readme as readme_tables
from grpo_lab.tables.record import (committed_stopped_launch, record_paths, restore, stopped_date,
                                   stopped_launch_record, warmup_replay)


def seed_list(flag: str):
    """argparse type of a comma list of seeds (argparse names the flag): a bad one is refused, an empty one
    too (it runs nothing, and `--add-seeds ''` would otherwise read as a plain launch that moves the runs aside)."""
    def parse(text: str) -> list[int]:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"empty: give the seeds to run, e.g. {flag} 3,4")
        try:
            return [int(s) for s in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of seeds (e.g. {flag} 3,4)") from None
    return parse


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="scripts/make_table.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Environment: SMOKE=1 (tiny pipeline check), LAUNCHER=joblib|submitit_local|"
                                       "submitit_slurm (hydra/launcher), JOBS=<parallel jobs for joblib>. Anything "
                                       "after `--` is passed to every job as a Hydra override.")
    p.add_argument("table", help="name in conf/table/ (e.g. group_size) or a path to a table yaml")
    p.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE", "") not in ("", "0"),
                   help="tiny budgets, first seed only, outputs under outputs/smoke/ (also: SMOKE=1)")
    p.add_argument("--scale", choices=["lab", "full"], default=os.environ.get("SCALE", "lab"),
                   help="lab: the table's `fixed` overrides; full: its conf/experiment recipe (GPU)")
    p.add_argument("--launcher", default=os.environ.get("LAUNCHER") or None,
                   help="Hydra launcher plugin: basic (default), joblib, submitit_local, submitit_slurm")
    p.add_argument("--jobs", type=int, default=int(os.environ.get("JOBS", "2")), help="joblib: parallel jobs")
    p.add_argument("--seeds", type=seed_list("--seeds"), help="comma list overriding the table's seeds")
    p.add_argument("--variants", help="comma list: run only these variants")
    p.add_argument("--add-seeds", type=seed_list("--add-seeds"),
                   help="comma list: run these further seeds into the table's existing runs (same extra overrides "
                        "as the first launch) and rebuild it from all of them; warm-ups are cached per seed, so "
                        "only the new seeds cost")
    p.add_argument("--add-rows", action="store_true",
                   help="run this launch's jobs into the table's existing runs and rebuild it from all of them: "
                        "rows the first launch left out, e.g. `-- algorithm.epochs=4` after `-- algorithm.epochs=1` "
                        "(a `--` override must give a key the earlier launches set another value, so no job repeats)")
    p.add_argument("--sft-only", action="store_true",
                   help="run only the table's SFT controls that have no completed run (a launch stopped before "
                        "they finished), for the seeds its runs hold, and rebuild the table")
    p.add_argument("--runs-root", type=Path, help="where run dirs go (default outputs/tables or outputs/smoke/runs)")
    p.add_argument("--tables-root", type=Path, help="where the table goes (default tables/ or outputs/smoke/tables)")
    p.add_argument("--report-only", action="store_true", help="rebuild the table from the runs on disk")
    p.add_argument("--dry-run", action="store_true", help="validate every job and print the command; launch nothing")
    p.add_argument("--status", action="store_true",
                   help="print each run's state (done / running / interrupted / failed / to do) and the time left")
    return p.parse_args(argv), extra


def refresh_readme(plan, result: dict) -> None:
    """The README's list of tables says what the committed tables say (not for SMOKE or other folders)."""
    if not plan.smoke and Path(result["md"]).resolve().parent == readme_tables.REPO / "tables":
        readme_tables.main([])


def finish_sft_controls(plan, args, invocation: str, restored: list[str]) -> int:
    """--sft-only: the SFT controls the table's launch did not complete (stopped for time, say), for every
    seed its RL runs hold, then the table rebuilt from all runs. The first launch's header stays, its
    date line extended by this launch's date and wall time; the launch is also a note."""
    meta = plan.runs_dir / "table_meta.json"
    problem = None
    if args.add_seeds or args.add_rows or args.seeds or args.report_only or args.dry_run:
        problem = "--sft-only cannot be combined with --add-seeds, --add-rows, --seeds, --report-only or --dry-run"
    elif plan.spec.sft_control is None:
        problem = f"{plan.spec.path.name} has no sft_control"
    elif not meta.exists():
        problem = f"{meta} does not exist: run the table first (without --sft-only)"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    previous = json.loads(meta.read_text())
    previous["launch_notes"] = previous.get("launch_notes", []) + restored
    plan.seeds = sorted(seeds_on_disk(plan.runs_dir))
    started = time.time()
    date = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    notes: list[str] = []
    sft_controls(plan, plan.runs_dir / "make_table.log", notes, only_missing=True)
    wall = (time.time() - started) / 60
    previous["launch_notes"] = previous.get("launch_notes", []) + [
        f"SFT controls without a completed run: {'run' if notes else 'none'} by `{invocation}` on {date}"
        f"; wall time {wall:.1f} min"] + notes
    # The header's date line sums every launch's wall time (the README's wall-time column reads it).
    previous["date"] = f"{previous.get('date', '')}; SFT controls finished {date}; wall time {wall:.1f} min"
    meta.write_text(json.dumps(previous, indent=2))
    header = {"command": previous.get("command", invocation), "machine": previous.get("machine", ""),
              "date": previous["date"]}
    result = build(plan, header_extra=header, launch_notes=previous["launch_notes"])
    print(result["table"])
    print(f"wrote {result['md']}", file=sys.stderr)
    refresh_readme(plan, result)
    return 0


def stopped_launch_problem(record: dict, plan, sft_only: bool, added: bool) -> str | None:
    """Why a launch cannot start over the stopped (or still running) launch `record` of the same table,
    or None: it continues it, or (another plain launch) moves its runs aside."""
    attempts = record.get("attempts") or [None]
    busy = [s for s in map(state.run_state, state.planned_runs(record, plan.runs_dir)) if s.state == state.RUNNING]
    if state.alive(attempts[-1]) or busy:
        who = (f"make_table pid {attempts[-1]['pid']}" if state.alive(attempts[-1])
               else ", ".join(f"{s.name} (pid {s.owner['pid']})" for s in busy))
        return (f"{plan.runs_dir} is being made now ({who}): wait for it or stop it first; "
                f"`make table-status NAME={plan.spec.name}` shows each run's state")
    if sft_only:
        return (f"{plan.runs_dir} holds a stopped launch (`{record['invocation']}`): run that command again; it "
                "finishes the runs and the SFT controls")
    if added and not same_launch(record, plan, added):
        return (f"{plan.runs_dir} holds a stopped launch (`{record['invocation']}`): run that command again to "
                "finish it first")
    return None


def baseline_variant(spec) -> str | None:
    """The variant the table's rows are compared with (its `baseline`, else the first), or None when the
    baseline is a sweep value or there are no variants."""
    names = [v.name for v in spec.variants]
    if spec.baseline is None:
        return names[0] if names else None
    return spec.baseline if spec.baseline in names else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    def plan_for(spec, overrides: list[str]):
        return make_plan(spec, smoke=args.smoke, scale=args.scale, extra=overrides, runs_root=args.runs_root,
                         tables_root=args.tables_root, launcher=args.launcher, jobs=args.jobs,
                         seeds=args.add_seeds or args.seeds, only=args.variants.split(",") if args.variants else None)

    try:
        spec = load_spec(args.table)
        plan = plan_for(spec, extra)
    except TableSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env_prefix = " ".join(f"{k}={os.environ[k]}" for k in ("SMOKE", "LAUNCHER", "JOBS", "SCALE") if os.environ.get(k))
    invocation = (env_prefix + " " if env_prefix else "") + shlex.join(["python", "scripts/make_table.py", *argv])
    header = {"command": invocation, "machine": machine_description()}
    launch_notes: list[str] = list(plan.warnings)
    for w in plan.warnings:
        print(f"[make_table] warning: {w}", file=sys.stderr)

    if args.status:
        print(state.status_text(plan.runs_dir, spec.name, planned_jobs=len(plan.jobs())))
        return 0
    restored: list[str] = []
    # A dry run writes nothing: its checks read the committed record instead (below).
    if (args.report_only or ((args.sft_only or args.add_seeds or args.add_rows) and not args.dry_run)) \
            and not plan.smoke:
        # A fresh checkout has the table's committed record but not its run directories: bring those
        # back first, so the table is extended (or rebuilt) and never replaced (grpo_lab/tables/record.py).
        try:
            restored = restore(plan)
        except FileNotFoundError:
            pass   # nothing to restore: the checks below say what to run first
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for note in restored:
            print(f"[make_table] {note}", file=sys.stderr)
        launch_notes += restored
    elif not args.dry_run and not plan.smoke and committed_stopped_launch(plan) is not None:
        # The committed record holds a launch stopped in another checkout: it continues here (below).
        restored = restore(plan)
        for note in restored:
            print(f"[make_table] {note}", file=sys.stderr)
    if args.report_only:
        if not plan.runs_dir.exists():
            print(f"error: {plan.runs_dir} does not exist: run the table first", file=sys.stderr)
            return 2
        meta = plan.runs_dir / "table_meta.json"
        stopped = state.read_launch(plan.runs_dir)
        unfinished = stopped_launch_record(plan)
        if meta.exists():
            m = json.loads(meta.read_text())
            header.update({k: m[k] for k in ("command", "machine", "date") if k in m})
            launch_notes += m.get("launch_notes", [])
        elif unfinished is not None:   # a first launch stopped before it finished: what its record says
            header.update(command=unfinished["invocation"], date=stopped_date(unfinished))
        if stopped is not None:
            runs = [state.run_state(d) for d in state.planned_runs(stopped, plan.runs_dir)]
            launch_notes.append(
                f"the launch `{stopped['invocation']}` is stopped: {sum(r.state == state.DONE for r in runs)} of "
                f"{len(runs)} runs finished; running that command again (here, or in a checkout holding this "
                "record) continues it")
        result = build(plan, header_extra=header, launch_notes=launch_notes)
        print(result["table"])
        print(f"wrote {result['md']}", file=sys.stderr)
        return 0

    added = bool(args.add_seeds or args.add_rows)
    record = None if args.dry_run else state.read_launch(plan.runs_dir)
    if record:
        problem = stopped_launch_problem(record, plan, args.sft_only, added)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        if not same_launch(record, plan, added):
            record = None   # a launch of other jobs: it moves the stopped one's runs aside, as any first launch
        else:
            plan.continue_launch(record)
            print(f"[make_table] continuing the stopped launch of {record['date']} (`{record['invocation']}`, "
                  f"attempt {len(record['attempts']) + 1}): finished runs are kept, interrupted ones resume",
                  file=sys.stderr)
    if args.sft_only:
        return finish_sft_controls(plan, args, invocation, restored)

    created = not plan.runs_dir.exists()
    previous, added_what = None, None
    if added and record:   # its checks passed when it started; its runs are now on disk
        previous, added_what = record["previous_meta"], record["added_what"]
    elif added:
        # Checked before anything runs: the new runs join the table's, never replace or repeat one.
        flag = "--add-seeds" if args.add_seeds else "--add-rows"
        meta = plan.runs_dir / "table_meta.json"
        if args.dry_run and not meta.exists() and not plan.smoke and record_paths(plan)[1].exists():
            meta = record_paths(plan)[1]   # what a launch would restore first; the dry run restores nothing
            print(f"[make_table] dry run: checked against {meta}; a launch restores the table's runs from its "
                  "record first", file=sys.stderr)
        problem = None
        if args.add_seeds and args.add_rows:
            problem = "--add-seeds and --add-rows are two different launches: run one, then the other"
        elif (args.add_seeds and args.seeds) or args.smoke or args.report_only:
            problem = f"{flag} cannot be combined with {'--seeds, ' if args.add_seeds else ''}--smoke or --report-only"
        elif not meta.exists():
            problem = f"{meta} does not exist: run the table first (without {flag})"
        elif args.add_seeds and args.variants and baseline_variant(spec) not in (None, *args.variants.split(",")):
            problem = (f"--variants {args.variants} leaves out the baseline row {baseline_variant(spec)}: the added seeds' "
                       f"differences pair with its runs of the same seeds; add it to --variants")
        else:
            previous = json.loads(meta.read_text())
            earlier = [launch.get("launch_command", []) for launch in launches(previous)]
            if args.add_seeds:
                # More seeds of jobs an earlier launch ran (the first one's, or rows added later), of
                # all its rows or, with --variants, of some.
                same = [launch for launch in launches(previous)
                        if jobs_within(plan.command, launch.get("launch_command", []))]
                # Seeds a launch sharing any of these jobs ran are taken (a launch recorded before
                # table_meta.json kept its seeds: every seed on disk counts).
                sharing = [launch for launch in launches(previous)
                           if jobs_overlap(plan.command, launch.get("launch_command", []))]
                taken = sorted({s for launch in sharing for s in launch.get("seeds") or seeds_on_disk(plan.runs_dir)}
                               & set(plan.seeds))
                if not same:
                    problem = (f"these jobs differ from every earlier launch of the table (the first: "
                               f"`{previous.get('command')}`) in more than their seeds: pass the same variants and "
                               "`--` overrides (rows with other overrides go in with --add-rows)")
                elif taken:
                    problem = f"seed(s) {taken} already have runs of these jobs in {plan.runs_dir}; choose others"
                # The header's date line says which block got them (the tasks table adds seeds one task at a time).
                added_what = (f"seeds {','.join(map(str, plan.seeds))}" + (f" of rows {args.variants}" if args.variants else "")
                              + (f" of {' '.join(plan.pinned_block)}" if plan.pinned_block else ""))
            else:
                repeated = repeated_jobs_problem(earlier, plan.command)
                if repeated:
                    problem = (f"these jobs could repeat jobs of an earlier launch (`{repeated}`): --add-rows needs a "
                               "`--` override giving a key that launch set another value (e.g. `-- algorithm.epochs=4` "
                               "after `-- algorithm.epochs=1`); more seeds of the same jobs go in with --add-seeds")
                new = [c for c in jobs_but_seeds(plan.command) if c not in jobs_but_seeds(earlier[0])]
                added_what = f"rows `{' '.join(new)}` (seeds {','.join(map(str, plan.seeds))})"
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if added and args.add_rows and not record and not plan.smoke:
        # Added rows start where the recorded rows of their seed started, on whatever machine they run.
        replay, notes = warmup_replay(plan.runs_dir, plan.seeds)
        if replay:
            plan = plan_for(spec, [*extra, "warmup.replay_steps={" + ",".join(f"{s}:{n}" for s, n in
                                                                       sorted(replay.items())) + "}"])
        for note in notes:
            print(f"[make_table] {note}", file=sys.stderr)
        launch_notes += notes
    if added:
        plan.name_runs_apart()   # its jobs are numbered from 0 again: directories of their own
    elif not args.dry_run and not record:
        archived = archive_previous(plan.runs_dir)
        if archived:
            print(f"[make_table] moved the previous runs of {spec.name} to {archived}", file=sys.stderr)
    try:
        # A first launch archives the earlier runs; a continued launch's directories are its own.
        n_jobs = preflight(plan, earlier_runs_move=previous is None, resuming=record is not None)
    except TableSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.dry_run and created and plan.runs_dir.exists():
            shutil.rmtree(plan.runs_dir)  # the variant files preflight wrote; a dry run leaves nothing
    print(f"[make_table] {spec.name}: {n_jobs} jobs validated", file=sys.stderr)
    print("[make_table] " + shlex.join(plan.command), file=sys.stderr)
    if args.dry_run:
        return 0

    record = record or new_launch(plan, invocation, added_what, previous)
    rc, wall_s = run_table(plan, n_jobs, header, launch_notes, record, invocation)
    if previous is not None:
        meta = plan.runs_dir / "table_meta.json"
        merged = merge_added_launch(previous, json.loads(meta.read_text()), invocation, added_what,
                                    inherited=plan.warnings)
        meta.write_text(json.dumps(merged, indent=2))
        header = {k: merged[k] for k in ("command", "machine", "date")}
        launch_notes = merged["launch_notes"]
    try:
        result = build(plan, header_extra=header, launch_notes=launch_notes)
    except Exception as e:  # e.g. no run dir at all: say so rather than a bare traceback
        print(f"error: could not build the table from {plan.runs_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    state.finish_launch(plan.runs_dir)   # the table is built: a re-run is a new launch
    print(result["table"])
    for k in ("md", "csv", "png"):
        print(f"wrote {result[k]}", file=sys.stderr)
    print(f"[make_table] {spec.name}: {wall_s / 60:.1f} min, multirun exit status {rc}", file=sys.stderr)
    refresh_readme(plan, result)
    # The table was built; a failed job is reported in it, not by failing the make target. A multirun
    # that produced no completed run at all is still an error.
    n_ok = sum(g.n_ok for g in result["groups"])
    return 0 if n_ok else 1


if __name__ == "__main__":
    sys.exit(main())
