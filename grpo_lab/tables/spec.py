"""Table specs: the typed schema of conf/table/*.yaml, and the loader that validates a file against it.

The schema is a dataclass registered in Hydra's ConfigStore (`register_table_schema`), as the run
schema is (grpo_lab.config): OmegaConf checks keys and types, and `load_spec` turns its errors into
messages that name the key and say what to change, then checks what types cannot say (override
syntax, keys make_table owns, variant names, a baseline that exists, ...). Every problem of a file is
reported at once (TableSpecError).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
TABLE_CONF = CONF / "table"
# Config group of the variant files make_table writes (`+variant=<name>` on every job).
VARIANT_GROUP = "variant"
# Keys make_table owns: set them through its options instead (trainer.checkpoint_every: the table's
# `checkpoint_every`; trainer.resume=auto is on every job, so that a stopped table continues).
RESERVED_KEYS = ("seed", VARIANT_GROUP, "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.searchpath", "logger.group",
                 "trainer.resume", "trainer.checkpoint_every")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")
SCHEMA_NAME = "table_schema"
# What a paper can claim for a row against the table's baseline row (accuracy higher, lower, equal).
DIRECTIONS = ("better", "worse", "same")


def selector_terms(selector: str) -> list[tuple[str, str | None]]:
    """A row selector (`baseline`, `paper_direction` keys) as (key, value) terms: "a.b=1 c=2" ->
    [("a.b", "1"), ("c", "2")]; a bare variant name -> [(name, None)]. A row matches when all terms do."""
    return [(k, v if eq else None) for k, eq, v in (t.partition("=") for t in selector.split())]


class TableSpecError(ValueError):
    """A conf/table/*.yaml that cannot work; the message lists every problem and what to change."""


@dataclass
class Variant:
    # Identifier used as the config name, the row label and the run-name prefix.
    name: str = MISSING
    # Overrides of this variant (lab scale); with `cumulative: true`, added to the previous variants'.
    overrides: list[str] = field(default_factory=list)
    # Overrides used instead at --scale full (default: `overrides`).
    full_overrides: Optional[list[str]] = None
    # The paper's number for this row (text, e.g. "36"), shown next to ours.
    paper: Optional[str] = None


@dataclass
class SFTControl:
    # Variant whose completed runs set the budget: mean over seeds of their summed step times.
    match: str = MISSING
    # Fixed budget in seconds instead (used when set, and as the fallback when no `match` run completed).
    wall_time_s: Optional[float] = None
    # Evaluations spread over the budget (as the RL runs' eval_every).
    evals: int = 3
    # The paper's / a previous measurement's number for this row.
    paper: Optional[str] = None


@dataclass
class Contrast:
    # A claim that compares rows of different blocks, e.g. "PPO's drop at p = 0.2 is smaller than GRPO's":
    # per seed, sum(coefficient × the row's final greedy accuracy) over `terms` (row selector -> coefficient,
    # selectors as `baseline`'s), optionally divided by the accuracy of the `relative_to` row (a relative
    # drop); then its mean and 95 % Student-t interval over the seeds every term completed.
    name: str = MISSING
    terms: dict[str, float] = field(default_factory=dict)
    # The claim's side of a threshold, "> 0" or "< -0.05": reproduced when the interval lies wholly on it,
    # contradicted when wholly on the other side, else not resolved.
    expect: str = MISSING
    relative_to: Optional[str] = None
    # The claim as it circulates, quoted next to the verdict.
    claim: str = ""
    # What the contrast is of: a report column of `columns` (e.g. steps_to_target, "mean:actor/log_ratio_std"),
    # per run, instead of the final greedy accuracy (null). A seed where a term's run has no value (a target
    # not reached, a metric not logged) leaves the contrast; the table says over how many seeds it ran.
    column: Optional[str] = None


@dataclass
class TableSpec:
    # Markdown title.
    title: str = MISSING
    # What the paper(s) found, with arXiv ids; printed in the header next to what we found.
    paper_finding: str = MISSING
    # Metric of the `paper` numbers (e.g. "AIME 2024 avg@32, %").
    paper_metric: str = ""
    # Free text under the findings: design choices, budget, known departures.
    notes: str = ""
    # conf/experiment/<name>.yaml: the paper-scale recipe used by --scale full instead of `fixed`.
    experiment: Optional[str] = None
    # Seeds every condition runs with.
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # Overrides for every job at lab scale (budgets, engine, ...); --scale full uses `experiment` instead.
    fixed: list[str] = field(default_factory=list)
    # Overrides for every job at every scale, after `fixed` (lab) or `experiment` (full): what makes the
    # rows what the table says they are, e.g. the reward noise all of them train under or the one
    # algorithm a table compares settings of. A setting put in `fixed` alone is lost at --scale full
    # (the noise table's full-scale rows were once written that way: they would have trained without noise).
    every_scale: list[str] = field(default_factory=list)
    # hydra.sweeper.params-style: key -> comma list (cartesian product); a YAML list is joined with commas.
    sweep: dict[str, Any] = field(default_factory=dict)
    # Sweep keys that apply at --scale lab only: the full-scale recipe (`experiment`) chooses its own
    # value, e.g. its task (a lab task sweep must not replace the recipe's MATH data).
    lab_only_sweep: list[str] = field(default_factory=list)
    # Named sets of overrides (rows), crossed with `sweep`.
    variants: list[Variant] = field(default_factory=list)
    # Ladder: each variant adds its overrides to the previous variants' (DAPO Table 1).
    cumulative: bool = False
    # Row to compare every other row with (a variant name, or "key=value" of a sweep); default: the first.
    baseline: Optional[str] = None
    # What the paper claims for a row against the baseline row: better, worse or same accuracy. Keys
    # select rows as `baseline` does, several space-separated terms all matching ("algorithm.clip_low=0.1
    # algorithm.epochs=1"). Rows without an entry take the direction of their numeric `paper` value
    # against the baseline's; the table then says per row whether ours reproduces it, with the interval.
    paper_direction: dict[str, str] = field(default_factory=dict)
    # Sweep keys that split the table into blocks, e.g. [task]: every row is compared with the baseline
    # row of its own block, and the SFT control runs once per block (its budget matched to that block's
    # runs, from that block's warm-up checkpoint).
    within: list[str] = field(default_factory=list)
    # Dotted config keys to group runs by; null = the overrides that vary (variant and sweep keys).
    group_by: Optional[list[str]] = None
    # Report columns (grpo_lab.report.table.COLUMNS or "<agg>:<metric>"); null = the report's default.
    columns: Optional[list[str]] = None
    # Accuracy (fraction) for the samples/steps-to-target column.
    target: Optional[float] = None
    # x axis of the curves and of the first-reach column: samples | step.
    x: str = "samples"
    # Extra overrides for SMOKE=1 (after the global smoke set).
    smoke: list[str] = field(default_factory=list)
    # Matched-compute SFT control row (grpo_lab.tables.sft_control), run after the sweep.
    sft_control: Optional[SFTControl] = None
    # Claims that compare rows across blocks (differences of differences), tested after the per-block findings.
    contrasts: list[Contrast] = field(default_factory=list)
    # Every job writes a resumable checkpoint each this many steps (trainer.checkpoint_every), so a
    # table stopped mid-run and launched again loses at most this many steps of each stopped run.
    # 0: none (a stopped run starts over).
    checkpoint_every: int = 10
    # Set by load_spec from the file, not keys of the file.
    name: str = ""
    path: Path = Path()


FILE_KEYS = [f.name for f in fields(TableSpec) if f.name not in ("name", "path")]
# What each typed key holds, for the message when a value has the wrong type.
EXPECTED = {
    "seeds": "a list of integers, e.g. [0, 1, 2]",
    "fixed": "a list of override strings, e.g. ['trainer.total_steps=150']",
    "every_scale": "a list of override strings, e.g. ['reward.noise.kind=flip']",
    "smoke": "a list of override strings, e.g. ['trainer.total_steps=2']",
    "sweep": "a mapping of config key -> comma list, e.g. {algorithm.clip_low: '0.1,0.2'}",
    "variants": "a list of {name, overrides, [full_overrides], [paper]}",
    "overrides": "a list of override strings, e.g. ['algorithm=dapo']",
    "full_overrides": "a list of override strings or null",
    "cumulative": "true or false",
    "group_by": "a list of dotted config keys or null",
    "within": "a list of sweep keys, e.g. [task]",
    "paper_direction": "a mapping of row (variant name or sweep key=value) -> better|worse|same",
    "lab_only_sweep": "a list of sweep keys, e.g. [task]",
    "columns": "a list of column names or null",
    "target": "an accuracy fraction in [0, 1], e.g. 0.65",
    "sft_control": "a mapping {match, [wall_time_s], [evals], [paper]}",
    "wall_time_s": "seconds (> 0) or null",
    "evals": "an integer >= 0",
    "checkpoint_every": "an integer >= 0 (steps between resumable checkpoints; 0 = none)",
    "contrasts": "a list of {name, terms: {row selector: coefficient}, expect: '> 0', [relative_to], [claim], [column]}",
    "terms": "a mapping of row selector -> coefficient, e.g. {'algorithm=ppo p0.2': 1, 'algorithm=ppo p0': -1}",
    "expect": "a side of a threshold, e.g. '> 0' or '< -0.05'",
}


def register_table_schema() -> None:
    """Store the table schema next to the run schema (grpo_lab.config.register_configs) in ConfigStore."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TableSpec)


def _schema():
    register_table_schema()
    return ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml").node


def _typed(node, key: str, value: Any, where: str, errors: list[str]) -> None:
    """Merge {key: value} into the structured `node`; a key or type error becomes one message naming the key."""
    try:
        node.merge_with({key: value})
    except ConfigKeyError as e:  # an unknown key inside a nested mapping (e.g. sft_control)
        valid = sorted(f.name for f in fields(e.object_type)) if e.object_type else []
        errors.append(f"{where}{key}: unknown key(s) {e.key}; valid: {', '.join(valid)}")
    except OmegaConfBaseException as e:
        full = str(e.full_key or key)
        full = full if full.startswith(key) else f"{key}.{full}"
        leaf = str(e.key) if e.key is not None else key
        want = EXPECTED.get(leaf) or EXPECTED.get(key) or "a value of the schema's type (grpo_lab/tables/spec.py)"
        why = e.msg.splitlines()[0]
        errors.append(f"`{where}{key}` must be {want}, got {value!r} ({why})" if full == key else
                      f"`{where}{full}`: {why}; `{where}{key}` must be {want}")


def override_key(override: str) -> str:
    """'+a.b=1' -> 'a.b' (the key an override sets, without Hydra's +/++/~ prefixes)."""
    return override.split("=", 1)[0].lstrip("+~")


def overrides_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def check_overrides(items: Any, where: str, errors: list[str], *, allow_sweep: bool = False) -> list[str]:
    """A list of single-valued Hydra overrides; syntax errors, sweeps and reserved keys are reported."""
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
        errors.append(f"{where} must be a list of override strings like 'trainer.total_steps=150', got {items!r}")
        return []
    parser = overrides_parser()
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
        if override_key(o) in RESERVED_KEYS:
            errors.append(f"{where}: {override_key(o)!r} is set by make_table.py (seeds: `seeds:`, variants: "
                          "`variants:`, checkpoints: `checkpoint_every:`, output dirs and wandb group: command-line "
                          "options); remove it")
    keys = [override_key(o) for o in items]
    dups = sorted({k for k in keys if keys.count(k) > 1})
    if dups:
        errors.append(f"{where}: {', '.join(dups)} set more than once")
    return list(items)


def _read(name_or_path: str | os.PathLike) -> tuple[Path, dict]:
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
        raise TableSpecError(f"{path}: the top level must be a mapping of the keys {', '.join(sorted(FILE_KEYS))}")
    return path, raw


def _plain(node) -> dict:
    # Unresolved: overrides and notes may hold ${...} meant for each run's config, not for this file.
    return OmegaConf.to_container(node, resolve=False)


def _typed_spec(raw: dict, errors: list[str]) -> TableSpec:
    """Keys and types, through the structured schema; each variant is checked on its own so that a
    message can say which one."""
    node = _schema()
    unknown = sorted(k for k in raw if k not in FILE_KEYS)
    if unknown:
        errors.append(f"unknown key(s) {', '.join(map(str, unknown))}; valid keys: {', '.join(sorted(FILE_KEYS))}")
    for k in FILE_KEYS:
        if k in raw and k != "variants":
            _typed(node, k, raw[k], "", errors)
    for k in ("title", "paper_finding"):
        if OmegaConf.is_missing(node, k):
            errors.append(f"`{k}` is required (text)")
            node[k] = ""
    if node.sft_control is not None and OmegaConf.is_missing(node.sft_control, "match"):
        node.sft_control.match = ""     # reported below: "sft_control.match must name a variant"
    variants = raw.get("variants") or []
    if not isinstance(variants, list):
        errors.append("`variants` must be a list of {name, overrides, [full_overrides], [paper]}")
        variants = []
    out = []
    for i, v in enumerate(variants):
        where = f"variants[{i}]"
        if not isinstance(v, dict):
            errors.append(f"{where} must be a mapping with name and overrides, got {v!r}")
            continue
        vnode = OmegaConf.structured(Variant)
        for k, val in v.items():
            if k not in Variant.__dataclass_fields__:
                errors.append(f"{where}: unknown key(s) {k}; valid: {', '.join(sorted(Variant.__dataclass_fields__))}")
            else:
                _typed(vnode, k, val, f"{where}.", errors)
        if OmegaConf.is_missing(vnode, "name"):
            errors.append(f"{where}: `name` is required (an identifier: letters, digits, _ . -)")
            vnode.name = f"variant{i}"
        out.append(vnode)   # also with errors (then with defaults), so that indices stay those of the file
    d = _plain(node)
    d["variants"] = [Variant(**_plain(v)) for v in out]
    d["sft_control"] = None if d["sft_control"] is None else SFTControl(**d["sft_control"])
    d["contrasts"] = [Contrast(**c) for c in d["contrasts"]]
    return TableSpec(**d)


def load_spec(name_or_path: str | os.PathLike) -> TableSpec:
    """Read and validate conf/table/<name>.yaml (or a path); raise TableSpecError listing every problem."""
    path, raw = _read(name_or_path)
    errors: list[str] = []
    spec = _typed_spec(raw, errors)
    spec.name, spec.path = path.stem, path
    _check_texts_and_seeds(raw, spec, errors)
    _check_fixed_and_sweep(spec, errors)
    names = _check_variants(spec, errors)
    _check_selectors(spec, names, errors)
    _check_report_keys(spec, errors)
    _check_sft_control(spec, names, errors)
    if errors:
        raise TableSpecError(f"{path}:\n  - " + "\n  - ".join(errors))
    return spec


def _check_texts_and_seeds(raw: dict, spec: TableSpec, errors: list[str]) -> None:
    """The required texts (stripped), the experiment file, the seeds and checkpoint_every."""
    for req in ("title", "paper_finding"):
        if isinstance(raw.get(req), str) and not raw[req].strip():
            errors.append(f"`{req}` is required (text)")
    spec.paper_finding, spec.paper_metric, spec.notes = (spec.paper_finding.strip(), spec.paper_metric.strip(),
                                                         spec.notes.strip())
    spec.experiment = spec.experiment.strip() if spec.experiment else spec.experiment
    if spec.experiment and not (CONF / "experiment" / f"{spec.experiment}.yaml").is_file():
        errors.append(f"experiment: conf/experiment/{spec.experiment}.yaml does not exist")
    if not spec.seeds:
        errors.append("`seeds` must be a non-empty list of integers, got []")
    elif len(set(spec.seeds)) != len(spec.seeds):
        errors.append(f"`seeds` repeats a seed: {spec.seeds}")

    if spec.checkpoint_every < 0:
        errors.append(f"`checkpoint_every` must be {EXPECTED['checkpoint_every']}, got {spec.checkpoint_every}")


def _check_fixed_and_sweep(spec: TableSpec, errors: list[str]) -> None:
    """The fixed, every_scale and smoke overrides; the sweep, each key's values made one comma list."""
    check_overrides(spec.fixed, "fixed", errors)
    check_overrides(spec.every_scale, "every_scale", errors)
    both = sorted({override_key(o) for o in spec.fixed} & {override_key(o) for o in spec.every_scale})
    if both:
        errors.append(f"{', '.join(both)} set in both `fixed` and `every_scale`; keep it in `every_scale` (every "
                      "scale) or in `fixed` (lab scale only)")
    check_overrides(spec.smoke, "smoke", errors)
    sweep = {}
    for k, v in spec.sweep.items():
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            errors.append(f"sweep.{k}: give a comma list like '0.1,0.2,0.3', got {v!r}")
            continue
        sweep[str(k)] = str(v)
        check_overrides([f"{k}={v}"], f"sweep.{k}", errors, allow_sweep=True)
    spec.sweep = sweep


def _check_variants(spec: TableSpec, errors: list[str]) -> list[str]:
    """The variants' names and overrides, and no key set both by a variant and on the command line;
    the variant names."""
    for i, v in enumerate(spec.variants):
        if not NAME_RE.match(v.name):
            errors.append(f"variants[{i}]: name must be an identifier (letters, digits, _ . -), got {v.name!r}")
            v.name = f"variant{i}"
        where = f"variants[{v.name}]"
        check_overrides(v.overrides, f"{where}.overrides", errors)
        check_overrides(v.full_overrides, f"{where}.full_overrides", errors)
        for o in v.overrides + (v.full_overrides or []):
            if o.startswith("hydra") or override_key(o).startswith("hydra"):
                errors.append(f"{where}: {o!r}: hydra settings cannot differ between variants")
    names = [v.name for v in spec.variants]
    if len(set(names)) != len(names):
        errors.append(f"variant names must be unique: {names}")
    if not spec.variants and not spec.sweep:
        errors.append("a table needs `variants:` or `sweep:` (or both): there is nothing to compare")

    # A key both on the command line (fixed/every_scale/sweep) and in a variant file: the command line
    # would win silently and the variant would not be what its name says.
    fixed_keys = {override_key(o) for o in spec.fixed + spec.every_scale}
    for v in spec.variants:
        for o in v.overrides + (v.full_overrides or []):
            if override_key(o) in fixed_keys | set(spec.sweep):
                errors.append(f"variants[{v.name}] sets {override_key(o)!r}, which `fixed`/`every_scale`/`sweep` "
                              "also set; the command line would override the variant. Set it in every variant (or "
                              "in the first one of a cumulative ladder) instead of in `fixed`/`every_scale`")
    for k in spec.sweep:
        if override_key(k) in fixed_keys:
            errors.append(f"sweep key {k!r} is also in `fixed`/`every_scale`; remove one")
    return names


def _check_selectors(spec: TableSpec, names: list[str], errors: list[str]) -> None:
    """The baseline and every paper_direction selector name a variant or a sweep value."""
    b = spec.baseline
    if b is not None and "=" not in b and b not in names and b != "sft_control":
        errors.append(f"baseline {b!r} is not a variant; variants: {', '.join(names)}")
    for sel, direction in spec.paper_direction.items():
        if direction not in DIRECTIONS:
            errors.append(f"paper_direction[{sel!r}] must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        _check_selector(spec, names, sel, "paper_direction", errors)
    for i, c in enumerate(spec.contrasts):
        where = f"contrasts[{i}] ({c.name})"
        if not c.terms:
            errors.append(f"{where}: `terms` is empty; give row selector -> coefficient, e.g. "
                          "{'algorithm=ppo p0.2': 1, 'algorithm=ppo p0': -1}")
        for sel in [*c.terms, *([c.relative_to] if c.relative_to else [])]:
            _check_selector(spec, names, sel, where, errors)
        if parse_expect(c.expect) is None:
            errors.append(f"{where}: expect={c.expect!r} must be a side of a threshold, e.g. '> 0' or '< -0.05'")
        if c.column is not None and c.column not in (spec.columns or []):
            # A column outside `columns` would be missing from the table's record, so a rebuild could not say it.
            errors.append(f"{where}: column={c.column!r} must also be one of `columns`, so that the table and "
                          f"its record carry it; add it to `columns` (or drop `column` to contrast final accuracy)")


def _check_selector(spec: TableSpec, names: list[str], sel: str, where: str, errors: list[str]) -> None:
    """Each term of a row selector names a variant or a swept key=value."""
    for k, v in selector_terms(sel):
        if v is None and k not in names:
            errors.append(f"{where}: {k!r} is not a variant; variants: {', '.join(names) or '(none)'}")
        elif v is not None and v not in spec.sweep.get(k, "").split(","):
            errors.append(f"{where}: {f'{k}={v}'!r} selects no row; sweep values: "
                          + (", ".join(f"{sk}={sv}" for sk, sv in spec.sweep.items()) or "(no sweep)"))


def parse_expect(text: str) -> tuple[str, float] | None:
    """'> 0' -> ('>', 0.0); '< -0.05' -> ('<', -0.05); anything else -> None."""
    m = re.fullmatch(r"\s*([<>])\s*(-?\d+(?:\.\d+)?)\s*", str(text))
    return (m.group(1), float(m.group(2))) if m else None


def _check_report_keys(spec: TableSpec, errors: list[str]) -> None:
    """group_by, columns, target, x, and the lab_only_sweep and within keys."""
    if spec.group_by is not None and not spec.group_by:
        errors.append("`group_by` must be a non-empty list of dotted config keys or null, got []")
    if spec.columns is not None:
        from grpo_lab.report.table import resolve_column

        if not spec.columns:
            errors.append("`columns` must be a non-empty list, got []")
        for c in spec.columns:
            try:
                resolve_column(c)
            except ValueError as e:
                errors.append(f"columns: {e}")
    if spec.target is not None and not 0.0 <= spec.target <= 1.0:
        errors.append(f"`target` is an accuracy fraction in [0, 1] (e.g. 0.65), got {spec.target!r}")
    if spec.x not in ("samples", "step"):
        errors.append(f"`x` must be samples or step, got {spec.x!r}")
    for k in spec.lab_only_sweep:
        if k not in spec.sweep:
            errors.append(f"lab_only_sweep: {k!r} is not a sweep key; sweep keys: {', '.join(spec.sweep) or '(none)'}")
    for k in spec.within:
        if k not in spec.sweep:
            errors.append(f"within: {k!r} is not a sweep key; sweep keys: {', '.join(spec.sweep) or '(none)'}")
        elif spec.group_by is not None and k not in spec.group_by:
            errors.append(f"within: {k!r} must also be in group_by, or rows of different blocks would merge")


def _check_sft_control(spec: TableSpec, names: list[str], errors: list[str]) -> None:
    """The matched-compute SFT control names a variant and has a positive budget."""
    sft = spec.sft_control
    if sft is not None:
        if sft.match not in names:
            errors.append(f"sft_control.match must name a variant whose runs set the wall-time budget; "
                          f"got {sft.match!r}, variants: {', '.join(names)}")
        if sft.wall_time_s is not None and sft.wall_time_s <= 0:
            errors.append(f"sft_control.wall_time_s must be > 0 seconds or null, got {sft.wall_time_s!r}")
        if sft.evals < 0:
            errors.append(f"sft_control.evals must be an integer >= 0, got {sft.evals!r}")
