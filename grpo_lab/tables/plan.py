"""A table's plan: from a TableSpec to every job's overrides, the variant config files and one Hydra
multirun command; preflight composes and validates every job before anything is launched.

Named variants (`variants:`, e.g. the rungs of DAPO's ladder, each a *set* of overrides) become one
config file each, written to `<runs dir>/.variants/variant/<name>.yaml` (`# @package _global_`) and
swept as the config group `+variant=a,b,c` through `hydra.searchpath`. So variants, sweeps and seeds
are one cartesian product that any Hydra launcher (basic, joblib, submitit) runs, and each run's
.hydra/overrides.yaml says which variant it was.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo_lab.tables.spec import (CONF, ROOT, VARIANT_GROUP, TableSpec, TableSpecError, Variant, check_overrides,
                                  override_key, overrides_parser)

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


# Every job continues from its newest checkpoint when its directory holds one (a table launched again
# after it was stopped), and records its process while it runs (grpo_lab/tables/state.py). Neither
# changes what a job computes: `launch.jobs_but_seeds` leaves them out when comparing launches.
RESUME_KEYS = ("trainer.resume", "trainer.checkpoint_every")
OWNER_CALLBACK = "+hydra.callbacks.run_owner._target_=grpo_lab.tables.state.RunOwner"


def resume_overrides(spec: TableSpec, smoke: bool) -> list[str]:
    """trainer.resume=auto and the table's checkpoint interval (SMOKE: every step of its two)."""
    every = min(spec.checkpoint_every, 1) if smoke else spec.checkpoint_every
    return ["trainer.resume=auto", f"trainer.checkpoint_every={every}"]


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one in place."""
    out: dict[str, str] = {}
    for items in lists:
        for o in items:
            k = override_key(o)
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

    parser = overrides_parser()
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
    lines = ["# @package _global_", f"# variant {name!r}, written by scripts/make_table.py from: "
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
    base: list[str]            # fixed (or experiment=...) + every_scale + smoke + extra: every job's non-swept overrides
    seeds: list[int]
    launcher: list[str]
    command: list[str]
    env: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    # The sweep of this scale: spec.sweep less spec.lab_only_sweep at --scale full.
    sweep: dict[str, str] = field(default_factory=dict)
    # When the plan was made (also in `group`), and what is prepended to each job's directory name,
    # `<prefix><job num>_<run name>` (see `name_runs_apart`).
    stamp: str = ""
    run_dir_prefix: str = ""
    # Each job's run directory, in the order of `jobs()` (set by `preflight`).
    run_dirs: list[Path] = field(default_factory=list)

    @property
    def variants_root(self) -> Path:
        return self.runs_dir / ".variants"

    @property
    def block_keys(self) -> list[str]:
        """spec.within less the keys this scale does not sweep (a lab-only task at full scale: the
        recipe fixes it, one block)."""
        return [k for k in self.spec.within if k in self.sweep]

    @property
    def pinned_block(self) -> list[str]:
        """The block-key overrides an extra override pins (["task=partial_sums"] for `-- task=partial_sums`), or []."""
        keys = set(self.block_keys)
        return [o for o in self.base if override_key(o) in keys]

    def blocks(self) -> list[list[str]]:
        """The overrides of each block this launch runs, read off its jobs (e.g. [["task=gcd"], ["task=chain_sum"]],
        or [["task=gcd"]] when an extra override pins task=gcd); [[]] = one block."""
        out: list[list[str]] = []
        for job in self.jobs():
            by_key = {override_key(o): o for o in job}
            block = [by_key[override_key(k)] for k in self.block_keys]
            if block not in out:
                out.append(block)
        return out or [[]]

    def jobs(self) -> list[list[str]]:
        """Every job's task overrides, in the order Hydra's BasicSweeper runs them (seed varies fastest)."""
        axes: list[list[str]] = []
        if self.variants:
            axes.append([f"+{VARIANT_GROUP}={v.name}" for v, _ in self.variants])
        parser = overrides_parser()
        for k, v in self.sweep.items():
            if override_key(k) in {override_key(o) for o in self.base}:
                continue  # an extra override pinned this sweep key
            ov = parser.parse_override(f"{k}={v}")
            vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
            axes.append([f"{k}={x}" for x in vals])
        axes.append([f"seed={s}" for s in self.seeds])
        return [list(combo) + self.base for combo in itertools.product(*axes)]

    def name_runs_apart(self) -> None:
        """Give this launch's run directories a prefix of their own, `added-<stamp>_<job num>_<run name>`.

        For a launch that adds to a table's runs (--add-seeds, --add-rows): Hydra numbers its jobs from 0
        again, and a run's name holds only its variant and seed ("0_grpo_s3"), so without the prefix
        `--add-seeds 3 -- task=partial_sums` would land in the directory of an earlier `--add-seeds 3 --
        task=basic_arithmetic` launch's run (Hydra rewrites its overrides, the trainer refuses)."""
        self.run_dir_prefix = f"added-{self.stamp}_"
        self.command = [c for c in self.command if not c.startswith("hydra.sweep.subdir=")]
        self.command.append(f"hydra.sweep.subdir={self.run_dir_prefix}${{hydra.job.num}}_${{grpo_run_name:}}")

    def continue_launch(self, record: dict) -> None:
        """Take over a stopped launch's identity (grpo_lab/tables/state.py's launch record): its wandb
        group, its time stamp and so its run directories, so that its runs continue where they are."""
        self.group, self.stamp = record["group"], record["stamp"]
        self.command = [f"logger.group={self.group}" if c.startswith("logger.group=") else c for c in self.command]
        if record.get("run_dir_prefix"):
            self.name_runs_apart()

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
    base = merge_overrides(resume_overrides(spec, smoke),
                           list(spec.fixed) if scale == "lab" else [f"experiment={spec.experiment}"],
                           spec.every_scale)
    if smoke:
        base = merge_overrides(base, SMOKE_OVERRIDES, spec.smoke)
    errors: list[str] = []
    extra = check_overrides(list(extra), "extra overrides", errors)
    if errors:
        raise TableSpecError("\n  - ".join(["bad command-line overrides:"] + errors))
    base = merge_overrides(base, extra)
    variants = variant_overrides(spec, scale)
    warnings = []
    for o in extra:
        hit = [v.name for v, ov in variants if override_key(o) in {override_key(x) for x in ov}]
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
    sweep = {k: v for k, v in spec.sweep.items() if not (scale == "full" and k in spec.lab_only_sweep)}
    plan = Plan(spec, smoke, scale, runs_dir, (tables_root / spec.name).resolve(), group, variants, base,
                seeds, launcher_ov, [], env, warnings, sweep, stamp)
    cmd = [sys.executable, "-m", "grpo_lab.train", "-m"]
    if variants:
        cmd += [plan.searchpath_override(), f"+{VARIANT_GROUP}=" + ",".join(v.name for v, _ in variants)]
    cmd += [f"{k}={v}" for k, v in sweep.items() if override_key(k) not in {override_key(o) for o in base}]
    cmd += base + ["seed=" + ",".join(str(s) for s in seeds), f"logger.group={group}",
                   f"hydra.sweep.dir={runs_dir}", OWNER_CALLBACK] + launcher_ov
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

    from grpo_lab.config import finalize, register_configs

    register_configs()

    extra = [plan.searchpath_override()] if plan.variants else []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for job in jobs:
            try:
                yield job, finalize(compose("config", overrides=extra + job + [f"logger.group={plan.group}"]))
            except Exception as e:  # Hydra composition errors, OmegaConf type errors
                yield job, e


def preflight(plan: Plan, earlier_runs_move: bool = False, resuming: bool = False) -> int:
    """Compose and validate every job and set `plan.run_dirs`; raise TableSpecError naming each bad job
    and its errors. earlier_runs_move: the launch moves the table's earlier runs away before it starts
    (a first launch, archive_previous; also its --dry-run), so their directories are no obstacle;
    resuming: the launch continues a stopped one, whose directories are its own."""
    from grpo_lab.config import validate

    write_variant_files(plan)
    problems, jobs = [], plan.jobs()
    plan.run_dirs = []
    for num, (job, cfg) in enumerate(compose_jobs(plan, jobs)):
        try:
            if isinstance(cfg, Exception):
                raise cfg
            # Where Hydra will put it (conf/config.yaml's hydra.sweep.subdir, or the plan's own): an
            # earlier run there would be overwritten in part and refused by the trainer.
            run_dir = plan.runs_dir / f"{plan.run_dir_prefix}{num}_{cfg.run_name}"
            plan.run_dirs.append(run_dir)
            if run_dir.exists() and not (earlier_runs_move or resuming):
                raise TableSpecError(f"its run directory {run_dir} already exists (an earlier launch's run); "
                                     "move it away or add these runs in a launch of their own (--add-seeds, "
                                     "--add-rows name their directories apart)")
            # The values, not this machine: a full-scale table's jobs run on GPU machines (or Slurm
            # nodes); each job's own entry point checks the machine it lands on.
            validate(cfg, machine=False)
        except Exception as e:  # ConfigError and the composition errors above
            problems.append(f"job `{' '.join(o for o in job if o not in plan.base)}`: {type(e).__name__}: {e}")
    if problems:
        raise TableSpecError(f"{len(problems)} of {len(jobs)} jobs of table {plan.spec.name!r} do not validate "
                             "(nothing was launched):\n  - " + "\n  - ".join(problems))
    return len(jobs)

