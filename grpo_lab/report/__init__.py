"""Reports: run directories under outputs/ -> paper tables (markdown, CSV) and learning curves.

    python -m grpo_lab.report multirun/2025-06-01/12-00-00 --out tables/dapo_vs_grpo --target 0.6

or from Python:

    from grpo_lab.report import build_report
    build_report(["multirun/..."], "tables/dapo_vs_grpo", target=0.6)

Modules: runs (find, load, group), stats (mean ± t-interval, Welch difference, first-reach, curve bands),
table (columns, markdown, CSV), plots (PNG), build (build_report), __main__ (CLI).
"""

from .build import build_report
from .runs import Group, NoRunsFound, Run, group_runs, load_run, load_runs
from .stats import aggregate_curves, contrast_ci, first_reach, mean_ci, paired_diff_ci, t_ppf, welch_diff_ci

__all__ = [
    "Group",
    "NoRunsFound",
    "Run",
    "aggregate_curves",
    "build_report",
    "first_reach",
    "group_runs",
    "load_run",
    "load_runs",
    "mean_ci",
    "contrast_ci",
    "paired_diff_ci",
    "t_ppf",
    "welch_diff_ci",
]
