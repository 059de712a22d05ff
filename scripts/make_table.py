#!/usr/bin/env python
"""Make one paper table: conf/table/<name>.yaml -> one Hydra multirun -> tables/<name>.md|csv|png.

    python scripts/make_table.py group_size             # the lab-scale table (long: see the yaml)
    SMOKE=1 python scripts/make_table.py group_size     # same pipeline: one seed, two steps, tiny warm-up
    LAUNCHER=joblib JOBS=2 python scripts/make_table.py clip   # jobs in parallel (hydra/launcher=joblib)
    python scripts/make_table.py dapo --report-only     # rebuild the table from the runs on disk
    python scripts/make_table.py dapo --dry-run         # print the command, launch nothing
    python scripts/make_table.py dapo --scale full      # the paper-scale recipe (conf/experiment/...)
    python scripts/make_table.py dapo -- cache_dir=/tmp/c   # extra overrides for every job

How a table is run
------------------
One `python -m grpo_lab.train -m ...` multirun per table, into `hydra.sweep.dir=outputs/tables/<name>`
(SMOKE: outputs/smoke/runs/<name>). Sweeps (`sweep:` in the yaml) are Hydra's own comma lists. Named
variants (`variants:`, e.g. the rungs of DAPO's ladder, each a *set* of overrides) become one config
file each, written to `<runs dir>/.variants/variant/<name>.yaml` (`# @package _global_`) and swept as
the config group `+variant=a,b,c` through `hydra.searchpath`. So variants, sweeps and seeds are one
cartesian product that any Hydra launcher (basic, joblib, submitit) runs, and each run's
.hydra/overrides.yaml says which variant it was; the variant files stay next to the runs as the
record of what ran. Because a key set on the command line beats the same key in a variant file, a
key may not be both a fixed override and a variant's (checked, with the fix in the message).

Before launching, every job's config is composed and checked with grpo_lab.config.validate, so a
bad value fails here in seconds and not as a table of failed runs.

Hydra's BasicLauncher runs every job of the batch even when one raises; the multirun then exits
non-zero (BasicSweeper re-raises the first failure after the batch). The table is built anyway: the
trainer writes summary.json with status "failed" and the error, the report counts failed runs per
row and lists them, and jobs that died before writing anything are listed in the header notes.

The header states the command, the machine, the date and the wall time, what the paper found
(`paper_finding`, per-variant `paper`) and what we found, computed from the runs: the variant with
the best mean final accuracy, every row's difference to the baseline with its 95 % CI, and whether
the confidence intervals overlap.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONF = ROOT / "conf"
TABLE_CONF = CONF / "table"
VARIANT_GROUP = "variant"

# SMOKE=1: the same pipeline at a size the test suite can afford. Every job still builds the model,
# warms it up (few steps), trains, evaluates and is reported; only budgets shrink.
SMOKE_OVERRIDES = [
    "rollout=hf",
    "logger=none",
    "trainer.total_steps=2",
    "trainer.eval_every=1",
    "trainer.save_checkpoint=false",
    "warmup.max_steps=60",
    "warmup.eval_every=30",
    "task.train_size=2000",
    "task.dev_size=32",
    "task.test_size=32",
]

# Keys make_table owns: set them through its options instead.
RESERVED_KEYS = ("seed", VARIANT_GROUP, "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.searchpath", "logger.group")


class TableSpecError(ValueError):
    """A conf/table/*.yaml that cannot work; the message lists every problem and what to change."""


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------


@dataclass
class Variant:
    # Identifier used as the config name, the row label and the run-name prefix.
    name: str
    # Overrides of this variant (lab scale); with `cumulative: true`, added to the previous variants'.
    overrides: list[str]
    # Overrides used instead at --scale full (default: `overrides`).
    full_overrides: list[str] | None = None
    # The paper's number for this row (text, e.g. "36"), shown next to ours.
    paper: str | None = None


@dataclass
class SFTControl:
    # Variant whose completed runs set the budget: mean over seeds of their summed step times.
    match: str
    # Fixed budget in seconds instead (used when set, and as the fallback when no `match` run completed).
    wall_time_s: float | None = None
    # Evaluations spread over the budget (as the RL runs' eval_every).
    evals: int = 3
    # The paper's / a previous measurement's number for this row.
    paper: str | None = None


@dataclass
class TableSpec:
    name: str
    path: Path
    # Markdown title.
    title: str
    # What the paper(s) found, with arXiv ids; printed in the header next to what we found.
    paper_finding: str
    # Metric of the `paper` numbers (e.g. "AIME 2024 avg@32, %").
    paper_metric: str = ""
    # Free text under the findings: design choices, budget, known departures.
    notes: str = ""
    # conf/experiment/<name>.yaml: the paper-scale recipe used by --scale full instead of `fixed`.
    experiment: str | None = None
    # Seeds every condition runs with.
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # Overrides for every job at lab scale (budgets, engine, ...).
    fixed: list[str] = field(default_factory=list)
    # hydra.sweeper.params-style: key -> comma list (cartesian product).
    sweep: dict[str, str] = field(default_factory=dict)
    # Named sets of overrides (rows), crossed with `sweep`.
    variants: list[Variant] = field(default_factory=list)
    # Ladder: each variant adds its overrides to the previous variants' (DAPO Table 1).
    cumulative: bool = False
    # Row to compare every other row with (a variant name, or "key=value" of a sweep); default: the first.
    baseline: str | None = None
    # Dotted config keys to group runs by; null = the overrides that vary (variant and sweep keys).
    group_by: list[str] | None = None
    # Report columns (grpo_lab.report.table.COLUMNS or "<agg>:<metric>"); null = the report's default.
    columns: list[str] | None = None
    # Accuracy (fraction) for the samples/steps-to-target column.
    target: float | None = None
    # x axis of the curves and of the first-reach column: samples | step.
    x: str = "samples"
    # Extra overrides for SMOKE=1 (after the global smoke set).
    smoke: list[str] = field(default_factory=list)
    # Matched-compute SFT control row (scripts/sft_control.py), run after the sweep.
    sft_control: SFTControl | None = None


TOP_KEYS = {f for f in TableSpec.__dataclass_fields__ if f not in ("name", "path")}
VARIANT_KEYS = set(Variant.__dataclass_fields__)
SFT_KEYS = set(SFTControl.__dataclass_fields__)
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")


def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _key(override: str) -> str:
    """'+a.b=1' -> 'a.b' (the key an override sets, without Hydra's +/++/~ prefixes)."""
    return override.split("=", 1)[0].lstrip("+~")


def _check_overrides(items: Any, where: str, errors: list[str], *, allow_sweep: bool = False) -> list[str]:
    """A list of single-valued Hydra overrides; syntax errors, sweeps and reserved keys are reported."""
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
        errors.append(f"{where} must be a list of override strings like 'trainer.total_steps=150', got {items!r}")
        return []
    parser = _parser()
    for o in items:
        try:
            ov = parser.parse_override(o)
        except Exception as e:  # hydra's OverrideParseException; its message points at the character
            errors.append(f"{where}: cannot parse override {o!r}: {e}")
            continue
        if ov.is_delete():
            errors.append(f"{where}: deletions ({o!r}) are not supported; set the value instead")
        if ov.is_sweep_override() and not allow_sweep:
            errors.append(f"{where}: {o!r} is a sweep; put swept keys under `sweep:` (or make a variant per value)")
        if _key(o) in RESERVED_KEYS:
            errors.append(f"{where}: {_key(o)!r} is set by make_table.py (seeds: `seeds:`, variants: `variants:`, "
                          "output dirs and wandb group: command-line options); remove it")
    keys = [_key(o) for o in items]
    dups = sorted({k for k in keys if keys.count(k) > 1})
    if dups:
        errors.append(f"{where}: {', '.join(dups)} set more than once")
    return list(items)


def load_spec(name_or_path: str | os.PathLike) -> TableSpec:
    """Read and validate conf/table/<name>.yaml (or a path); raise TableSpecError listing every problem."""
    import yaml

    p = Path(name_or_path)
    path = p if p.suffix in (".yaml", ".yml") or p.exists() else TABLE_CONF / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(f.stem for f in TABLE_CONF.glob("*.yaml")))
        raise TableSpecError(f"no table named {str(name_or_path)!r}: {path} does not exist; tables: {known}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise TableSpecError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise TableSpecError(f"{path}: the top level must be a mapping of the keys {', '.join(sorted(TOP_KEYS))}")
    errors: list[str] = []
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        errors.append(f"unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(TOP_KEYS))}")
    for req in ("title", "paper_finding"):
        if not isinstance(raw.get(req), str) or not raw.get(req, "").strip():
            errors.append(f"`{req}` is required (text)")
    spec = TableSpec(name=path.stem, path=path, title=str(raw.get("title", "")),
                     paper_finding=str(raw.get("paper_finding", "")).strip())
    for key in ("paper_metric", "notes", "experiment"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], str):
                errors.append(f"`{key}` must be text, got {raw[key]!r}")
            else:
                setattr(spec, key, raw[key].strip())
    if spec.experiment and not (CONF / "experiment" / f"{spec.experiment}.yaml").is_file():
        errors.append(f"experiment: conf/experiment/{spec.experiment}.yaml does not exist")

    seeds = raw.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                          for s in seeds):
        errors.append(f"`seeds` must be a non-empty list of integers, got {seeds!r}")
    elif len(set(seeds)) != len(seeds):
        errors.append(f"`seeds` repeats a seed: {seeds}")
    else:
        spec.seeds = seeds

    spec.fixed = _check_overrides(raw.get("fixed"), "fixed", errors)
    spec.smoke = _check_overrides(raw.get("smoke"), "smoke", errors)

    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, dict):
        errors.append(f"`sweep` must map a key to a comma list (hydra.sweeper.params style), got {sweep!r}")
        sweep = {}
    for k, v in sweep.items():
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            errors.append(f"sweep.{k}: give a comma list like '0.1,0.2,0.3', got {v!r}")
            continue
        spec.sweep[str(k)] = str(v)
        _check_overrides([f"{k}={v}"], f"sweep.{k}", errors, allow_sweep=True)

    variants = raw.get("variants") or []
    if not isinstance(variants, list):
        errors.append("`variants` must be a list of {name, overrides, [full_overrides], [paper]}")
        variants = []
    for i, v in enumerate(variants):
        where = f"variants[{i}]"
        if not isinstance(v, dict):
            errors.append(f"{where} must be a mapping with name and overrides, got {v!r}")
            continue
        bad = sorted(set(v) - VARIANT_KEYS)
        if bad:
            errors.append(f"{where}: unknown key(s) {', '.join(bad)}; valid: {', '.join(sorted(VARIANT_KEYS))}")
        name = v.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            errors.append(f"{where}: name must be an identifier (letters, digits, _ . -), got {name!r}")
            name = f"variant{i}"
        where = f"variants[{name}]"
        ov = _check_overrides(v.get("overrides", []), f"{where}.overrides", errors)
        full = v.get("full_overrides")
        full = None if full is None else _check_overrides(full, f"{where}.full_overrides", errors)
        for o in ov + (full or []):
            if o.startswith("hydra") or _key(o).startswith("hydra"):
                errors.append(f"{where}: {o!r}: hydra settings cannot differ between variants")
        paper = v.get("paper")
        spec.variants.append(Variant(name, ov, full, None if paper is None else str(paper)))
    names = [v.name for v in spec.variants]
    if len(set(names)) != len(names):
        errors.append(f"variant names must be unique: {names}")
    if not spec.variants and not spec.sweep:
        errors.append("a table needs `variants:` or `sweep:` (or both): there is nothing to compare")

    cumulative = raw.get("cumulative", False)
    if not isinstance(cumulative, bool):
        errors.append(f"`cumulative` must be true or false, got {cumulative!r}")
    spec.cumulative = bool(cumulative)

    # A key both on the command line (fixed/sweep) and in a variant file: the command line would win
    # silently and the variant would not be what its name says.
    cli_keys = {_key(o) for o in spec.fixed} | set(spec.sweep)
    for v in spec.variants:
        for o in v.overrides + (v.full_overrides or []):
            if _key(o) in cli_keys:
                errors.append(f"variants[{v.name}] sets {_key(o)!r}, which `fixed`/`sweep` also set; the command "
                              "line would override the variant. Set it in every variant (or in the first one of "
                              "a cumulative ladder) instead of in `fixed`")
    for k in spec.sweep:
        if _key(k) in {_key(o) for o in spec.fixed}:
            errors.append(f"sweep key {k!r} is also in `fixed`; remove one")

    baseline = raw.get("baseline")
    if baseline is not None:
        if not isinstance(baseline, str):
            errors.append(f"`baseline` must be a variant name or 'key=value', got {baseline!r}")
        elif "=" not in baseline and baseline not in names and baseline != "sft_control":
            errors.append(f"baseline {baseline!r} is not a variant; variants: {', '.join(names)}")
        else:
            spec.baseline = baseline

    group_by = raw.get("group_by")
    if group_by is not None:
        if not isinstance(group_by, list) or not group_by or not all(isinstance(k, str) for k in group_by):
            errors.append(f"`group_by` must be a non-empty list of dotted config keys or null, got {group_by!r}")
        else:
            spec.group_by = group_by

    columns = raw.get("columns")
    if columns is not None:
        from grpo_lab.report.table import resolve_column

        if not isinstance(columns, list) or not columns:
            errors.append(f"`columns` must be a non-empty list, got {columns!r}")
        else:
            for c in columns:
                try:
                    resolve_column(str(c))
                except ValueError as e:
                    errors.append(f"columns: {e}")
            spec.columns = [str(c) for c in columns]

    target = raw.get("target")
    if target is not None:
        if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0.0 <= target <= 1.0:
            errors.append(f"`target` is an accuracy fraction in [0, 1] (e.g. 0.65), got {target!r}")
        else:
            spec.target = float(target)
    x = raw.get("x", "samples")
    if x not in ("samples", "step"):
        errors.append(f"`x` must be samples or step, got {x!r}")
    else:
        spec.x = x

    sft = raw.get("sft_control")
    if sft is not None:
        if not isinstance(sft, dict):
            errors.append(f"`sft_control` must be a mapping ({', '.join(sorted(SFT_KEYS))}), got {sft!r}")
        else:
            bad = sorted(set(sft) - SFT_KEYS)
            if bad:
                errors.append(f"sft_control: unknown key(s) {', '.join(bad)}; valid: {', '.join(sorted(SFT_KEYS))}")
            match = sft.get("match")
            if match not in names:
                errors.append(f"sft_control.match must name a variant whose runs set the wall-time budget; "
                              f"got {match!r}, variants: {', '.join(names)}")
            wall = sft.get("wall_time_s")
            if wall is not None and (not isinstance(wall, (int, float)) or wall <= 0):
                errors.append(f"sft_control.wall_time_s must be > 0 seconds or null, got {wall!r}")
            evals = sft.get("evals", 3)
            if not isinstance(evals, int) or evals < 0:
                errors.append(f"sft_control.evals must be an integer >= 0, got {evals!r}")
            spec.sft_control = SFTControl(str(match), None if wall is None else float(wall), int(evals or 0),
                                          None if sft.get("paper") is None else str(sft["paper"]))
    if errors:
        raise TableSpecError(f"{path}:\n  - " + "\n  - ".join(errors))
    return spec


# ---------------------------------------------------------------------------------------------
# Planning: overrides, variant files, jobs
# ---------------------------------------------------------------------------------------------


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one in place."""
    out: dict[str, str] = {}
    for items in lists:
        for o in items:
            k = _key(o)
            out.pop(k, None)
            out[k] = o
    return list(out.values())


def variant_overrides(spec: TableSpec, scale: str) -> list[tuple[Variant, list[str]]]:
    """Each variant with its effective overrides (cumulative ladders include the earlier rungs')."""
    out, acc = [], []
    for v in spec.variants:
        own = v.full_overrides if scale == "full" and v.full_overrides is not None else v.overrides
        acc = merge_overrides(acc, own) if spec.cumulative else list(own)
        out.append((v, list(acc)))
    return out


def _is_group(key: str) -> bool:
    return (CONF / key).is_dir()


def variant_yaml(name: str, overrides: list[str]) -> str:
    """The config file of one variant: `# @package _global_`, group choices as defaults overrides."""
    from omegaconf import OmegaConf

    parser = _parser()
    defaults, body = [], OmegaConf.create({})
    for o in overrides:
        ov = parser.parse_override(o)
        key = ov.key_or_group
        if _is_group(key):
            defaults.append({f"override /{key}": ov.value()})
        else:
            OmegaConf.update(body, key, ov.value(), merge=True, force_add=True)
    if "run_name" not in body:
        body.run_name = f"{name}_s${{seed}}"
    lines = [f"# @package _global_", f"# variant {name!r}, written by scripts/make_table.py from: "
             + " ".join(overrides or ["(no overrides)"])]
    if defaults:
        lines.append(OmegaConf.to_yaml(OmegaConf.create({"defaults": defaults})).rstrip())
    lines.append(OmegaConf.to_yaml(body).rstrip())
    return "\n".join(lines) + "\n"


@dataclass
class Plan:
    spec: TableSpec
    smoke: bool
    scale: str
    runs_dir: Path
    out: Path
    group: str
    variants: list[tuple[Variant, list[str]]]
    base: list[str]            # fixed (or experiment=...) + smoke + extra: every job's non-swept overrides
    seeds: list[int]
    launcher: list[str]
    command: list[str]
    env: dict[str, str]
    warnings: list[str] = field(default_factory=list)

    @property
    def variants_root(self) -> Path:
        return self.runs_dir / ".variants"

    def jobs(self) -> list[list[str]]:
        """Every job's task overrides, in the order Hydra's BasicSweeper runs them (seed varies fastest)."""
        axes: list[list[str]] = []
        if self.variants:
            axes.append([f"+{VARIANT_GROUP}={v.name}" for v, _ in self.variants])
        parser = _parser()
        for k, v in self.spec.sweep.items():
            if _key(k) in {_key(o) for o in self.base}:
                continue  # an extra override pinned this sweep key
            ov = parser.parse_override(f"{k}={v}")
            vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
            axes.append([f"{k}={x}" for x in vals])
        axes.append([f"seed={s}" for s in self.seeds])
        return [list(combo) + self.base for combo in itertools.product(*axes)]

    def searchpath_override(self) -> str:
        return f"hydra.searchpath=['file://{self.variants_root.resolve()}']"


def make_plan(spec: TableSpec, *, smoke: bool = False, scale: str = "lab", extra: list[str] = (),
              runs_root: Path | None = None, tables_root: Path | None = None, launcher: str | None = None,
              jobs: int = 2, seeds: list[int] | None = None, only: list[str] | None = None) -> Plan:
    if scale not in ("lab", "full"):
        raise TableSpecError(f"--scale must be lab or full, got {scale!r}")
    if scale == "full" and not spec.experiment:
        raise TableSpecError(f"{spec.path}: --scale full needs `experiment:` naming a conf/experiment recipe")
    runs_root = Path(runs_root) if runs_root else ROOT / "outputs" / ("smoke/runs" if smoke else "tables")
    tables_root = Path(tables_root) if tables_root else ROOT / ("outputs/smoke/tables" if smoke else "tables")
    runs_dir = (runs_root / spec.name).resolve()
    base = list(spec.fixed) if scale == "lab" else [f"experiment={spec.experiment}"]
    if smoke:
        base = merge_overrides(base, SMOKE_OVERRIDES, spec.smoke)
    errors: list[str] = []
    extra = _check_overrides(list(extra), "extra overrides", errors)
    if errors:
        raise TableSpecError("\n  - ".join(["bad command-line overrides:"] + errors))
    base = merge_overrides(base, extra)
    variants = variant_overrides(spec, scale)
    warnings = []
    for o in extra:
        hit = [v.name for v, ov in variants if _key(o) in {_key(x) for x in ov}]
        if hit:
            warnings.append(f"the command-line override {o!r} replaces the value variant(s) {', '.join(hit)} set")
    if only:
        unknown = [o for o in only if o not in [v.name for v, _ in variants]]
        if unknown:
            raise TableSpecError(f"--variants {','.join(unknown)}: no such variant in {spec.path.name}; "
                                 f"variants: {', '.join(v.name for v, _ in variants)}")
        variants = [(v, o) for v, o in variants if v.name in only]
    seeds = list(seeds) if seeds else (spec.seeds[:1] if smoke else list(spec.seeds))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    group = f"table-{spec.name}{'-smoke' if smoke else ''}{'-full' if scale == 'full' else ''}-{stamp}"
    launcher_ov, env = [], {}
    if launcher and launcher != "basic":
        launcher_ov.append(f"hydra/launcher={launcher}")
        if launcher == "joblib":
            launcher_ov.append(f"hydra.launcher.n_jobs={jobs}")
            # Each job gets its share of the cores (torch would otherwise start one thread per core in
            # every worker and oversubscribe the machine).
            threads = str(max(1, (os.cpu_count() or 1) // max(jobs, 1)))
            env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    plan = Plan(spec, smoke, scale, runs_dir, (tables_root / spec.name).resolve(), group, variants, base,
                seeds, launcher_ov, [], env, warnings)
    cmd = [sys.executable, "-m", "grpo_lab.train", "-m"]
    if variants:
        cmd += [plan.searchpath_override(), f"+{VARIANT_GROUP}=" + ",".join(v.name for v, _ in variants)]
    cmd += [f"{k}={v}" for k, v in spec.sweep.items() if _key(k) not in {_key(o) for o in base}]
    cmd += base + ["seed=" + ",".join(str(s) for s in seeds), f"logger.group={group}",
                   f"hydra.sweep.dir={runs_dir}"] + launcher_ov
    plan.command = cmd
    return plan


def write_variant_files(plan: Plan) -> None:
    d = plan.variants_root / VARIANT_GROUP
    d.mkdir(parents=True, exist_ok=True)
    for v, overrides in plan.variants:
        (d / f"{v.name}.yaml").write_text(variant_yaml(v.name, overrides), encoding="utf-8")


def compose_jobs(plan: Plan, jobs: list[list[str]]):
    """Yield (job, finalized config or the exception composing it raised), from the same conf/ tree the
    trainer reads: the config each job would run and log."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import grpo_lab.train  # noqa: F401  (registers the schema and the run-name resolver)
    from grpo_lab.config import finalize

    extra = [plan.searchpath_override()] if plan.variants else []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for job in jobs:
            try:
                yield job, finalize(compose("config", overrides=extra + job + [f"logger.group={plan.group}"]))
            except Exception as e:  # Hydra composition errors, OmegaConf type errors
                yield job, e


def preflight(plan: Plan) -> int:
    """Compose and validate every job; raise TableSpecError naming each bad job and its errors."""
    from grpo_lab.config import validate

    write_variant_files(plan)
    problems, jobs = [], plan.jobs()
    for job, cfg in compose_jobs(plan, jobs):
        try:
            if isinstance(cfg, Exception):
                raise cfg
            validate(cfg)
        except Exception as e:  # ConfigError and the composition errors above
            problems.append(f"job `{' '.join(o for o in job if o not in plan.base)}`: {type(e).__name__}: {e}")
    if problems:
        raise TableSpecError(f"{len(problems)} of {len(jobs)} jobs of table {plan.spec.name!r} do not validate "
                             "(nothing was launched):\n  - " + "\n  - ".join(problems))
    return len(jobs)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


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


def _archive_previous(runs_dir: Path) -> Path | None:
    """Move an earlier run of this table aside (outputs/.../_archive/<name>-<time>) so rows never mix."""
    if not runs_dir.exists() or not any(runs_dir.iterdir()):
        return None
    stamp = dt.datetime.fromtimestamp(runs_dir.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
    dest = runs_dir.parent / "_archive" / f"{runs_dir.name}-{stamp}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(runs_dir), str(dest))
    return dest


def _run_logged(cmd: list[str], log: Path, env: dict[str, str]) -> int:
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
            f.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return proc.wait()


def prewarm(plan: Plan, log: Path) -> int:
    """Fill the warm-up cache one seed at a time before parallel jobs could race to build the same entry."""
    cmd = [sys.executable, "-m", "grpo_lab.train", "-m", *merge_overrides(plan.base, [
        "trainer.total_steps=0", "trainer.total_samples=null", "rollout=hf", "logger=none",
        "trainer.save_checkpoint=false"]), "seed=" + ",".join(str(s) for s in plan.seeds),
        f"hydra.sweep.dir={plan.runs_dir.parent / '_prewarm' / plan.spec.name}"]
    return _run_logged(cmd, log, {})


def matched_wall_time(runs: list, variant: str) -> float | None:
    """Mean over the variant's completed runs of the time spent in RL steps (sum of perf/step_time_s):
    the compute the SFT control gets. Evaluation and engine start-up are excluded on both sides."""
    totals = []
    for r in runs:
        if r.ok and r.override_map.get(VARIANT_GROUP) == variant:
            steps = [row["perf/step_time_s"] for row in r.metrics if row.get("perf/step_time_s") is not None]
            if steps:
                totals.append(math.fsum(steps))
    return math.fsum(totals) / len(totals) if totals else None


def run_sft_controls(plan: Plan, log: Path, wall_time: float) -> list[int]:
    sft = plan.spec.sft_control
    assert sft is not None
    codes = []
    # Spelled as Hydra's sweeper records a job's overrides (.hydra/overrides.yaml: `false` -> `False`),
    # so the control's recorded overrides match the RL runs' and only `variant` tells them apart.
    parser = _parser()
    base = []
    for o in plan.base:
        if not _key(o).startswith("hydra"):
            ov = parser.parse_override(o)
            base.append(f"{ov.get_key_element()}={ov.get_value_element_as_str()}")
    for i, seed in enumerate(plan.seeds):
        run_dir = plan.runs_dir / "sft_control" / f"{i}_sft_control_s{seed}"
        overrides = [f"+{VARIANT_GROUP}=sft_control", *base, f"seed={seed}", f"logger.group={plan.group}"]
        cmd = [sys.executable, str(ROOT / "scripts" / "sft_control.py"), "--wall-time", f"{wall_time:.3f}",
               "--evals", str(sft.evals), "--run-dir", str(run_dir), "--", *overrides]
        codes.append(_run_logged(cmd, log, plan.env))
    return codes


def unrecorded_jobs(runs_dir: Path) -> list[Path]:
    """Job dirs Hydra created whose trainer never wrote metrics or a summary (died before it started)."""
    out = []
    for hydra_dir in sorted(runs_dir.rglob(".hydra")):
        job = hydra_dir.parent
        if not (job / "summary.json").exists() and not (job / "metrics.jsonl").exists() and job != runs_dir:
            out.append(job)
    return out


# ---------------------------------------------------------------------------------------------
# Findings: what we found, next to what the paper found
# ---------------------------------------------------------------------------------------------


def _welch(a: list[float], b: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """(mean(a) − mean(b), half-width of its Welch t interval); half is nan with < 2 runs on a side."""
    from grpo_lab.report import t_ppf

    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    if len(a) < 2 or len(b) < 2:
        return ma - mb, math.nan
    va = math.fsum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = math.fsum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return ma - mb, 0.0
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return ma - mb, t_ppf(0.5 + confidence / 2, df) * se


def _pct(x: float) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:.1f}"


def group_variant(group) -> str | None:
    """The variant a row's runs share (also when rows are grouped by config keys), else None."""
    if VARIANT_GROUP in group.values:
        return group.values[VARIANT_GROUP]
    names = {r.override_map.get(VARIANT_GROUP) for r in group.runs}
    return names.pop() if len(names) == 1 else None


def findings(spec: TableSpec, groups: list, keys: list[str]) -> tuple[str, dict]:
    """Markdown "what we found" computed from the groups, and the numbers behind it."""
    from grpo_lab.report import mean_ci
    from grpo_lab.report.table import ACC, final_value

    rows = []
    for g in groups:
        accs = [v for v in (final_value(r, ACC) for r in g.runs_for_stats()) if v is not None]
        mean, half, n = mean_ci(accs)
        rows.append({"group": g, "label": g.label, "accs": accs, "mean": mean, "half": half, "n": n})
    scored = [r for r in rows if r["n"] > 0]
    if not scored:
        return ("**What we found:** no run completed, so there is nothing to compare (see the failed runs "
                "below).", {"best": None})
    paper = {v.name: v.paper for v in spec.variants if v.paper is not None}
    if spec.sft_control and spec.sft_control.paper:
        paper["sft_control"] = spec.sft_control.paper

    def is_base(r) -> bool:
        if spec.baseline is None:
            return False
        if "=" in spec.baseline:
            k, _, v = spec.baseline.partition("=")
            return r["group"].values.get(k) == v
        return group_variant(r["group"]) == spec.baseline

    base = next((r for r in scored if is_base(r)), scored[0])
    best = max(scored, key=lambda r: r["mean"])
    multi = all(r["n"] >= 2 for r in scored)
    lines = ["**What we found** (computed from the runs below: final greedy held-out accuracy, mean ± 95% CI "
             "over completed seeds; Δ = difference to the baseline row with its Welch 95% CI):", ""]
    with_paper = bool(paper)
    head = "| Row |" + ((" Paper" + (f" ({spec.paper_metric})" if spec.paper_metric else "") + " |") if with_paper
                       else "") + " Ours: final acc. (%) | Δ vs baseline (pp) | CI overlaps baseline |"
    lines += [head, "|---|" + ("---:|" if with_paper else "") + "---:|---:|---|"]
    for r in rows:
        name = group_variant(r["group"]) or r["label"]
        p = f" {paper.get(group_variant(r['group']) or '', '–')} |" if with_paper else ""
        if r["n"] == 0:
            lines.append(f"| {name} |{p} – (no completed run) | – | – |")
            continue
        ours = f"{_pct(r['mean'])} ± {_pct(r['half']) if r['n'] > 1 else 'n/a'} (n={r['n']})"
        if r is base:
            lines.append(f"| {name} (baseline) |{p} {ours} | 0 | – |")
            continue
        d, dh = _welch(r["accs"], base["accs"])
        overlap = "n/a (one seed)" if math.isnan(r["half"]) or math.isnan(base["half"]) else (
            "yes" if abs(r["mean"] - base["mean"]) <= r["half"] + base["half"] else "no")
        dtxt = f"{100 * d:+.1f}" + ("" if math.isnan(dh) else f" ± {100 * dh:.1f}")
        lines.append(f"| {name} |{p} {ours} | {dtxt} | {overlap} |")
    lines.append("")
    best_name = group_variant(best["group"]) or best["label"]
    base_name = group_variant(base["group"]) or base["label"]
    tied = [group_variant(r["group"]) or r["label"] for r in scored if r["mean"] == best["mean"]]
    summary = f"Best mean final accuracy: **{best_name}** ({_pct(best['mean'])}%)"
    if len(tied) > 1:
        summary = f"Best mean final accuracy: a tie at {_pct(best['mean'])}% between {', '.join(tied)}."
    elif best is not base:
        d, dh = _welch(best["accs"], base["accs"])
        if math.isnan(dh):
            summary += (f", {100 * d:+.1f} pp over the baseline {base_name}; with one seed per row there is no "
                        "confidence interval, so this ordering is not evidence of a difference.")
        elif abs(d) <= dh:
            summary += (f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name}: the 95% CI of the "
                        "difference includes 0, so at this scale and seed count we cannot tell them apart.")
        else:
            summary += f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name} (CI excludes 0)."
    else:
        summary += " — the baseline itself."
    numeric = {}
    for k, v in paper.items():
        try:
            numeric[k] = float(str(v).split()[0].rstrip("%"))
        except ValueError:
            pass
    if numeric:
        paper_best = max(numeric, key=numeric.get)
        agree = "is a tie" if len(tied) > 1 else ("agrees" if paper_best == best_name else "differs")
        summary += f" The paper's best row is **{paper_best}**; our best {agree}."
    if spec.cumulative and multi:
        steps = []
        for prev, cur in zip(scored, scored[1:]):
            d, dh = _welch(cur["accs"], prev["accs"])
            steps.append(f"{group_variant(prev['group'])} → {group_variant(cur['group'])} "
                         f"{100 * d:+.1f} ± {100 * dh:.1f}")
        summary += " Step-by-step change along the ladder (pp vs the previous rung): " + "; ".join(steps) + "."
    if not multi:
        summary += " (Some rows have a single completed seed: read differences as anecdotes.)"
    lines.append(summary)
    return "\n".join(lines), {"best": best_name, "baseline": base_name,
                              "rows": {group_variant(r["group"]) or r["label"]: r["mean"] for r in scored}}


def legend(plan: Plan) -> str:
    if not plan.variants:
        return ""
    lines = ["<details><summary>Variants (overrides of each row" + (", cumulative" if plan.spec.cumulative else "")
             + ")</summary>", "", "| Variant | Overrides |", "|---|---|"]
    for v, ov in plan.variants:
        own = v.full_overrides if plan.scale == "full" and v.full_overrides is not None else v.overrides
        shown = ("+ " if plan.spec.cumulative and v is not plan.variants[0][0] else "") + (
            " ".join(f"`{o}`" for o in own) or "(none)")
        lines.append(f"| {v.name} | {shown} |")
    if plan.spec.sft_control:
        lines.append(f"| sft_control | continued SFT from the same warm-up checkpoint for the wall time of "
                     f"`{plan.spec.sft_control.match}` (scripts/sft_control.py) |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def build(plan: Plan, *, header_extra: dict[str, str], launch_notes: list[str]) -> dict:
    from grpo_lab.report import build_report, group_runs, load_runs

    spec = plan.spec
    runs = load_runs([plan.runs_dir])
    # Rows differ by variant and sweep keys only; everything else every job shares (a spelling
    # difference in a shared override must not split a row).
    ignore = sorted({_key(o) for o in plan.base} | {"logger.group"})
    groups, keys = group_runs(runs, group_by=spec.group_by, ignore=ignore)
    found, numbers = findings(spec, groups, keys)
    notes = [f"**What the paper found.** {spec.paper_finding}", "", found]
    if spec.notes:
        notes += ["", f"**Setup and budget.** {spec.notes}"]
    if launch_notes:
        notes += ["", "**Launch notes.**", ""] + [f"- {n}" for n in launch_notes]
    lg = legend(plan)
    if lg:
        notes += ["", lg]
    header = {"notes": "\n".join(notes), **header_extra}
    title = spec.title + (" (SMOKE: tiny budgets, one seed; not a result)" if plan.smoke else "")
    result = build_report([plan.runs_dir], plan.out, group_by=spec.group_by, target=spec.target, x=spec.x,
                          title=title, header=header, columns=spec.columns, ignore=ignore)
    result["findings"] = numbers
    (plan.out.parent / f"{plan.out.name}_findings.json").write_text(json.dumps(numbers, indent=2, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    p.add_argument("--seeds", help="comma list overriding the table's seeds")
    p.add_argument("--variants", help="comma list: run only these variants")
    p.add_argument("--runs-root", type=Path, help="where run dirs go (default outputs/tables or outputs/smoke/runs)")
    p.add_argument("--tables-root", type=Path, help="where the table goes (default tables/ or outputs/smoke/tables)")
    p.add_argument("--report-only", action="store_true", help="rebuild the table from the runs on disk")
    p.add_argument("--dry-run", action="store_true", help="validate every job and print the command; launch nothing")
    args = p.parse_args(argv)

    try:
        spec = load_spec(args.table)
        plan = make_plan(spec, smoke=args.smoke, scale=args.scale, extra=extra, runs_root=args.runs_root,
                         tables_root=args.tables_root, launcher=args.launcher, jobs=args.jobs,
                         seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None,
                         only=args.variants.split(",") if args.variants else None)
    except TableSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env_prefix = " ".join(f"{k}={os.environ[k]}" for k in ("SMOKE", "LAUNCHER", "JOBS", "SCALE") if os.environ.get(k))
    invocation = (env_prefix + " " if env_prefix else "") + shlex.join(["python", "scripts/make_table.py", *argv]
                                                                       + (["--", *extra] if extra else []))
    header = {"command": invocation, "machine": machine_description()}
    launch_notes: list[str] = list(plan.warnings)
    for w in plan.warnings:
        print(f"[make_table] warning: {w}", file=sys.stderr)

    if args.report_only:
        if not plan.runs_dir.exists():
            print(f"error: {plan.runs_dir} does not exist: run the table first", file=sys.stderr)
            return 2
        meta = plan.runs_dir / "table_meta.json"
        if meta.exists():
            m = json.loads(meta.read_text())
            header.update({k: m[k] for k in ("command", "machine", "date") if k in m})
            launch_notes += m.get("launch_notes", [])
        result = build(plan, header_extra=header, launch_notes=launch_notes)
        print(result["table"])
        print(f"wrote {result['md']}", file=sys.stderr)
        return 0

    created = not plan.runs_dir.exists()
    if not args.dry_run:
        archived = _archive_previous(plan.runs_dir)
        if archived:
            print(f"[make_table] moved the previous runs of {spec.name} to {archived}", file=sys.stderr)
    try:
        n_jobs = preflight(plan)
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

    started = time.time()
    date = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    log = plan.runs_dir / "make_table.log"
    if any(o in plan.launcher for o in ("hydra/launcher=joblib", "hydra/launcher=submitit_local")):
        t0 = time.time()
        rc = prewarm(plan, log)
        launch_notes.append(f"warm-up cache filled serially before the parallel launch ({time.time() - t0:.0f} s, "
                            f"exit {rc})")
    rc = _run_logged(plan.command, log, plan.env)
    if rc != 0:
        launch_notes.append(f"the multirun exited with status {rc}: at least one job failed; every job of the "
                            "batch still ran (Hydra's launchers run the whole batch, then re-raise the first "
                            "failure). Failed runs are counted in each row and listed below.")
    if spec.sft_control:
        from grpo_lab.report import load_runs
        from grpo_lab.report.runs import NoRunsFound

        try:
            wall = matched_wall_time(load_runs([plan.runs_dir]), spec.sft_control.match)
        except NoRunsFound:
            wall = None
        how = f"mean summed RL step time of the completed `{spec.sft_control.match}` runs"
        if spec.sft_control.wall_time_s is not None:
            wall, how = spec.sft_control.wall_time_s, "sft_control.wall_time_s in the table yaml"
        if wall is None:
            launch_notes.append(f"SFT control skipped: no completed `{spec.sft_control.match}` run to match.")
        else:
            codes = run_sft_controls(plan, log, wall)
            launch_notes.append(f"SFT control: {wall:.1f} s of training per seed ({how}); exit codes {codes}.")
    for job in unrecorded_jobs(plan.runs_dir):
        launch_notes.append(f"job `{job.relative_to(plan.runs_dir)}` failed before the trainer wrote "
                            f"metrics.jsonl/summary.json (see {log.name} and the job's .hydra/ and *.log).")
    wall_s = time.time() - started
    header["date"] = f"{date}; wall time {wall_s / 60:.1f} min for {n_jobs} jobs" + (
        f" + {len(plan.seeds)} SFT controls" if spec.sft_control else "")
    (plan.runs_dir / "table_meta.json").write_text(json.dumps(
        {**header, "launch_notes": launch_notes, "wall_time_s": wall_s, "jobs": n_jobs, "exit_code": rc,
         "launch_command": plan.command}, indent=2))
    try:
        result = build(plan, header_extra=header, launch_notes=launch_notes)
    except Exception as e:  # e.g. no run dir at all: say so rather than a bare traceback
        print(f"error: could not build the table from {plan.runs_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(result["table"])
    for k in ("md", "csv", "png"):
        print(f"wrote {result[k]}", file=sys.stderr)
    print(f"[make_table] {spec.name}: {wall_s / 60:.1f} min, multirun exit status {rc}", file=sys.stderr)
    # The table was built; a failed job is reported in it, not by failing the make target. A multirun
    # that produced no completed run at all is still an error.
    n_ok = sum(g.n_ok for g in result["groups"])
    return 0 if n_ok else 1


if __name__ == "__main__":
    sys.exit(main())
