"""A table's committed record: what a fresh checkout needs to extend a table whose runs it does not have.

Every session and every CI run starts from a fresh clone, and outputs/ is not in git, so the run
directories behind tables/<name>.md are gone by the next session: `--add-seeds` found no table to add
to, and each table could only grow as far as one session's hours reached (the DAPO ladder needs 16
seeds at ~16 min each). Three committed files carry a table over:

    tables/<name>_runs.csv   every run: group label, name, path, status, seed, error, and the value of
                             each of the table's columns (report/table.py `write_runs_csv`)
    tables/<name>_meta.json  its launches: <runs dir>/table_meta.json with project-relative paths
                             (commands, seeds, dates, wall times, launch notes)
    tables/<name>_curves.csv every run's plotted learning curve (report/table.py `write_curves_csv`)

A launch stopped before it finished (a table of hours, carried across sessions) is recorded too: its
finished runs in the CSV, its launch record in the meta as `stopped_launch`; the same command, run in a
fresh checkout, restores them and continues the launch, running only what had not finished: an unfinished
run starts over there (move its directory aside before recording, so the committed table shows finished runs
only).

`restore(plan)` turns them back into <runs dir>/table_meta.json and one *recorded run* per CSV row
whose directory is missing: summary.json with the row's status, error, `final` accuracies and its
column values under `recorded`, config.yaml and .hydra/overrides.yaml from its group label and seed,
and a metrics.jsonl holding only its curve. The table reads a recorded run's cells from `recorded`
(`Run.recorded`), the findings its final accuracies, the plot its curve, and its seed pairs it with
the other rows of that seed exactly as before. New seeds are run as whole seeds (every row), so a
paired difference never mixes two launches within one seed. (Tables committed before the curves
file existed restore without curves: their plot draws the runs that have one.)
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml

from grpo_lab.report.runs import display_path, project_roots
from grpo_lab.report.table import WARMUP_FIELDS
from grpo_lab.tables.plan import Plan
from grpo_lab.tables.spec import ROOT, VARIANT_GROUP, override_key, overrides_parser

RESTORED_FROM = "restored_from"


def record_paths(plan: Plan) -> tuple[Path, Path, Path]:
    """(runs CSV, meta JSON, curves CSV) of the table `plan` writes: tables/<name>_runs.csv, _meta.json and
    _curves.csv (the learning curves; tables built before it was written have none)."""
    return tuple(plan.out.with_name(plan.out.name + suffix) for suffix in ("_runs.csv", "_meta.json", "_curves.csv"))


def read_curves(path: Path) -> dict[str, list[dict]]:
    """Run path -> its metrics lines (step, samples, the plotted metric) from a curves CSV; {} if absent."""
    if not path.exists():
        return {}
    out: dict[str, list[dict]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        metric = (reader.fieldnames or [])[-1]
        for row in reader:
            step = float(row["step"])
            line = {"step": int(step) if step.is_integer() else step, metric: float(row[metric])}
            if row["samples"] != "":
                line["samples"] = float(row["samples"])
            out.setdefault(row["path"], []).append(line)
    return out


def _project_relative(value, root: Path = ROOT):
    """`value` with the checkout `root`'s absolute paths (its own, and a linked outputs/'s) taken out of every
    string (lists and dicts walked), so a committed record names project paths and matches a clone in
    another folder."""
    if isinstance(value, str):
        # outputs/ first, so its runs read outputs/... even where the link points into the project itself.
        for prefix, shown in reversed(project_roots(root)):
            value = value.replace(f"{prefix}/", f"{shown}/" if shown.parts else "").replace(str(prefix), str(shown))
        return value
    if isinstance(value, list):
        return [_project_relative(v, root) for v in value]
    if isinstance(value, dict):
        return {k: _project_relative(v, root) for k, v in value.items()}
    return value


def launch_record_relative(meta: dict, root: Path = ROOT) -> dict:
    """table_meta.json as committed: the absolute paths of every checkout that launched part of it (a
    worktree running the table while the report is made in another) and of `root` taken out, and the
    checkouts' own paths dropped."""
    launches = [meta, *meta.get("added_launches", [])]
    checkouts = {Path(c) for launch in launches if (c := launch.get("checkout"))} - {root}
    meta = {k: v for k, v in meta.items() if k != "checkout"}
    if "added_launches" in meta:
        meta["added_launches"] = [{k: v for k, v in a.items() if k != "checkout"} for a in meta["added_launches"]]
    for checkout in sorted(checkouts):
        meta = _project_relative(meta, checkout)
    return _project_relative(meta, root)


def stopped_launch_record(plan: Plan) -> dict | None:
    """The launch stopped in <runs dir> before all its runs ended (table_launch.json, grpo_lab/tables/state.py)
    as committed, or None:
    project-relative (the interpreter named from its environment's folder), each attempt given the end its
    log shows, so the wall time it spent still counts where the launch continues."""
    from grpo_lab.tables import state
    from grpo_lab.tables.launch import end_stopped_attempts

    record = state.read_launch(plan.runs_dir)
    if record is None or all(state.run_state(d).state in (state.DONE, state.FAILED)
                             for d in state.planned_runs(record, plan.runs_dir)):
        return None   # none, or one whose every run ended: the table being built is its whole table
    end_stopped_attempts(record, plan.runs_dir / "make_table.log")
    python = record["command"][0]
    python = python[python.index(".venv/"):] if ".venv/" in python else Path(python).name
    return _project_relative({**record, "command": [python, *record["command"][1:]]})


def stopped_wall_s(stopped: dict) -> float:
    """The wall time a stopped launch's attempts ran (`stopped_launch_record`'s, each given its end)."""
    return sum(a["ended_ts"] - a["started_ts"] for a in stopped["attempts"])


def stopped_date(stopped: dict) -> str:
    """The date line of a first launch stopped before it finished: when it began and how long it ran."""
    return f"{stopped['date']}; wall time {stopped_wall_s(stopped) / 60:.1f} min so far; stopped before it finished"


def write_meta(plan: Plan) -> Path | None:
    """Copy <runs dir>/table_meta.json next to the table (tables/<name>_meta.json), project-relative. A launch
    stopped before it finished goes in as `stopped_launch`, so that the same command continues it in a checkout
    without these runs (`restore`); a first launch stopped has no table_meta.json yet: the record then holds
    what its launch record says."""
    src = plan.runs_dir / "table_meta.json"
    stopped = stopped_launch_record(plan)
    if not src.exists() and stopped is None:
        return None
    dest = record_paths(plan)[1]
    if src.exists():
        meta = launch_record_relative(json.loads(src.read_text()))
    else:
        meta = {"command": stopped["invocation"], "date": stopped_date(stopped), "launch_command": stopped["command"],
                "seeds": stopped["seeds"], "wall_time_s": stopped_wall_s(stopped)}
    # runs_dir: where the runs CSV's paths point (the same display_path the CSV was written with).
    meta = {**meta, "runs_dir": display_path(plan.runs_dir), **({"stopped_launch": stopped} if stopped else {})}
    dest.write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def label_pairs(label: str) -> list[tuple[str, str]]:
    """The (key, value) pairs of a group label as report/runs.py writes it ("variant=grpo, task=chain_sum")."""
    pairs = []
    for item in label.split(", "):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"group label {label!r} is not 'key=value, ...'")
        pairs.append((key, value))
    return pairs


def _nested(pairs: list[tuple[str, str]]) -> dict:
    """{"algorithm.clip_low": "0.1"} -> {"algorithm": {"clip_low": "0.1"}}: config keys a table groups by."""
    out: dict = {}
    for key, value in pairs:
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _number(text: str) -> float | None:
    return None if text in ("", None) else float(text)


def variant_of(pairs: list[tuple[str, str]], plan: Plan) -> str | None:
    """The variant a row's group label stands for: named in it, or, when the table groups by config keys
    (`group_by`, e.g. group_size's G2 = rollout.group_size=2 + trainer.prompts_per_step=128), the one
    variant whose overrides give every key of the label its value."""
    named = dict(pairs).get(VARIANT_GROUP)
    if named is not None or not plan.variants:
        return named
    parser = overrides_parser()
    found = []
    for variant, overrides in plan.variants:
        given = {override_key(o): parser.parse_override(o).get_value_element_as_str() for o in overrides}
        if all(given.get(k) == v for k, v in pairs):
            found.append(variant.name)
    return found[0] if len(found) == 1 else None


def write_recorded_run(run_dir: Path, row: dict[str, str], columns: list[str], source: str,
                       variant: str | None = None, curve: list[dict] = ()) -> None:
    """One recorded run from its runs-CSV row (see the module docstring)."""
    pairs = label_pairs(row["group"])
    if variant is not None and VARIANT_GROUP not in dict(pairs):
        pairs.append((VARIANT_GROUP, variant))
    seed = int(row["seed"]) if row["seed"] != "" else None
    recorded = {c: _number(row[c]) for c in columns}
    final = {k: recorded[c] for c, k in (("final_acc", "eval/accuracy"), ("final_sampled_acc", "eval/sampled_accuracy"))
             if recorded.get(c) is not None}
    run_dir.mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    overrides = [f"{'+' if k == VARIANT_GROUP else ''}{k}={v}" for k, v in pairs]
    if seed is not None:
        overrides.append(f"seed={seed}")
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**_nested(pairs), "seed": seed, "run_name": row["run"]}))
    if curve:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in curve))
    (run_dir / "summary.json").write_text(json.dumps({
        "status": row["status"], "error": row["error"] or None, "run_name": row["run"], "overrides": overrides,
        "final": final, "recorded": recorded, RESTORED_FROM: source,
        **({"warmup": {"steps": int(row["warmup_steps"]) if row.get("warmup_steps") else None, "digest": row["warmup_digest"],
                       "inputs": row["warmup_inputs"]}} if row.get("warmup_digest") else {})}, indent=2))


def committed_stopped_launch(plan: Plan) -> dict | None:
    """The stopped launch the table's committed record carries (`write_meta`), when this checkout's runs
    directory holds neither a table nor a launch of its own; else None."""
    meta = record_paths(plan)[1]
    if not meta.exists() or any((plan.runs_dir / f).exists() for f in ("table_meta.json", "table_launch.json")):
        return None
    return json.loads(meta.read_text()).get("stopped_launch")


def restore(plan: Plan) -> list[str]:
    """Rebuild a table's runs directory from its committed record when the directory has no
    table_meta.json and no launch record (a fresh checkout); a launch the record says was stopped becomes
    this directory's launch in progress, which the same command continues. Returns launch notes saying
    what was restored ([] if nothing was).
    Raises FileNotFoundError naming what is missing when there is neither a runs directory nor a record."""
    if (plan.runs_dir / "table_meta.json").exists() or (plan.runs_dir / "table_launch.json").exists():
        return []
    runs_csv, meta, curves_csv = record_paths(plan)
    missing = [p for p in (runs_csv, meta) if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"{plan.runs_dir / 'table_meta.json'} does not exist and the table has no committed record "
            f"({', '.join(_project_relative(str(p)) for p in missing)} missing): run the table first")
    with open(runs_csv, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames or []
                   if c not in ("group", "run", "path", "status", "seed", "error", *WARMUP_FIELDS)]
        rows = list(reader)
    source = _project_relative(str(runs_csv))
    # Where the runs were when the CSV was written: each run goes to the same place under this plan's
    # runs directory, which --runs-root may have moved.
    meta_record = json.loads(meta.read_text())
    recorded_dir = meta_record.get("runs_dir")
    if recorded_dir is None:
        raise ValueError(f"{_project_relative(str(meta))} has no runs_dir (where its runs CSV's paths point): "
                         "rebuild it where the table's runs are (--report-only), or relaunch the table")
    curves = read_curves(curves_csv)
    restored, with_curves = 0, 0
    if meta_record.get("stopped_launch") is not None:
        # A run the stopped launch left unfinished runs again where it continues (a recorded run would read
        # as finished or failed, and be kept).
        rows = [row for row in rows if row["status"] in ("completed", "failed")]
    for row in rows:
        try:
            run_dir = plan.runs_dir / Path(row["path"]).relative_to(recorded_dir)
        except ValueError:
            raise ValueError(f"{source}: run {row['run']!r} has path {row['path']!r}, outside the table's runs "
                             f"directory when it ran ({recorded_dir}, {_project_relative(str(meta))})") from None
        if run_dir.exists():
            continue
        variant = variant_of(label_pairs(row["group"]), plan)
        if plan.variants and variant is None:
            raise ValueError(f"{source}: no single variant of {plan.spec.path.name} gives row {row['group']!r} "
                             f"(run {row['run']!r}) its values: the table's variants changed since it ran; "
                             "relaunch it (without --add-seeds / --report-only)")
        write_recorded_run(run_dir, row, columns, source, variant, curves.get(row["path"], []))
        restored += 1
        with_curves += row["path"] in curves
    plan.runs_dir.mkdir(parents=True, exist_ok=True)
    stopped = meta_record.pop("stopped_launch", None)
    if stopped is None:
        (plan.runs_dir / "table_meta.json").write_text(meta.read_text())
    else:
        # The stopped launch continues here: its finished runs are the recorded ones, the others start. A first
        # launch has no table_meta.json until it finishes; a launch adding to a table keeps the table's.
        from grpo_lab.tables import state

        state.write_launch(plan.runs_dir, stopped)
        if stopped.get("previous_meta") is not None:
            (plan.runs_dir / "table_meta.json").write_text(json.dumps(meta_record, indent=2))
    seeds = sorted({int(r["seed"]) for r in rows if r["seed"] != ""})
    curves_text = ("with their learning curves" if with_curves == restored else
                   "without learning curves (none recorded), so the plot draws only the runs made here"
                   if with_curves == 0 else f"{with_curves} of them with a learning curve for the plot")
    return [f"{restored} runs (seeds {','.join(map(str, seeds))}) restored from {source} and "
            f"{_project_relative(str(meta))}: their run directories were not on this machine; the table reads "
            f"their recorded values, {curves_text}"] + (
        [f"the launch `{stopped['invocation']}` of {stopped['date']} was stopped before it finished: running that "
         "command again continues it, keeping these runs and running the others"] if stopped else [])


def warmup_replay(runs_dir: Path, seeds: list[int]) -> tuple[dict[int, int], list[str]]:
    """{seed: warm-up steps} for rows added to the table in `runs_dir` (make_table --add-rows), and notes
    saying what was replayed or why not. A seed is replayed when its recorded runs all began from warm-ups
    of one set of inputs (model, task, warm-up settings) that stopped at one step: the added rows' warm-up
    then trains exactly that long (warmup.replay_steps), wherever it runs, or reuses the cached one that
    stopped there. Seeds whose rows were built from different warm-ups, or whose runs recorded none, are left
    to the stopping rule."""
    from grpo_lab.report.runs import NoRunsFound, load_runs

    try:
        runs = load_runs(runs_dir)
    except NoRunsFound:
        return {}, []
    replay, notes = {}, []
    for seed in seeds:
        starts = {(r.warmup.get("inputs"), r.warmup.get("steps")) for r in runs
                  if r.seed is not None and int(r.seed) == seed and r.warmup.get("steps")}
        if len(starts) == 1 and None not in next(iter(starts)):
            replay[seed] = int(next(iter(starts))[1])
        elif len(starts) > 1:
            notes.append(f"seed {seed}: the table's rows began from {len(starts)} different warm-ups, so the added "
                         "rows' warm-up follows its stopping rule (compare the 'Different starts' section)")
    if replay:
        notes.append("added rows replay the recorded warm-up lengths (warmup.replay_steps: "
                     + ", ".join(f"seed {s}: {n} steps" for s, n in sorted(replay.items())) + ")")
    return replay, notes
