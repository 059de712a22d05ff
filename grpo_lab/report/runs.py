"""Find and load run directories, and group them into experimental conditions.

A run directory (written by the trainer) is any directory holding `summary.json` or
`metrics.jsonl`:

    config.yaml            fully resolved config
    .hydra/overrides.yaml  this job's command-line overrides (may be absent)
    metrics.jsonl          one JSON object per logged step (may be partial if the run crashed)
    summary.json           {"status", "error", "run_name", "overrides", "initial", "final", ...}

Only local files are read, so reports work with wandb off.

Status of a run:
    "completed"   summary.json says so
    "failed"      summary.json says "failed" (the trainer caught the error and wrote it down)
    "incomplete"  metrics.jsonl but no summary.json: the process died without cleanup (OOM kill,
                  preemption) or is still running. Reported, never silently dropped.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMPLETED, FAILED, INCOMPLETE = "completed", "failed", "incomplete"

# Overrides that never define an experimental condition: seeds are what we average over, and
# hydra.* only says where outputs go.
ALWAYS_IGNORED = ("seed",)
MISSING = "(default)"  # label value for a run that did not set an override others did


class NoRunsFound(ValueError):
    """Raised when the given paths contain no run directory."""


@dataclass
class Run:
    """One training run, as read from its directory."""

    path: Path
    # fully resolved config.yaml ({} if absent or unreadable)
    config: dict[str, Any]
    # Hydra overrides of this job, e.g. ["algorithm=dapo", "seed=1"]
    overrides: list[str]
    # metrics.jsonl, one dict per line, in file order
    metrics: list[dict[str, Any]]
    # summary.json (None for an incomplete run)
    summary: dict[str, Any] | None
    # "completed" | "failed" | "incomplete"
    status: str
    # problems met while reading (unparsable lines, unreadable files); shown in the report
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.summary and self.summary.get("run_name"):
            return str(self.summary["run_name"])
        if self.config.get("run_name"):  # an incomplete run has no summary, but its config names it
            return str(self.config["run_name"])
        # a Hydra multirun job dir is just a number; its sweep dir name makes it findable
        if self.path.name.isdigit():
            return f"{self.path.parent.name}/{self.path.name}"
        return self.path.name

    @property
    def error(self) -> str | None:
        if self.status == INCOMPLETE:
            return "no summary.json: the run crashed without cleanup or is still running"
        return (self.summary or {}).get("error")

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED

    @property
    def warmup(self) -> dict[str, Any]:
        """The run's warm-up as its summary records it: steps, digest (of the weights it began from), inputs
        (the key of what built it: model, task, warm-up settings, seed); {} when it had none or ran before
        they were recorded."""
        return dict((self.summary or {}).get("warmup") or {})

    @property
    def override_map(self) -> dict[str, str]:
        """Overrides as {key: value}; Hydra's +key / ++key / ~key prefixes are stripped."""
        out = {}
        for item in self.overrides:
            key, _, value = str(item).partition("=")
            if key.startswith("~"):  # deletion override: no value
                key, value = key[1:], "~deleted"
            out[key.lstrip("+")] = value
        return out

    def config_get(self, dotted: str, default: Any = None) -> Any:
        """Look up a dotted key ("rollout.group_size") in the resolved config."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def seed(self) -> Any:
        return self.config_get("seed", self.override_map.get("seed"))

    @property
    def recorded(self) -> dict[str, Any] | None:
        """Per-column values of a run restored from a committed table record (grpo_lab/tables/record.py):
        its directory holds no metrics, only what the table's runs CSV said. None for a real run."""
        rec = (self.summary or {}).get("recorded")
        return rec if isinstance(rec, dict) else None


def project_roots(project: Path) -> tuple[tuple[Path, Path], ...]:
    """(absolute prefix, the relative path it is shown as) for the places project paths live: the project
    itself, and its outputs/ resolved, which lies elsewhere when outputs/ is a link (a second worktree
    sharing the first one's runs)."""
    return ((project.resolve(), Path()), ((project / "outputs").resolve(), Path("outputs")))


def display_path(path: str | os.PathLike) -> str:
    """`path` relative to the working directory (the project, for make targets) when it lies inside it,
    so committed tables name project paths, not one machine's absolute ones; runs under a linked outputs/
    are named outputs/... too."""
    p = Path(path).resolve()
    for root, shown in project_roots(Path.cwd()):
        try:
            return str(shown / p.relative_to(root))
        except ValueError:
            continue
    return str(path)


def _natural_key(path: Path) -> list:
    """Sort sweep job dirs 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", str(path))]


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """All run directories under the given paths (directories or glob patterns), searched recursively.

    The search does not descend into a run directory once found: run dirs hold checkpoints and
    wandb files that can number in the thousands, and never hold other runs.
    """
    roots: list[Path] = []
    for p in paths:
        p = str(p)
        if glob.has_magic(p):
            roots.extend(Path(m) for m in sorted(glob.glob(p, recursive=True)))
        else:
            roots.append(Path(p))
    found: dict[Path, Path] = {}  # resolved -> as given; a run matched by two patterns counts once
    for root in roots:
        if root.is_file():  # e.g. a glob over .../summary.json
            root = root.parent
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            if "summary.json" in filenames or "metrics.jsonl" in filenames:
                found.setdefault(Path(dirpath).resolve(), Path(dirpath))
                dirnames.clear()
                continue
            # skip hidden dirs (.hydra, .git) and wandb's own tree
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "wandb")
    return sorted(found.values(), key=_natural_key)


def _read_jsonl(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    rows = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)  # accepts NaN / Infinity, which Python's json writes
            except json.JSONDecodeError:
                bad += 1  # typically the half-written last line of a killed run
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    if bad:
        warnings.append(f"{path.name}: skipped {bad} unparsable line(s)")
    return rows


def load_run(path: str | os.PathLike) -> Run:
    """Read one run directory. Never raises on missing or malformed files; see `Run.warnings`."""
    path = Path(path)
    warnings: list[str] = []

    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
        except (ValueError, OSError) as e:
            warnings.append(f"summary.json unreadable ({e}); treating the run as incomplete")
            summary = None

    config: dict[str, Any] = {}
    if (path / "config.yaml").is_file():
        try:
            config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
            if not isinstance(config, dict):
                raise ValueError("not a mapping")
        except (yaml.YAMLError, ValueError, OSError) as e:
            warnings.append(f"config.yaml unreadable ({e})")
            config = {}

    # overrides.yaml is Hydra's own record; summary["overrides"] is the trainer's copy of it
    overrides: list[str] = []
    hydra_overrides = path / ".hydra" / "overrides.yaml"
    if hydra_overrides.is_file():
        try:
            overrides = [str(o) for o in (yaml.safe_load(hydra_overrides.read_text()) or [])]
        except (yaml.YAMLError, OSError, TypeError) as e:
            warnings.append(f".hydra/overrides.yaml unreadable ({e})")
    elif summary and isinstance(summary.get("overrides"), list):
        overrides = [str(o) for o in summary["overrides"]]

    metrics = []
    if (path / "metrics.jsonl").is_file():
        metrics = _read_jsonl(path / "metrics.jsonl", warnings)

    if summary is None:
        status = INCOMPLETE
    else:
        status = str(summary.get("status") or FAILED)
        if status not in (COMPLETED, FAILED):
            warnings.append(f"unknown status {status!r} in summary.json; counted as failed")
            status = FAILED
    return Run(path, config, overrides, metrics, summary, status, warnings)


def load_runs(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Run]:
    """Load every run under `paths`. Raises NoRunsFound with a hint if there is none."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    dirs = find_run_dirs(paths)
    if not dirs:
        missing = [str(p) for p in paths if not glob.has_magic(str(p)) and not Path(p).exists()]
        where = ", ".join(str(p) for p in paths) or "(no paths given)"
        hint = f" ({', '.join(missing)} does not exist)" if missing else ""
        raise NoRunsFound(
            f"no run directories found under {where}{hint}. A run directory contains summary.json "
            "or metrics.jsonl; pass a sweep directory (e.g. multirun/<date>/<time>), a run "
            "directory, or a quoted glob such as 'outputs/*/*'."
        )
    return [load_run(d) for d in dirs]


# ---------------------------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------------------------


def varying_override_keys(runs: Sequence[Run], ignore: Iterable[str] = ()) -> list[str]:
    """Override keys whose value differs between runs (a key set in some runs only counts too).

    Keys are returned in order of first appearance, which follows how the sweep was written.
    `seed` and hydra.* are always excluded: seeds are what we average over.
    """
    ignored = set(ALWAYS_IGNORED) | set(ignore)
    keys: list[str] = []
    for run in runs:
        for k in run.override_map:
            if k not in keys and k not in ignored and not k.startswith("hydra."):
                keys.append(k)
    return [k for k in keys if len({run.override_map.get(k, MISSING) for run in runs}) > 1]


def _format_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def group_value(run: Run, key: str, source: str) -> str:
    """Value of `key` for one run: from its overrides (source="overrides") or config.yaml."""
    if source == "overrides":
        return run.override_map.get(key, MISSING)
    value = run.config_get(key, None)
    if isinstance(value, dict):
        # a config *group* such as `algorithm` resolves to a mapping; the user means its choice,
        # which is what the override says, or failing that the group's `name` field
        if key in run.override_map:
            return run.override_map[key]
        if "name" in value:
            return _format_value(value["name"])
    if value is None:
        return run.override_map.get(key, "(missing)")
    return _format_value(value)


@dataclass
class Group:
    """Runs of one experimental condition (same settings, different seeds)."""

    label: str
    # {key: value} for the grouping keys, e.g. {"algorithm": "dapo", "rollout.group_size": "8"}
    values: dict[str, str]
    runs: list[Run]

    def runs_for_stats(self, include_incomplete: bool = False) -> list[Run]:
        """Runs whose metrics enter means: completed ones (optionally also incomplete ones)."""
        ok = {COMPLETED, INCOMPLETE} if include_incomplete else {COMPLETED}
        return [r for r in self.runs if r.status in ok]

    @property
    def n_ok(self) -> int:
        return sum(r.status == COMPLETED for r in self.runs)

    @property
    def n_failed(self) -> int:
        return sum(r.status == FAILED for r in self.runs)

    @property
    def n_incomplete(self) -> int:
        return sum(r.status == INCOMPLETE for r in self.runs)


def group_runs(
    runs: Sequence[Run],
    group_by: Sequence[str] | None = None,
    ignore: Iterable[str] = (),
) -> tuple[list[Group], list[str]]:
    """Split runs into groups that differ only by seed.

    Args:
        group_by: dotted config keys to group by (looked up in config.yaml). None: group by the
            override keys that vary across `runs`, excluding seed and `ignore`.
        ignore: override keys to leave out of automatic grouping (e.g. a run-name override).
    Returns:
        (groups in order of first appearance, the grouping keys used)
    """
    if group_by:
        keys, source = list(group_by), "config"
    else:
        keys, source = varying_override_keys(runs, ignore), "overrides"
    groups: dict[tuple[str, ...], Group] = {}
    for run in runs:
        values = {k: group_value(run, k, source) for k in keys}
        sig = tuple(values.values())
        if sig not in groups:
            label = ", ".join(f"{k}={v}" for k, v in values.items()) or _common_label(runs, ignore)
            groups[sig] = Group(label, values, [])
        groups[sig].runs.append(run)
    return list(groups.values()), keys


def _common_label(runs: Sequence[Run], ignore: Iterable[str]) -> str:
    """Label for a single group: the overrides all runs share, or "(default config)"."""
    ignored = set(ALWAYS_IGNORED) | set(ignore)
    shared = [
        f"{k}={v}"
        for k, v in runs[0].override_map.items()
        if k not in ignored and not k.startswith("hydra.")
    ]
    return ", ".join(shared) or "(default config)"
