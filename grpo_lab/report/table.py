"""Paper tables: one row per group, each cell mean ± 95 % CI over seeds; markdown and CSV.

Every column is a function Run -> number (or None when the run did not log what it needs).
Cells aggregate those numbers over the group's completed runs with `stats.mean_ci`. A missing
metric makes a cell "–"; it never raises, because one odd run must not cost the whole table.

Failed and incomplete runs are excluded from the means (their "final" accuracy is not a final
accuracy) but are counted in every row ("3 ok / 1 failed") and listed with their errors.

Columns are chosen by name (see COLUMNS and `default_columns`), plus generic ones written as
"<agg>:<metric>" with agg in last | mean | max | min, e.g. "last:actor/clip_frac_high".
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .runs import Group, Run, display_path
from .stats import first_reach, mean_ci

ACC = "eval/accuracy"
# mean@k at the rollout temperature (trainer.eval_sampled_k > 0; DAPO reports avg@32)
SAMPLED_ACC = "eval/sampled_accuracy"
DASH = "–"  # en dash: the cell has no data


# ---------------------------------------------------------------------------------------------
# Reading one number from one run
# ---------------------------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    """A metric value as float, or None if absent / not a number (bools count as numbers)."""
    if v is None or isinstance(v, str):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def series(run: Run, metric: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of `metric` over the run's metrics lines that contain it, x in {"step", "samples"}.

    If a line has the metric but not the x key (e.g. an eval line that only logs "step"), x is
    taken from another line with the same step.
    """
    x_by_step: dict[Any, float] = {}
    for row in run.metrics:
        if x in row and "step" in row and _num(row[x]) is not None:
            x_by_step.setdefault(row["step"], float(row[x]))
    xs, ys = [], []
    for row in run.metrics:
        y = _num(row.get(metric))
        if y is None:
            continue
        xv = _num(row.get(x))
        if xv is None:
            xv = x_by_step.get(row.get("step"))
        if xv is None:
            continue
        xs.append(xv)
        ys.append(y)
    return xs, ys


def _values(run: Run, metric: str) -> list[float]:
    return [v for v in (_num(row.get(metric)) for row in run.metrics) if v is not None]


def final_value(run: Run, metric: str) -> float | None:
    """summary.json "final" if the trainer wrote it there, else the metric's last logged value.

    "Last logged" means the last line that has the key, even when its value is null (the logger
    writes non-finite values as null): a run whose entropy ended as NaN has no final entropy,
    rather than silently reporting the value from before it diverged.
    """
    v = _num(((run.summary or {}).get("final") or {}).get(metric))
    if v is not None:
        return v
    for row in reversed(run.metrics):
        if metric in row:
            return _num(row[metric])
    return None


def initial_value(run: Run, metric: str) -> float | None:
    """summary.json "initial", else the value logged at step 0 (the pre-RL evaluation).

    A first evaluation at a later step is not an initial value, so it is not used.
    """
    v = _num(((run.summary or {}).get("initial") or {}).get(metric))
    if v is not None:
        return v
    for row in run.metrics:
        if row.get("step") == 0 and _num(row.get(metric)) is not None:
            return _num(row[metric])
    return None


def _mean_of(run: Run, metric: str) -> float | None:
    vals = _values(run, metric)
    return math.fsum(vals) / len(vals) if vals else None


def _sum_of(run: Run, metric: str, scale: float = 1.0) -> float | None:
    vals = _values(run, metric)
    return math.fsum(vals) * scale if vals else None


def _max_of(run: Run, metric: str) -> float | None:
    vals = _values(run, metric)
    return max(vals) if vals else None


def _min_of(run: Run, metric: str) -> float | None:
    vals = _values(run, metric)
    return min(vals) if vals else None


def _peak_step(run: Run) -> float | None:
    """The step of the best held-out (gold) accuracy, the first such step on a tie."""
    xs, ys = series(run, ACC, "step")
    return xs[ys.index(max(ys))] if ys else None


def _kl_at_peak(run: Run) -> float | None:
    """KL(π || π_ref) of the step's samples (kl_ref/seq) at the gold peak; 0 when the peak is the evaluation
    before training (the policy is the reference then); None when the run logged no KL."""
    step = _peak_step(run)
    if step is None or not any("kl_ref/seq" in row for row in run.metrics):
        return None
    if step == 0:
        return 0.0
    return next((_num(row["kl_ref/seq"]) for row in run.metrics if row.get("step") == step and "kl_ref/seq" in row),
                None)


def _reward_model_accuracy(run: Run) -> float | None:
    """The held-out pairwise accuracy of the run's learned reward model (an ensemble's: its members' mean);
    None when its reward is not learned."""
    prepared = (run.summary or {}).get("prepared_rewards") or {}
    return _num((prepared.get("reward_model") or {}).get("held_out_accuracy"))


def _gain(run: Run) -> float | None:
    final, initial = final_value(run, ACC), initial_value(run, ACC)
    return None if final is None or initial is None else final - initial


def _drop_from_best(run: Run) -> float | None:
    """Best held-out accuracy of the run minus its final one (>= 0): how much it lost by the end, the
    collapse that GSPO's, SAPO's and DPPO's papers report their baselines suffer."""
    best, final = _max_of(run, ACC), final_value(run, ACC)
    return None if best is None or final is None else best - final


# ---------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What a column needs besides the run: the caller's target accuracy and x axis."""

    target: float | None = None
    x: str = "samples"


@dataclass(frozen=True)
class Column:
    # key in `columns=` lists and prefix of the CSV columns
    name: str
    # markdown header; "{target}" is replaced by the target accuracy in percent
    header: str
    # per-run value; None = this run cannot say (metric not logged / target not reached)
    value: Callable[[Run, Context], float | None]
    # how to print it: pct (fraction as %), pp (difference of fractions, signed), count, float
    fmt: str = "float"
    # first-reach columns name their x ("samples" / "step"): None from a run then means "did not
    # reach the target", and the cell says how many seeds did
    reach_x: str | None = None


def _reach(x: str) -> Callable[[Run, Context], float | None]:
    def value(run: Run, ctx: Context) -> float | None:
        if ctx.target is None:
            return None
        xs, ys = series(run, ACC, x)
        return first_reach(xs, ys, ctx.target)

    return value


COLUMNS: dict[str, Column] = {
    c.name: c
    for c in [
        Column("final_acc", "Final acc. (%)", lambda r, c: final_value(r, ACC), "pct"),
        Column("best_acc", "Best acc. (%)", lambda r, c: _max_of(r, ACC), "pct"),
        # mean@k at the rollout temperature (trainer.eval_sampled_k > 0); "–" where it was not measured
        Column("final_sampled_acc", "Final mean@k (%)", lambda r, c: final_value(r, SAMPLED_ACC), "pct"),
        Column("gain", "Gain (pp)", lambda r, c: _gain(r), "pp"),
        Column("drop_from_best", "Drop from best (pp)", lambda r, c: _drop_from_best(r), "pp"),
        Column("samples_to_target", "Samples to {target}", _reach("samples"), "count", "samples"),
        Column("steps_to_target", "Steps to {target}", _reach("step"), "count", "step"),
        Column("step_time", "Time/step (s)", lambda r, c: _mean_of(r, "perf/step_time_s")),
        Column(
            "zero_adv_frac",
            "Zero-adv. groups (%)",
            lambda r, c: _mean_of(r, "rollout/zero_adv_group_frac"),
            "pct",
        ),
        Column("final_entropy", "Final entropy", lambda r, c: final_value(r, "actor/entropy")),
        # Over-optimisation (Gao et al., arXiv 2210.10760): where the gold accuracy peaks, and how far from the
        # reference the policy had moved by then.
        Column("steps_to_peak", "Steps to peak", lambda r, c: _peak_step(r), "count"),
        Column("kl_at_peak", "KL at peak (nats)", lambda r, c: _kl_at_peak(r)),
        # The learned reward's quality, the axis such a table varies: the reward model's pairwise accuracy on
        # held-out preferences, as the run that trained (or found) it recorded it in summary.json.
        Column("rm_accuracy", "RM held-out acc. (%)", lambda r, c: _reward_model_accuracy(r), "pct"),
        Column(
            "wrong_len",
            "Wrong-answer len.",
            lambda r, c: final_value(r, "eval/wrong_len_mean"),
            "count",
        ),
        Column("steps", "Steps", lambda r, c: _num((r.summary or {}).get("steps")), "count"),
        # The run's own work, the sum of its step times: unlike wall time it leaves out evaluations,
        # start-up and the waits of a run stopped and resumed (a resumed run logs each step once).
        Column("compute_time_min", "Compute (min)", lambda r, c: _sum_of(r, "perf/step_time_s", scale=1 / 60)),
        Column(
            "wall_time_min",
            "Wall time (min)",
            lambda r, c: (
                None
                if _num((r.summary or {}).get("wall_time_s")) is None
                else _num(r.summary["wall_time_s"]) / 60.0
            ),
        ),
    ]
}

_GENERIC = {"last": final_value, "mean": _mean_of, "max": _max_of, "min": _min_of}


def default_columns(target: float | None = None, x: str = "samples") -> list[str]:
    """The paper-table default; the first-reach column only when a target is given."""
    cols = ["final_acc", "best_acc", "gain"]
    if target is not None:
        cols.append("steps_to_target" if x == "step" else "samples_to_target")
    return cols + ["step_time", "zero_adv_frac", "final_entropy", "wrong_len"]


def resolve_column(name: str) -> Column:
    """A named column, or a generic "<agg>:<metric>" one. Raises ValueError naming the options."""
    if name in COLUMNS:
        return COLUMNS[name]
    agg, sep, metric = name.partition(":")
    if sep and agg in _GENERIC and metric:
        fn = _GENERIC[agg]
        return Column(name, f"{agg} {metric}", lambda r, c, fn=fn, m=metric: fn(r, m))
    raise ValueError(
        f"unknown column {name!r}; use one of {', '.join(COLUMNS)} or '<agg>:<metric>' with agg in "
        f"{'|'.join(_GENERIC)}, e.g. 'last:actor/clip_frac_high'"
    )


# ---------------------------------------------------------------------------------------------
# Cells and formatting
# ---------------------------------------------------------------------------------------------


@dataclass
class Cell:
    mean: float
    half: float  # CI half-width; nan when n < 2
    n: int  # runs that contributed a value
    of: int  # runs in the statistics (completed ones); for reach columns: runs that had evals


def column_value(column: Column, run: Run, ctx: Context) -> float | None:
    """`column`'s value for `run`: computed from its metrics, or for a run restored from a table's
    committed record (no metrics) the value that record holds (None when it did not have the column)."""
    if run.recorded is not None:
        return _num(run.recorded.get(column.name))
    return column.value(run, ctx)


def compute_cell(
    column: Column, runs: Sequence[Run], ctx: Context, confidence: float = 0.95
) -> Cell:
    values = [column_value(column, r, ctx) for r in runs]
    if column.reach_x and ctx.target is None:
        of = 0  # no target asked for: the cell is "–", not "0/3 reached"
    elif column.reach_x:
        # seeds that never evaluated cannot have "not reached"; leave them out of the denominator (a
        # recorded run was counted when its table was built: it has a value or it did not reach)
        of = sum(r.recorded is not None or bool(series(r, ACC, column.reach_x)[1]) for r in runs)
    else:
        of = len(runs)
    mean, half, n = mean_ci(values, confidence)
    return Cell(mean, half, n, of)


def _decimals(x: float) -> int:
    """Decimals for free-form floats: about three significant digits (0.523, 5.23, 52.3, 523)."""
    ax = abs(x)
    return 0 if ax >= 100 else 1 if ax >= 10 else 2 if ax >= 1 else 3


def format_pm(mean: float, half: float, fmt: str) -> str:
    """"52.3 ± 3.1" style text for one mean/half-width pair."""
    if math.isnan(mean):
        return "nan"
    if fmt in ("pct", "pp"):
        m, h, spec = mean * 100, half * 100, ".1f"
    elif fmt == "count":
        # whole numbers, except a small non-integer mean (1.5 steps) that rounding would distort
        d = 1 if abs(mean) < 100 and not float(mean).is_integer() else 0
        m, h, spec = mean, half, f",.{d}f"
    else:
        d = _decimals(mean)
        m, h, spec = mean, half, f",.{d}f"
    mtxt = f"{m:+{spec}}" if fmt == "pp" else f"{m:{spec}}"
    htxt = "n/a" if math.isnan(h) else f"{h:{spec}}"
    return f"{mtxt} ± {htxt}"


def format_cell(cell: Cell, column: Column) -> str:
    if column.reach_x:
        if cell.of == 0:
            return DASH
        head = DASH if cell.n == 0 else format_pm(cell.mean, cell.half, column.fmt)
        return f"{head} ({cell.n}/{cell.of} reached)"
    if cell.n == 0:
        return DASH
    text = format_pm(cell.mean, cell.half, column.fmt)
    # say when fewer seeds than the row's completed runs back this number
    return text if cell.n == cell.of else f"{text} (n={cell.n})"


def _runs_text(group: Group) -> str:
    text = f"{group.n_ok} ok / {group.n_failed} failed"
    return text + (f" / {group.n_incomplete} incomplete" if group.n_incomplete else "")


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------


@dataclass
class Table:
    groups: list[Group]
    keys: list[str]  # grouping keys (one markdown/CSV column each)
    columns: list[Column]
    cells: list[list[Cell]]  # [group][column]
    ctx: Context
    confidence: float


def build_table(
    groups: Sequence[Group],
    keys: Sequence[str],
    columns: Sequence[str] | None = None,
    *,
    target: float | None = None,
    x: str = "samples",
    confidence: float = 0.95,
    include_incomplete: bool = False,
) -> Table:
    ctx = Context(target, x)
    cols = [resolve_column(c) for c in (columns or default_columns(target, x))]
    cells = [
        [compute_cell(c, g.runs_for_stats(include_incomplete), ctx, confidence) for c in cols]
        for g in groups
    ]
    return Table(list(groups), list(keys), cols, cells, ctx, confidence)


def _header(col: Column, ctx: Context) -> str:
    target = "target" if ctx.target is None else f"{ctx.target * 100:g}%"
    return col.header.replace("{target}", target)


def table_markdown(table: Table) -> str:
    """The table alone (GitHub markdown), one row per group."""
    key_cols = table.keys or ["Group"]
    head = key_cols + ["Runs"] + [_header(c, table.ctx) for c in table.columns]
    lines = [
        "| " + " | ".join(_md_escape(h) for h in head) + " |",
        "|" + "|".join(["---"] * len(key_cols) + ["---"] + ["---:"] * len(table.columns)) + "|",
    ]
    for group, cells in zip(table.groups, table.cells):
        keys = [group.values[k] for k in table.keys] if table.keys else [group.label]
        row = keys + [_runs_text(group)] + [format_cell(c, col) for c, col in zip(cells, table.columns)]
        lines.append("| " + " | ".join(_md_escape(v) for v in row) + " |")
    return "\n".join(lines)


def _short_error(error: str | None) -> str:
    """One line of an error: a traceback's last line (the exception), else its first line."""
    if not error:
        return "(no error message recorded)"
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    line = lines[-1] if lines and lines[0].startswith("Traceback") else (lines[0] if lines else "")
    return line if len(line) <= 300 else line[:297] + "..."


def failed_runs_markdown(groups: Sequence[Group], include_incomplete: bool = False) -> str:
    """The "Failed runs" section (empty string when every run completed)."""
    items = []
    for g in groups:
        for r in g.runs:
            if not r.ok:
                items.append(
                    f"- `{r.name}` ({_md_escape(g.label)}; `{display_path(r.path)}`): **{r.status}** — "
                    f"{_md_escape(_short_error(r.error))}"
                )
    if not items:
        return ""
    excluded = "Failed runs are" if include_incomplete else "These runs are"
    return f"## Failed runs\n\n{excluded} excluded from the means above.\n\n" + "\n".join(items)


def warnings_markdown(groups: Sequence[Group]) -> str:
    items = [f"- `{r.name}` (`{r.path}`): {w}" for g in groups for r in g.runs for w in r.warnings]
    return "## Data warnings\n\n" + "\n".join(items) if items else ""


def warmup_starts(groups: Sequence[Group]) -> list[str]:
    """Runs of one seed built from the same warm-up inputs that began from different checkpoints: a paired
    difference between them mixes the start with the row. Steps that differ are the warm-up's early stop
    moving (fp32 rounding on another processor); the same steps with other weights are a replayed warm-up
    (warmup.replay_steps) or another machine's rounding of the same length."""
    starts: dict[tuple, dict[tuple, list[str]]] = {}     # (seed, inputs) -> (digest, steps) -> run names
    for g in groups:
        for r in g.runs:
            w = r.warmup
            if w.get("digest") and w.get("inputs"):
                start = (w["digest"], str(w.get("steps")))
                starts.setdefault((r.seed, w["inputs"]), {}).setdefault(start, []).append(r.name)
    out = []
    for (seed, _), by_start in starts.items():
        if len(by_start) < 2:
            continue
        steps = {steps for _, steps in by_start}
        what = ("warm-ups stopped at different steps" if len(steps) > 1 else
                f"warm-ups of the same length ({steps.pop()} steps) with different weights")
        runs = "; ".join(f"{', '.join(f'`{n}`' for n in names)} from {digest} (step {steps})"
                         for (digest, steps), names in sorted(by_start.items()))
        out.append(f"seed {seed}: {what}: {runs}")
    return out


def warmup_starts_markdown(groups: Sequence[Group]) -> str:
    items = warmup_starts(groups)
    return ("## Different starts\n\nRuns of one seed that should share a warm-up checkpoint began from different "
            "ones; their paired differences mix the start with the row.\n\n" + "\n".join(f"- {i}" for i in items)
            if items else "")


# Per-run fields of a table's runs CSV saying where each run began (written when any run recorded them).
WARMUP_FIELDS = ("warmup_steps", "warmup_digest", "warmup_inputs")


def write_csv(table: Table, path: str | Path) -> Path:
    """One row per group, raw units (accuracies as fractions), separate mean / ci / n columns.

    <col>_ci95 is the CI half-width (empty when n < 2); <col>_of is how many runs could have
    contributed (for first-reach columns: <col>_n reached out of <col>_of).
    """
    path = Path(path)
    ci = f"ci{round(table.confidence * 100):d}"
    head = ["group"] + list(table.keys) + ["n_ok", "n_failed", "n_incomplete", "seeds"]
    for c in table.columns:
        head += [f"{c.name}_mean", f"{c.name}_{ci}", f"{c.name}_n", f"{c.name}_of"]

    def num(v: float) -> str:
        return "" if math.isnan(v) else repr(float(v))

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(head)
        for g, cells in zip(table.groups, table.cells):
            seeds = " ".join(str(r.seed) for r in g.runs_for_stats() if r.seed is not None)
            row: list[Any] = [g.label] + [g.values[k] for k in table.keys]
            row += [g.n_ok, g.n_failed, g.n_incomplete, seeds]
            for cell in cells:
                # n = 0 gives mean nan too; a diverged (NaN) seed with n > 0 is written as "nan"
                mean = "" if cell.n == 0 else ("nan" if math.isnan(cell.mean) else num(cell.mean))
                row += [mean, num(cell.half), cell.n, cell.of]
            w.writerow(row)
    return path


def write_runs_csv(groups: Sequence[Group], columns: Sequence[Column], ctx: Context, path) -> Path:
    """One row per run (every status), with each column's per-run value: the table's raw data."""
    path = Path(path)
    starts = any(r.warmup.get("digest") for g in groups for r in g.runs)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["group", "run", "path", "status", "seed", "error"] + (list(WARMUP_FIELDS) if starts else [])
                   + [c.name for c in columns])
        for g in groups:
            for r in g.runs:
                vals = [column_value(column, r, ctx) for column in columns]
                start = [r.warmup.get(k, "") for k in ("steps", "digest", "inputs")] if starts else []
                w.writerow(
                    [g.label, r.name, display_path(r.path), r.status, "" if r.seed is None else r.seed,
                     _short_error(r.error) if not r.ok else ""] + start
                    + ["" if v is None else repr(float(v)) for v in vals]
                )
    return path


def write_curves_csv(runs: Sequence[Run], metric: str, path) -> Path:
    """One row per logged value of `metric` per run (path, step, samples, value): the plotted learning
    curves as data. A table's committed record restores them (grpo_lab/tables/record.py)."""
    path = Path(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["path", "step", "samples", metric])
        for r in runs:
            sample_at = dict(zip(*series(r, "samples", "step")))     # step -> samples generated by then
            for step, y in zip(*series(r, metric, "step")):
                sample = sample_at.get(step)
                w.writerow([display_path(r.path), repr(step), "" if sample is None else repr(sample), repr(y)])
    return path
