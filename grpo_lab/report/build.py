"""build_report: run directories -> <out>.md, <out>.csv, <out>_runs.csv, <out>.png.

The one function both the CLI (`python -m grpo_lab.report`) and table-making scripts call.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .runs import COMPLETED, FAILED, INCOMPLETE, display_path, group_runs, load_runs
from .table import (
    build_table,
    failed_runs_markdown,
    table_markdown,
    warmup_starts_markdown,
    warnings_markdown,
    write_csv,
    write_curves_csv,
    write_runs_csv,
)

X_CHOICES = ("samples", "step")


def _out_stem(out: str | os.PathLike) -> Path:
    """"tables/name", "tables/name.md" and "tables/name.csv" all mean the stem tables/name."""
    out = Path(out)
    return out.with_suffix("") if out.suffix in (".md", ".csv", ".png") else out


def build_report(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    group_by: Sequence[str] | None = None,
    target: float | None = None,
    x: str = "samples",
    title: str | None = None,
    header: Mapping[str, str] | None = None,
    columns: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
    metric: str = "eval/accuracy",
    include_incomplete: bool = False,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Load runs under `paths`, group them by condition, and write the report files.

    Args:
        paths: sweep / run directories or glob patterns, searched recursively.
        out: output stem; writes <out>.md, <out>.csv (per group), <out>_runs.csv (per run),
            <out>.png (learning curves) and <out>_curves.csv (the plotted values, per run).
        group_by: dotted config keys to group by; default: the overrides that vary, minus seed.
        target: accuracy (fraction, e.g. 0.6) for the samples/steps-to-target column.
        x: "samples" or "step", for the plot and the default first-reach column.
        title: markdown title (default: the output name).
        header: optional lines for the header block: "command", "machine", "date", "notes".
        columns: column names (see table.COLUMNS, or "<agg>:<metric>"); default
            table.default_columns(target, x).
        ignore: override keys to leave out of automatic grouping.
        metric: what the PNG plots.
        include_incomplete: also average runs without summary.json (to watch a sweep in flight).
    Returns:
        {"markdown": full md text, "table": the table's md text, "md"/"csv"/"runs_csv"/"png": paths,
         "groups": [Group], "keys": grouping keys, "runs": [Run]}
    Raises:
        NoRunsFound if there is no run directory under `paths`; ValueError for a bad x or column.
    """
    if x == "steps":
        x = "step"
    if x not in X_CHOICES:
        raise ValueError(f"x must be one of {X_CHOICES}, got {x!r}")
    if target is not None and not 0.0 <= target <= 1.0:
        raise ValueError(f"target is an accuracy fraction in [0, 1] (e.g. 0.6), got {target}")

    runs = load_runs(paths)
    groups, keys = group_runs(runs, group_by=group_by, ignore=ignore)
    table = build_table(
        groups, keys, columns, target=target, x=x, confidence=confidence,
        include_incomplete=include_incomplete,
    )

    stem = _out_stem(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = stem.with_suffix(".md"), stem.with_suffix(".csv")
    runs_csv_path = stem.with_name(stem.name + "_runs.csv")
    curves_csv_path = stem.with_name(stem.name + "_curves.csv")
    png_path = stem.with_suffix(".png")

    from .plots import plot_curves  # matplotlib is slow to import; only pay for it here

    plot_curves(
        groups, png_path, metric=metric, x=x, title=title, confidence=confidence,
        include_incomplete=include_incomplete,
    )
    if any("kl_ref/seq" in row for r in runs for row in r.metrics):   # runs against a learned reward
        from .plots import plot_gold_proxy_vs_kl

        plot_gold_proxy_vs_kl(groups, stem.with_name(stem.name + "_kl.png"), title=title,
                              include_incomplete=include_incomplete)
    write_csv(table, csv_path)
    write_runs_csv(groups, table.columns, table.ctx, runs_csv_path)
    write_curves_csv(runs, metric, curves_csv_path)

    table_md = table_markdown(table)
    markdown = _compose_markdown(
        title or stem.name, header or {}, paths, runs, table_md, groups, png_path.name,
        confidence, include_incomplete,
    )
    md_path.write_text(markdown, encoding="utf-8")
    return {
        "markdown": markdown,
        "table": table_md,
        "md": md_path,
        "csv": csv_path,
        "runs_csv": runs_csv_path,
        "curves_csv": curves_csv_path,
        "png": png_path,
        "groups": groups,
        "keys": keys,
        "runs": runs,
    }


def _compose_markdown(
    title, header, paths, runs, table_md, groups, png_name, confidence, include_incomplete
) -> str:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    counts = {s: sum(r.status == s for r in runs) for s in (COMPLETED, FAILED, INCOMPLETE)}
    date = header.get("date") or _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    averaged = "completed and incomplete" if include_incomplete else "completed"
    lines = [f"# {title}", ""]
    if header.get("command"):
        lines.append(f"- **Command:** `{header['command']}`")
    if header.get("machine"):
        lines.append(f"- **Machine:** {header['machine']}")
    lines.append(f"- **Date:** {date}")
    lines.append(
        f"- **Runs:** {len(runs)} ({counts[COMPLETED]} completed, {counts[FAILED]} failed, "
        f"{counts[INCOMPLETE]} incomplete) from {', '.join(f'`{display_path(p)}`' for p in paths)}"
    )
    lines.append(
        f"- **Statistics:** mean ± {confidence:.0%} CI half-width over seeds (Student t, n−1 "
        f"degrees of freedom) of {averaged} runs; \"n/a\" = a single seed; \"(n=k)\" = only k "
        "runs logged that metric; \"–\" = not logged. Samples/steps to target: mean over the "
        "seeds that reached it, at the first evaluation at or above the target."
    )
    notes = header.get("notes")
    if notes:
        lines += ["", str(notes).strip()]
    lines += ["", table_md, "", f"![learning curves]({png_name})", ""]
    for section in (failed_runs_markdown(groups, include_incomplete), warmup_starts_markdown(groups),
                    warnings_markdown(groups)):
        if section:
            lines += [section, ""]
    return "\n".join(lines)
