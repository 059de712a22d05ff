"""Learning curves: a metric vs samples (or steps), one line per group, mean ± 95 % CI over seeds.

Uses matplotlib's Agg backend so it runs on headless machines and inside CI.
"""

from __future__ import annotations

import textwrap

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: must precede pyplot import
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .runs import Group  # noqa: E402
from .stats import aggregate_curves  # noqa: E402
from .table import series  # noqa: E402

X_LABELS = {"samples": "generated completions (samples)", "step": "RL step"}


def plot_curves(
    groups: Sequence[Group],
    out_png: str | Path,
    *,
    metric: str = "eval/accuracy",
    x: str = "samples",
    title: str | None = None,
    confidence: float = 0.95,
    include_incomplete: bool = False,
) -> Path:
    """Write a PNG with one mean curve per group and a shaded CI band (when >= 2 seeds).

    Accuracy-like metrics (name ending in "accuracy") are drawn in percent. A group whose runs
    did not log `metric` is left out of the plot; if none logged it, the PNG says so in words
    rather than being absent, so a table script that links it never points at nothing.
    """
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    scale = 100.0 if metric.endswith("accuracy") else 1.0

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=150)
    drawn = 0
    for group in groups:
        curves = [series(r, metric, x) for r in group.runs_for_stats(include_incomplete)]
        agg = aggregate_curves(curves, confidence)
        if agg["x"].size == 0:
            continue
        marker = "o" if agg["x"].size <= 30 else None  # few eval points: show where they are
        (line,) = ax.plot(
            agg["x"], agg["mean"] * scale, marker=marker, ms=3, label=f"{group.label} (n={agg['n']})"
        )
        if agg["n"] >= 2:
            ax.fill_between(
                agg["x"], agg["lo"] * scale, agg["hi"] * scale, color=line.get_color(), alpha=0.2
            )
        drawn += 1

    ax.set_xlabel(X_LABELS.get(x, x))
    # sample counts reach millions; "1,024,000" reads better than an offset "1e6" label
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_ylabel(f"{metric} (%)" if scale == 100.0 else metric)
    if title:
        # Long table titles would run off the figure: wrap them to its width.
        ax.set_title(textwrap.fill(title, 70), fontsize=10)
    if drawn:
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
        fig.text(
            0.99, 0.01, f"mean ± {confidence:.0%} CI over seeds", ha="right", va="bottom",
            fontsize=6, color="gray",
        )
    else:
        ax.text(0.5, 0.5, f"no completed run logged {metric}", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_gold_proxy_vs_kl(groups: Sequence[Group], out_png: str | Path, *, title: str | None = None,
                          include_incomplete: bool = False) -> Path:
    """Over-optimisation in the shape of Gao et al.'s Fig. 1 (arXiv 2210.10760): gold (eval/accuracy) and proxy
    (eval/proxy_reward) against sqrt(KL(pi || pi_ref)) (kl_ref/seq of the evaluation's step; 0 before training),
    one line per group, each point the mean over seeds at one evaluation step."""
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig, (gold_ax, proxy_ax) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=150)
    for group in groups:
        points: dict[float, list[tuple[float, float, float | None]]] = {}
        for run in group.runs_for_stats(include_incomplete):
            # The evaluation after training is a line of its own: its step's KL is on the step's line.
            kl_by_step = {row["step"]: row["kl_ref/seq"] for row in run.metrics if "kl_ref/seq" in row}
            for row in run.metrics:
                if "eval/accuracy" not in row:
                    continue
                kl = kl_by_step.get(row.get("step"), 0.0 if row.get("step") == 0 else None)
                if kl is None:
                    continue
                points.setdefault(row["step"], []).append(
                    (max(float(kl), 0.0) ** 0.5, float(row["eval/accuracy"]), row.get("eval/proxy_reward")))
        steps = sorted(points)
        if not steps:
            continue
        xs = [sum(p[0] for p in points[s]) / len(points[s]) for s in steps]
        gold = [100 * sum(p[1] for p in points[s]) / len(points[s]) for s in steps]
        (line,) = gold_ax.plot(xs, gold, marker="o", ms=3, label=group.label)
        proxy = [(x, sum(p[2] for p in points[s]) / len(points[s])) for x, s in zip(xs, steps)
                 if all(p[2] is not None for p in points[s])]
        if proxy:
            proxy_ax.plot([x for x, _ in proxy], [y for _, y in proxy], marker="o", ms=3, color=line.get_color(),
                          label=group.label)
    for ax, ylabel in ((gold_ax, "gold: eval/accuracy (%)"), (proxy_ax, "proxy: eval/proxy_reward")):
        ax.set_xlabel("sqrt(KL(pi || pi_ref)) of the step's samples (nats^0.5)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    gold_ax.legend(fontsize=6, loc="best")
    if title:
        fig.suptitle(textwrap.fill(title, 120), fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
