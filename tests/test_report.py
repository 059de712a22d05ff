"""grpo_lab.report: statistics by hand, and tables/plots from hand-made run directories.

Every expected number below is worked out in a comment. t quantiles come from printed t tables:
t_{0.975,1} = 12.706205, t_{0.975,2} = 4.302653, t_{0.975,4} = 2.776445, t_{0.975,29} = 2.045230.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_lab.report import (
    NoRunsFound,
    aggregate_curves,
    build_report,
    first_reach,
    group_runs,
    load_run,
    load_runs,
    mean_ci,
    paired_diff_ci,
    t_ppf,
    welch_diff_ci,
)
from grpo_lab.report.__main__ import main as cli_main
from grpo_lab.report.runs import find_run_dirs

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Fixtures: run directories in the trainer's format
# ---------------------------------------------------------------------------------------------


def write_run(
    d: Path,
    *,
    overrides: list[str] | None = None,
    config: dict | None = None,
    metrics: list[dict] | None = None,
    summary: dict | None = None,
    raw_tail: str | None = None,
) -> Path:
    """Create one run dir. summary=None -> no summary.json (a crashed run)."""
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    if overrides is not None:
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if metrics is not None:
        text = "".join(json.dumps(m) + "\n" for m in metrics) + (raw_tail or "")
        (d / "metrics.jsonl").write_text(text)
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def curve_metrics(accs, wrong_len=None, step_times=(), zero_adv=None, entropy=None):
    """Eval lines at steps 0, 1, 2, ... with 512 samples per step, plus one train line per step."""
    lines = []
    for step, acc in enumerate(accs):
        if step > 0:
            train = {"step": step, "samples": 512 * step, "wall_time_s": 10.0 * step, "kind": "train"}
            if step - 1 < len(step_times):
                train["perf/step_time_s"] = step_times[step - 1]
            if zero_adv is not None:
                train["rollout/zero_adv_group_frac"] = zero_adv
            if entropy is not None:
                train["actor/entropy"] = entropy
            lines.append(train)
        ev = {"step": step, "samples": 512 * step, "kind": "eval", "eval/accuracy": acc}
        if wrong_len is not None:
            ev["eval/wrong_len_mean"] = wrong_len
        lines.append(ev)
    return lines


def summary(status="completed", error=None, name="run", final=None, initial=None):
    return {
        "status": status,
        "error": error,
        "run_name": name,
        "overrides": [],
        "initial": initial or {},
        "final": final or {},
        "steps": 2,
        "samples": 1024,
        "wall_time_s": 20.0,
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    return make_sweep(tmp_path)


def make_sweep(tmp_path: Path) -> Path:
    """A Hydra-multirun-like sweep: grpo x 3 seeds (all ok); dapo: 1 ok, 1 failed, 1 crashed.

    grpo seeds (eval/accuracy at steps 0, 1, 2 = samples 0, 512, 1024):
        seed 0: 0.40, 0.55, 0.50   final 0.5, best 0.55, never reaches 0.6
        seed 1: 0.40, 0.55, 0.60   final 0.6, reaches 0.6 at 1024 samples
        seed 2: 0.40, 0.60, 0.70   final 0.7, reaches 0.6 at 512 samples
    step times: seed k logs [1+k, 3+k] -> per-run means 2, 3, 4. Zero-adv frac 0.25 everywhere.
    wrong_len_mean: 100, 200, 300. No actor/entropy at all in grpo runs.
    """
    root = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    accs = {0: [0.40, 0.55, 0.50], 1: [0.40, 0.55, 0.60], 2: [0.40, 0.60, 0.70]}
    job = 0
    for seed in range(3):
        ov = ["algorithm=grpo", "rollout.group_size=8", f"seed={seed}", "trainer.steps=2"]
        write_run(
            root / str(job),
            overrides=ov,
            config={"algorithm": {"name": "grpo"}, "rollout": {"group_size": 8}, "seed": seed},
            metrics=curve_metrics(
                accs[seed], wrong_len=100.0 * (seed + 1), step_times=[1.0 + seed, 3.0 + seed],
                zero_adv=0.25,
            ),
            summary=summary(name=f"grpo-s{seed}"),
        )
        job += 1
    dapo_cfg = {"algorithm": {"name": "dapo"}, "rollout": {"group_size": 8}}
    # ok dapo seed: final 0.8, entropy 0.5, no perf/step_time_s logged
    write_run(
        root / str(job),
        overrides=["algorithm=dapo", "rollout.group_size=8", "seed=0", "trainer.steps=2"],
        config={**dapo_cfg, "seed": 0},
        metrics=curve_metrics([0.40, 0.70, 0.80], entropy=0.5),
        summary=summary(name="dapo-s0"),
    )
    job += 1
    # failed dapo seed: the trainer caught the error and wrote it down
    write_run(
        root / str(job),
        overrides=["algorithm=dapo", "rollout.group_size=8", "seed=1", "trainer.steps=2"],
        config={**dapo_cfg, "seed": 1},
        metrics=curve_metrics([0.40]),
        summary=summary(
            status="failed", name="dapo-s1",
            error="Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory",
        ),
    )
    job += 1
    # crashed dapo seed: metrics only, last line half-written
    write_run(
        root / str(job),
        overrides=["algorithm=dapo", "rollout.group_size=8", "seed=2", "trainer.steps=2"],
        config={**dapo_cfg, "seed": 2},
        metrics=curve_metrics([0.40, 0.90]),
        raw_tail='{"step": 2, "samples": 10',
    )
    return root


def md_row(markdown: str, first_cell: str) -> list[str]:
    """Cells of the markdown table row whose first cell is `first_cell`."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row starting with {first_cell!r} in:\n{markdown}")


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, df, expected",
    [(0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 4, 2.776445), (0.975, 29, 2.045230),
     (0.95, 10, 1.812461), (0.025, 2, -4.302653)],
)
def test_t_ppf_matches_t_tables(p, df, expected):
    assert t_ppf(p, df) == pytest.approx(expected, abs=1e-6)


def test_mean_ci_by_hand():
    # 0.5, 0.6, 0.7: mean 0.6; deviations -0.1, 0, 0.1 -> s² = 0.02/2 = 0.01, s = 0.1
    # half = t_{0.975,2} · s / √3 = 4.302653 · 0.1 / 1.732051 = 0.248414
    mean, half, n = mean_ci([0.5, 0.6, 0.7])
    assert (mean, n) == (pytest.approx(0.6), 3)
    assert half == pytest.approx(0.248414, abs=1e-6)

    # 1..5: mean 3; s² = (4+1+0+1+4)/4 = 2.5, s = 1.581139
    # half = 2.776445 · 1.581139 / √5 = 2.776445 · 0.707107 = 1.963243
    mean, half, n = mean_ci([1, 2, 3, 4, 5])
    assert (mean, n) == (3.0, 5)
    assert half == pytest.approx(1.963243, abs=1e-6)

    # None = metric missing for that seed: dropped, not counted
    assert mean_ci([0.5, None, 0.7])[2] == 2
    # one seed: the mean, but no spread (shown as "n/a")
    mean, half, n = mean_ci([0.42])
    assert (mean, n) == (0.42, 1) and math.isnan(half)
    mean, half, n = mean_ci([])
    assert n == 0 and math.isnan(mean) and math.isnan(half)
    # a diverged seed is not hidden
    assert math.isnan(mean_ci([0.5, float("nan")])[0])


def test_paired_diff_ci_by_hand():
    # seeds 0, 1, 2: a = .50 .60 .70, b = .40 .55 .60 -> d = .10 .05 .10, mean .083333
    # sd(d) = √(((1/60)² + (2/60)² + (1/60)²) / 2) = √(6/3600/2) = 0.028868
    # half = t_{0.975,2} · sd / √3 = 4.302653 · 0.016667 = 0.071711
    d, half, n = paired_diff_ci({0: .50, 1: .60, 2: .70}, {0: .40, 1: .55, 2: .60})
    assert n == 3 and d == pytest.approx(1 / 12, abs=1e-12) and half == pytest.approx(0.071711, abs=1e-6)
    # Welch on the same numbers ignores the pairing: the shared seed spread stays in, the interval widens.
    assert welch_diff_ci([.50, .60, .70], [.40, .55, .60])[1] > 2 * half
    # Only seeds both rows completed are paired (seed 3 of a has no partner, seed 2 of b is missing).
    assert paired_diff_ci({0: .5, 1: .6, 3: .9}, {0: .4, 1: .5, 2: .1})[::2] == (pytest.approx(0.1), 2)
    assert math.isnan(paired_diff_ci({0: .5}, {0: .4})[1]) and paired_diff_ci({0: .5}, {1: .4})[2] == 0


def test_welch_diff_ci_by_hand():
    # a = 1, 2, 3: mean 2, s² = (1+0+1)/2 = 1 -> v_a = s²/n = 1/3
    # b = 3, 4, 5: mean 4, s² = 1              -> v_b = 1/3
    # diff = 2 - 4 = -2; se = √(1/3 + 1/3) = 0.816497
    # ν = (2/3)² / ((1/3)²/2 + (1/3)²/2) = (4/9) / (1/9) = 4 (equal variances and sizes: n_a + n_b - 2)
    # half = t_{0.975,4} · se = 2.776445 · 0.816497 = 2.266958
    d, half = welch_diff_ci([1, 2, 3], [3, 4, 5])
    assert d == -2.0 and half == pytest.approx(2.266958, abs=1e-6)

    # Unequal spreads: b = 4, 6, 8: mean 6, s² = (4+0+4)/2 = 4 -> v_b = 4/3
    # diff = 2 - 6 = -4; se = √(1/3 + 4/3) = √(5/3) = 1.290994
    # ν = (5/3)² / ((1/3)²/2 + (4/3)²/2) = (25/9) / (17/18) = 50/17 = 2.941176
    # so t_{0.975,ν} lies between the table values t_{0.975,3} = 3.182446 and t_{0.975,2} = 4.302653
    d, half = welch_diff_ci([1, 2, 3], [4, 6, 8])
    assert d == -4.0
    assert half / math.sqrt(5 / 3) == pytest.approx(t_ppf(0.975, 50 / 17), abs=1e-9)
    assert 3.182446 < half / math.sqrt(5 / 3) < 4.302653

    # A 90 % interval is narrower: t_{0.95,4} = 2.131847 -> half = 2.131847 · 0.816497 = 1.740646
    assert welch_diff_ci([1, 2, 3], [3, 4, 5], confidence=0.90)[1] == pytest.approx(1.740646, abs=1e-6)
    # One value on a side: a difference but no interval; both sides constant: no spread at all.
    d, half = welch_diff_ci([0.7], [0.5, 0.6])
    assert d == pytest.approx(0.15) and math.isnan(half)
    assert welch_diff_ci([0.5, 0.5], [0.4, 0.4]) == (pytest.approx(0.1), 0.0)


def test_first_reach():
    xs, ys = [0, 100, 200, 300], [0.1, 0.5, 0.7, 0.65]
    assert first_reach(xs, ys, 0.6) == 200  # first eval at or above target
    assert first_reach(xs, ys, 0.5) == 100  # equality counts as reached
    assert first_reach(xs, ys, 0.9) is None  # never reached
    # unordered input and missing points: taken in x order, None skipped
    assert first_reach([300, 0, 200, 100], [0.65, 0.1, None, 0.62], 0.6) == 100
    assert first_reach([], [], 0.5) is None


def test_aggregate_curves_common_grid_and_band():
    # seed A: (0, 0.0), (20, 0.4)            -> at x=10 interpolates to 0.2
    # seed B: (0, 0.0), (10, 0.4), (30, 0.6) -> at x=20 interpolates to 0.5
    # grid = union of x within the range both cover, [0, 20] -> {0, 10, 20} (30 dropped)
    agg = aggregate_curves([([0, 20], [0.0, 0.4]), ([0, 10, 30], [0.0, 0.4, 0.6])])
    assert agg["n"] == 2
    assert list(agg["x"]) == [0, 10, 20]
    assert list(agg["mean"]) == pytest.approx([0.0, 0.3, 0.45])
    # x=10: values 0.2, 0.4 -> s = 0.2/√2 = 0.141421; half = 12.706205 · 0.141421/√2 = 1.270621
    # x=20: values 0.4, 0.5 -> s = 0.070711; half = 12.706205 · 0.05 = 0.635310
    half = agg["hi"] - agg["mean"]
    assert list(half) == pytest.approx([0.0, 1.270621, 0.635310], abs=1e-6)
    assert list(agg["lo"]) == pytest.approx(list(agg["mean"] - half))
    # a single seed: no band
    one = aggregate_curves([([0, 1], [0.1, 0.2])])
    assert one["n"] == 1 and list(one["hi"]) == list(one["mean"])
    assert aggregate_curves([]) ["x"].size == 0


# ---------------------------------------------------------------------------------------------
# loading and grouping
# ---------------------------------------------------------------------------------------------


def test_load_statuses_and_partial_metrics(sweep):
    runs = load_runs(sweep)
    # found recursively, in job order, and .hydra dirs are not mistaken for runs
    assert [r.path.name for r in runs] == ["0", "1", "2", "3", "4", "5"]
    assert [r.status for r in runs] == ["completed"] * 4 + ["failed", "incomplete"]
    crashed = runs[5]
    assert crashed.summary is None and "no summary.json" in crashed.error
    assert crashed.name == "12-00-00/5"  # no run_name without summary: sweep dir / job number
    # the half-written last line is skipped with a warning; the good lines survive
    assert len(crashed.metrics) == 3 and "skipped 1 unparsable" in crashed.warnings[0]
    assert runs[4].error.endswith("CUDA out of memory")
    assert runs[0].seed == 0 and runs[0].name == "grpo-s0"


def test_find_run_dirs_natural_order_and_globs(tmp_path):
    for i in [0, 2, 10, 1]:
        write_run(tmp_path / "sweep" / str(i), metrics=[{"step": 0}])
    names = [p.name for p in find_run_dirs([tmp_path / "sweep"])]
    assert names == ["0", "1", "2", "10"]
    # a glob and a directory that overlap: each run counted once
    both = find_run_dirs([str(tmp_path / "sweep" / "*"), tmp_path / "sweep"])
    assert len(both) == 4
    # the search stops at a run dir: files below it (checkpoints, eval dumps) are not new runs
    write_run(tmp_path / "sweep" / "0" / "checkpoints" / "step_1", metrics=[{"step": 1}])
    assert len(find_run_dirs([tmp_path / "sweep"])) == 4


def test_grouping_by_varying_overrides_excludes_seed(sweep):
    groups, keys = group_runs(load_runs(sweep))
    # rollout.group_size and trainer.steps are the same everywhere; seed is averaged over
    assert keys == ["algorithm"]
    assert [g.label for g in groups] == ["algorithm=grpo", "algorithm=dapo"]
    assert [len(g.runs) for g in groups] == [3, 3]
    assert [(g.n_ok, g.n_failed, g.n_incomplete) for g in groups] == [(3, 0, 0), (1, 1, 1)]
    # ignoring the key that varies collapses everything into one group labelled by shared overrides
    groups, keys = group_runs(load_runs(sweep), ignore=["algorithm"])
    assert keys == [] and len(groups) == 1
    assert groups[0].label == "rollout.group_size=8, trainer.steps=2"


def test_grouping_override_present_in_some_runs_only(tmp_path):
    write_run(tmp_path / "a", overrides=["seed=0"], metrics=[{"step": 0}])
    write_run(tmp_path / "b", overrides=["seed=1", "+learner.lr=1e-5"], metrics=[{"step": 0}])
    groups, keys = group_runs(load_runs(tmp_path))
    assert keys == ["learner.lr"]  # the "+" prefix is Hydra syntax, not part of the key
    assert [g.label for g in groups] == ["learner.lr=(default)", "learner.lr=1e-5"]


def test_group_by_config_keys(sweep):
    runs = load_runs(sweep)
    # a scalar config key: same for every run -> one group
    groups, keys = group_runs(runs, group_by=["rollout.group_size"])
    assert keys == ["rollout.group_size"] and [g.label for g in groups] == ["rollout.group_size=8"]
    # a config *group* resolves to a mapping; its chosen name is used
    groups, _ = group_runs(runs, group_by=["algorithm", "rollout.group_size"])
    assert [g.label for g in groups] == [
        "algorithm=grpo, rollout.group_size=8",
        "algorithm=dapo, rollout.group_size=8",
    ]
    groups, _ = group_runs(runs, group_by=["no.such.key"])
    assert [g.label for g in groups] == ["no.such.key=(missing)"]


# ---------------------------------------------------------------------------------------------
# table, CSV, plot
# ---------------------------------------------------------------------------------------------


def test_table_cells_by_hand(sweep, tmp_path):
    res = build_report(sweep, tmp_path / "tables" / "t", target=0.6)
    md = res["markdown"]
    head = md_row(md, "algorithm")
    assert head == [
        "algorithm", "Runs", "Final acc. (%)", "Best acc. (%)", "Gain (pp)", "Samples to 60%",
        "Time/step (s)", "Zero-adv. groups (%)", "Final entropy", "Wrong-answer len.",
    ]
    grpo = md_row(md, "grpo")
    assert grpo[1] == "3 ok / 0 failed"
    # final 0.5, 0.6, 0.7 -> 60.0 ± 24.8 (half 0.248414, see test_mean_ci_by_hand)
    assert grpo[2] == "60.0 ± 24.8"
    # best 0.55, 0.6, 0.7: mean 0.616667; devs -0.066667, -0.016667, 0.083333
    # s² = (0.0044444 + 0.0002778 + 0.0069444)/2 = 0.0058333, s = 0.0763763
    # half = 4.302653 · 0.0763763/√3 = 0.189729 -> "61.7 ± 19.0"
    assert grpo[3] == "61.7 ± 19.0"
    # gain = final - initial(0.4) = 0.1, 0.2, 0.3 -> +20.0 ± 24.8 percentage points
    assert grpo[4] == "+20.0 ± 24.8"
    # reached 0.6 at 1024 (seed 1) and 512 (seed 2); seed 0 never: mean 768,
    # s = 512/√2 = 362.039, half = 12.706205 · 362.039/√2 = 12.706205 · 256 = 3252.79
    assert grpo[5] == "768 ± 3,253 (2/3 reached)"
    # per-run mean step time 2, 3, 4 -> mean 3, s = 1, half = 4.302653/√3 = 2.484138
    assert grpo[6] == "3.00 ± 2.48"
    assert grpo[7] == "25.0 ± 0.0"
    assert grpo[8] == "–"  # no actor/entropy logged: a dash, not a crash
    # wrong_len 100, 200, 300 -> 200 ± 100·4.302653/√3 = 248.41
    assert grpo[9] == "200 ± 248"

    dapo = md_row(md, "dapo")
    assert dapo[1] == "1 ok / 1 failed / 1 incomplete"
    # only the completed seed counts: one value, no spread
    assert dapo[2] == "80.0 ± n/a"
    assert dapo[5] == "512 ± n/a (1/1 reached)"
    assert dapo[6] == "–"
    assert dapo[8] == "0.500 ± n/a"

    # failed runs are listed with their error, the crashed one as incomplete
    assert "## Failed runs" in md
    assert "`dapo-s1`" in md and "**failed** — torch.OutOfMemoryError: CUDA out of memory" in md
    assert "**incomplete** — no summary.json" in md
    assert "## Data warnings" in md and "skipped 1 unparsable line(s)" in md


def test_drop_from_best_by_hand(sweep, tmp_path):
    md = build_report(sweep, tmp_path / "t", target=0.6, columns=["final_acc", "drop_from_best"])["markdown"]
    assert md_row(md, "algorithm")[3] == "Drop from best (pp)"
    # grpo: best 0.55, 0.6, 0.7 and final 0.5, 0.6, 0.7 -> drops 0.05, 0, 0: mean 0.016667, s = 0.0288675,
    # half = 4.302653 * 0.0288675 / sqrt(3) = 0.0717109 -> "+1.7 ± 7.2" points
    assert md_row(md, "grpo")[3] == "+1.7 ± 7.2"


def test_csv_round_trip(sweep, tmp_path):
    res = build_report(sweep, tmp_path / "t", target=0.6)
    with open(res["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["group"] for r in rows] == ["algorithm=grpo", "algorithm=dapo"]
    grpo, dapo = rows
    assert grpo["algorithm"] == "grpo" and grpo["seeds"] == "0 1 2"
    assert (grpo["n_ok"], grpo["n_failed"], grpo["n_incomplete"]) == ("3", "0", "0")
    assert (dapo["n_ok"], dapo["n_failed"], dapo["n_incomplete"]) == ("1", "1", "1")
    # raw units (fractions), full precision
    assert float(grpo["final_acc_mean"]) == pytest.approx(0.6, abs=1e-12)
    assert float(grpo["final_acc_ci95"]) == pytest.approx(0.248414, abs=1e-6)
    assert grpo["final_acc_n"] == "3"
    assert float(grpo["samples_to_target_mean"]) == 768.0
    assert (grpo["samples_to_target_n"], grpo["samples_to_target_of"]) == ("2", "3")
    assert float(grpo["step_time_ci95"]) == pytest.approx(2.484138, abs=1e-6)
    # missing -> empty field; single seed -> empty CI
    assert grpo["final_entropy_mean"] == "" and grpo["final_entropy_n"] == "0"
    assert float(dapo["final_acc_mean"]) == pytest.approx(0.8) and dapo["final_acc_ci95"] == ""

    with open(res["runs_csv"], newline="") as f:
        per_run = list(csv.DictReader(f))
    assert [r["status"] for r in per_run] == ["completed"] * 4 + ["failed", "incomplete"]
    assert [r["final_acc"] for r in per_run[:3]] == ["0.5", "0.6", "0.7"]
    assert per_run[4]["error"] == "torch.OutOfMemoryError: CUDA out of memory"


def test_png_written(sweep, tmp_path):
    res = build_report(sweep, tmp_path / "t", x="step", title="curves")
    png = Path(res["png"])
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![learning curves](t.png)" in res["markdown"]


def test_steps_axis_and_include_incomplete(sweep, tmp_path):
    res = build_report(sweep, tmp_path / "t", target=0.6, x="step", columns=None,
                       include_incomplete=True)
    md = res["markdown"]
    assert md_row(md, "algorithm")[5] == "Steps to 60%"
    # grpo reached 0.6 at steps 2 and 1: mean 1.5, s = 0.707107,
    # half = 12.706205 · 0.707107/√2 = 6.353103 -> small non-integer mean keeps one decimal
    assert md_row(md, "grpo")[5] == "1.5 ± 6.4 (2/3 reached)"
    # the crashed dapo seed now counts: final 0.8 (ok seed) and 0.9 (last logged value)
    # mean 0.85, s = 0.070711, half = 12.706205 · 0.05 = 0.635310 -> 85.0 ± 63.5 (n=2)
    assert md_row(md, "dapo")[2] == "85.0 ± 63.5"
    # the failed seed still does not count
    assert md_row(md, "dapo")[1] == "1 ok / 1 failed / 1 incomplete"
    assert "Failed runs are excluded" in md


def test_null_metric_is_missing_not_stale(tmp_path):
    # the logger writes non-finite values as null and leaves them out of summary "final"
    for seed, ent in enumerate([0.5, 0.7, None]):
        lines = [{"step": 1, "samples": 8, "actor/entropy": 0.9},
                 {"step": 2, "samples": 16, "actor/entropy": ent}]
        write_run(tmp_path / str(seed), overrides=[f"seed={seed}"], metrics=lines,
                  summary=summary(name=f"s{seed}"))
    res = build_report(tmp_path, tmp_path / "out" / "t", columns=["final_entropy"])
    # seed 2's entropy diverged: it is not replaced by its earlier 0.9; the cell says n=2 of 3
    # 0.5, 0.7: mean 0.6, s = 0.141421, half = 12.706205 · 0.141421/√2 = 1.270621
    assert md_row(res["markdown"], "(default config)")[2] == "0.600 ± 1.271 (n=2)"


def test_missing_metrics_never_crash(tmp_path):
    # a completed run that logged nothing useful, no config, no overrides
    write_run(tmp_path / "r0", summary=summary(), metrics=[{"step": 1, "samples": 8}])
    # a failed run with no metrics file at all and a non-dict "final"
    bad = summary(status="failed", error=None)
    bad["final"] = None
    write_run(tmp_path / "r1", summary=bad)
    res = build_report(tmp_path, tmp_path / "out" / "t", target=0.5)
    row = md_row(res["markdown"], "(default config)")
    assert row[1] == "1 ok / 1 failed"
    assert row[2:] == ["–"] * 8
    assert "(no error message recorded)" in res["markdown"]
    assert Path(res["png"]).stat().st_size > 0  # a placeholder figure, not a missing file


def test_columns_configurable_and_checked(sweep, tmp_path):
    res = build_report(sweep, tmp_path / "t", columns=["final_acc", "max:eval/accuracy", "steps"])
    assert md_row(res["markdown"], "algorithm")[2:] == ["Final acc. (%)", "max eval/accuracy", "Steps"]
    # generic float formatting: max accuracy 0.55, 0.6, 0.7 -> 0.617 ± 0.190
    assert md_row(res["markdown"], "grpo")[3] == "0.617 ± 0.190"
    assert md_row(res["markdown"], "grpo")[4] == "2 ± 0"  # summary "steps"
    # compute = the sum of a run's step times: seed k logs 1+k and 3+k s -> 4, 6, 8 s = 0.0667, 0.1, 0.1333 min;
    # mean 0.1, s = 0.0333, half = 4.302653 · 0.0333/√3 = 0.0828; a run without step times has none
    res = build_report(sweep, tmp_path / "t", columns=["compute_time_min"])
    assert md_row(res["markdown"], "algorithm")[2:] == ["Compute (min)"]
    assert md_row(res["markdown"], "grpo")[2] == "0.100 ± 0.083" and md_row(res["markdown"], "dapo")[2] == "–"
    with pytest.raises(ValueError, match="unknown column 'acc'.*final_acc"):
        build_report(sweep, tmp_path / "t", columns=["acc"])
    with pytest.raises(ValueError, match="target is an accuracy fraction"):
        build_report(sweep, tmp_path / "t", target=60)


def test_reward_model_accuracy_column_reads_the_prepared_reward_model_of_each_run(tmp_path):
    """rm_accuracy: summary.json's prepared_rewards.reward_model.held_out_accuracy, in %, mean ± CI over seeds;
    a run whose reward is not learned has no value."""
    root = tmp_path / "sweep"
    for seed, acc in enumerate([0.55, 0.60, 0.65]):
        write_run(root / f"rm{seed}", overrides=["reward=reward_model", f"seed={seed}"],
                  metrics=[{"step": 0, "samples": 0, "eval/accuracy": 0.5}],
                  summary={"status": "completed", "prepared_rewards": {"reward_model": {"held_out_accuracy": acc}}})
        write_run(root / f"verifier{seed}", overrides=["reward=default", f"seed={seed}"],
                  metrics=[{"step": 0, "samples": 0, "eval/accuracy": 0.5}], summary={"status": "completed"})
    res = build_report(root, tmp_path / "t", columns=["rm_accuracy"])
    assert md_row(res["markdown"], "reward")[2:] == ["RM held-out acc. (%)"]
    # 55, 60, 65 %: mean 60, s = 5, half = 4.302653 · 5/√3 = 12.42
    assert md_row(res["markdown"], "reward_model")[2] == "60.0 ± 12.4"
    assert md_row(res["markdown"], "default")[2] == "–"


def test_header_block(sweep, tmp_path):
    res = build_report(
        sweep, tmp_path / "t", title="DAPO vs GRPO",
        header={"command": "make table-dapo", "machine": "1x H100", "date": "2025-01-02",
                "notes": "Tiny model."},
    )
    md = res["markdown"]
    assert md.startswith("# DAPO vs GRPO\n")
    for text in ["- **Command:** `make table-dapo`", "- **Machine:** 1x H100",
                 "- **Date:** 2025-01-02", "6 (4 completed, 1 failed, 1 incomplete)", "Tiny model."]:
        assert text in md
    assert Path(res["md"]).read_text() == md


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_writes_files_and_prints_table(sweep, tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("Seeds 0-2.")
    out = tmp_path / "tables" / "cli"
    rc = cli_main([str(sweep), "--out", str(out), "--target", "0.6", "--notes-file", str(notes),
                   "--columns", "final_acc,samples_to_target"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert md_row(stdout, "grpo")[2:] == ["60.0 ± 24.8", "768 ± 3,253 (2/3 reached)"]
    assert "## Failed runs" in stdout
    for suffix in (".md", ".csv", ".png"):
        assert out.with_suffix(suffix).is_file()
    md = out.with_suffix(".md").read_text()
    assert "Seeds 0-2." in md and "python -m grpo_lab.report" in md


def test_cli_empty_dir_exits_nonzero_with_hint(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_lab.report", str(tmp_path / "empty"), "--out", str(tmp_path / "t")],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert proc.returncode == 2
    assert "no run directories found under" in proc.stderr
    assert "summary.json or metrics.jsonl" in proc.stderr  # says what a run dir looks like
    assert not (tmp_path / "t.md").exists()


def test_missing_path_named_in_error(tmp_path, capsys):
    assert cli_main([str(tmp_path / "nope"), "--out", str(tmp_path / "t")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(NoRunsFound):
        load_runs([])


def test_table_files_name_project_paths_not_absolute_ones(tmp_path, monkeypatch):
    from grpo_lab.report.runs import display_path

    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "outputs" / "tables" / "kl") == "outputs/tables/kl"
    assert display_path("outputs/x") == "outputs/x"
    assert display_path("/somewhere/else") == "/somewhere/else"   # outside the project: left as given


def test_display_path_names_runs_under_a_linked_outputs_dir_by_project_path(tmp_path, monkeypatch):
    """A worktree whose outputs/ links to another checkout's: its tables still name outputs/..., not the
    other checkout's absolute path."""
    from grpo_lab.report.runs import display_path

    shared = tmp_path / "main" / "outputs"
    (shared / "tables" / "t" / "0_a_s0").mkdir(parents=True)
    project = tmp_path / "worktree"
    project.mkdir()
    (project / "outputs").symlink_to(shared)
    monkeypatch.chdir(project)
    assert display_path(shared / "tables" / "t" / "0_a_s0") == "outputs/tables/t/0_a_s0"
    assert display_path(project / "outputs" / "tables") == "outputs/tables"
    assert display_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


def test_a_table_record_names_runs_under_a_linked_outputs_dir_by_project_path(tmp_path):
    """The launch command in <table>_meta.json, written from a worktree whose outputs/ links to another
    checkout's, names outputs/..., not that checkout's absolute path."""
    from grpo_lab.tables.record import _project_relative

    shared = tmp_path / "main" / "outputs"
    shared.mkdir(parents=True)
    project = tmp_path / "worktree"
    project.mkdir()
    (project / "outputs").symlink_to(shared)
    command = [f"hydra.searchpath=['file://{shared}/tables/t/.variants']", f"hydra.sweep.dir={shared}/tables/t",
               f"cache_dir={project}/.cache"]
    assert _project_relative({"launch_command": command}, project) == {"launch_command": [
        "hydra.searchpath=['file://outputs/tables/t/.variants']", "hydra.sweep.dir=outputs/tables/t", "cache_dir=.cache"]}


def test_a_table_record_made_in_one_checkout_from_a_launch_in_another_names_project_paths(tmp_path):
    """A worktree ran the table (and an added launch) while the report is made in the main checkout:
    neither checkout's absolute path reaches the committed record."""
    from grpo_lab.tables.record import launch_record_relative

    main, worktree = tmp_path / "main", tmp_path / "wt"
    (main / "outputs").mkdir(parents=True)
    worktree.mkdir()
    (worktree / "outputs").symlink_to(main / "outputs")
    meta = {"checkout": str(worktree), "launch_command": [f"{worktree}/.venv/bin/python", f"hydra.sweep.dir={main}/outputs/tables/t"],
            "added_launches": [{"checkout": str(main), "launch_command": [f"{main}/.venv/bin/python"]}]}
    assert launch_record_relative(meta, main) == {
        "launch_command": [".venv/bin/python", "hydra.sweep.dir=outputs/tables/t"],
        "added_launches": [{"launch_command": [".venv/bin/python"]}]}
