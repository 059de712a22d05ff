"""Tables: every conf/table/*.yaml and conf/experiment/*.yaml composes and validates, the table schema
rejects bad files with clear messages, the findings are computed from the runs (differences shown,
not hidden), and SMOKE=1 make_table runs end to end (one table here; every table under -m slow).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO, TASK, WARMUP

from grpo_lab.tables.findings import build
from grpo_lab.tables.launch import parallel_jobs, prewarm_overrides, unrecorded_jobs
from grpo_lab.tables.plan import compose_jobs, make_plan, preflight, variant_overrides, variant_yaml, write_variant_files
from grpo_lab.tables.spec import TableSpecError, load_spec, override_key

TABLES = sorted(p.stem for p in (REPO / "conf" / "table").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("gpu_*.yaml"))   # paper-scale GPU recipes
# Jobs per table at lab scale (conditions x 3 seeds), as documented in each yaml.
# Jobs at --scale lab and full: dapo, std_norm and clip sweep the task (chain_sum, partial_sums) at lab
# scale only (lab_only_sweep), so their full-scale recipes run half as many.
EXPECTED_JOBS = {"group_size": (12, 12), "dapo": (36, 18), "algorithms": (21, 21), "std_norm": (18, 9),
                 "clip": (36, 18), "kl": (15, 15), "async": (9, 9), "tasks": (30, 30), "smollm2": (8, 8),
                 "overoptimization": (80, 80), "losses": (21, 21), "mismatch": (8, 8),
                 "tools": (12, 12)}
# The real-model tables run 2 seeds (each of their runs costs many times a tiny-model run); overoptimization 8 (its
# runs take under a minute, and its claims need them for ±2.5 points); the others 3.
SEEDS = {"smollm2": [0, 1], "mismatch": [0, 1], "overoptimization": list(range(8))}


def test_the_issue_tables_exist():
    assert set(EXPECTED_JOBS) <= set(TABLES)


def test_prewarm_builds_one_warm_up_per_swept_task_and_seed(tmp_path):
    """A warm-up is built from model, task and warm-up settings: a table sweeping the task gets one
    prewarm job per task and seed; a sweep over anything else (group size) adds none."""
    tasks = make_plan(load_spec("tasks"), runs_root=tmp_path, launcher="joblib", jobs=2)
    ov = prewarm_overrides(tasks)
    assert "task=chain_sum,basic_arithmetic,simple_equations,gcd,partial_sums" in ov and "seed=0,1,2" in ov
    assert "trainer.total_steps=0" in ov and parallel_jobs(tasks) == 2
    group_size = make_plan(load_spec("group_size"), runs_root=tmp_path)
    assert not [o for o in prewarm_overrides(group_size) if "," in o and not o.startswith("seed=")]
    assert parallel_jobs(group_size) == 1


def test_sft_controls_run_as_many_at_once_as_the_rl_jobs(tmp_path, monkeypatch):
    """The controls of a joblib table run two at a time (each with the plan's threads); with the basic
    launcher one at a time. only_missing (make_table --sft-only) re-runs just the seeds without a
    completed control, after moving a stopped one's directory to the archive."""
    import threading
    import time

    from grpo_lab.tables import launch

    running, peak, lock, started = [0], [0], threading.Lock(), []

    def run(cmd, log, env):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(Path(cmd[cmd.index("--run-dir") + 1]))
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        assert env == plan.env
        return 0

    monkeypatch.setattr(launch, "run_logged", run)
    plan = make_plan(load_spec("tasks"), runs_root=tmp_path, launcher="joblib", jobs=2)
    assert launch.run_sft_controls(plan, tmp_path / "log", 10.0, ["task=gcd"]) == {0: 0, 1: 0, 2: 0}
    assert peak[0] == 2
    assert [d.name for d in started] == ["0_sft_control_gcd_s0", "1_sft_control_gcd_s1", "2_sft_control_gcd_s2"]
    # seed 0 completed, seed 1 stopped half-way (metrics, no completed summary), seed 2 never started
    for d, status in zip(started[:2], ["completed", "stopped"]):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("{}\n")
        (d / "summary.json").write_text(json.dumps({"status": status}))
    peak[0], started[:] = 0, []
    plan = make_plan(load_spec("tasks"), runs_root=tmp_path)
    assert launch.run_sft_controls(plan, tmp_path / "log", 10.0, ["task=gcd"], only_missing=True) == {1: 0, 2: 0}
    assert peak[0] == 1 and [d.name for d in started] == ["1_sft_control_gcd_s1", "2_sft_control_gcd_s2"]
    assert not started[0].exists()   # moved aside, not deleted:
    assert list(tmp_path.glob("_archive/tasks-sft-*/1_sft_control_gcd_s1/metrics.jsonl"))
    assert (plan.runs_dir / "sft_control" / "0_sft_control_gcd_s0" / "summary.json").exists()


def test_sft_only_runs_each_blocks_own_seeds_at_the_budget_of_its_timed_runs(tmp_path, monkeypatch):
    """--sft-only (only_missing): a block gets controls for the seeds its matched rows ran (gcd 0-2 next to
    basic_arithmetic 0-4; it once gave gcd controls for 3 and 4 too), a block without runs gets neither
    controls nor a note, and the note names the seeds whose step times set the budget (a run restored
    from the record has none)."""
    from grpo_lab.tables import launch

    started = []
    monkeypatch.setattr(launch, "run_logged", lambda cmd, log, env: started.append(
        (Path(cmd[cmd.index("--run-dir") + 1]).name, float(cmd[cmd.index("--wall-time") + 1]))) or 0)
    plan = make_plan(load_spec("tasks"), runs_root=tmp_path)
    for task, seeds in (("gcd", range(3)), ("basic_arithmetic", range(5))):
        for seed in seeds:
            _fake_run(plan.runs_dir / f"{task}_grpo{seed}", "grpo", seed, 0.5, extra=f"- task={task}\n")
    restored = plan.runs_dir / "basic_arithmetic_grpo4" / "metrics.jsonl"   # as record.restore writes it
    restored.write_text(json.dumps({"step": 150, "samples": 38400, "eval/accuracy": 0.5}) + "\n")
    plan.seeds = [0, 1, 2, 3, 4]                      # finish_sft_controls: every seed on disk
    notes = []
    launch.sft_controls(plan, tmp_path / "log", notes, only_missing=True)
    assert sorted(started) == sorted([(f"{i}_sft_control_gcd_s{i}", 0.2) for i in range(3)]
                                     + [(f"{i}_sft_control_basic_arithmetic_s{i}", 0.2) for i in range(5)])
    by_task = {n.split("SFT control of task=")[1].split(":")[0]: n for n in notes}
    assert sorted(by_task) == ["basic_arithmetic", "gcd"]
    assert "that ran on this machine, seeds 0,1,2)" in by_task["gcd"]
    assert "that ran on this machine, seeds 0,1,2,3)" in by_task["basic_arithmetic"]


@pytest.mark.parametrize("name", TABLES)
def test_table_spec_loads_and_cites_its_paper(name):
    spec = load_spec(name)
    assert "arXiv" in spec.paper_finding
    assert spec.seeds == SEEDS.get(name, [0, 1, 2]) and spec.target is not None
    assert spec.experiment and (REPO / "conf" / "experiment" / f"{spec.experiment}.yaml").is_file()


@pytest.mark.parametrize("name", TABLES)
def test_every_table_plans_its_jobs_and_its_smoke_set_passes_preflight(name, tmp_path):
    """Each table plans the jobs it says (EXPECTED_JOBS, at lab and full scale), and make_table's preflight
    composes and validates its smoke set (one seed of every row). That every row validates at lab, full and
    smoke scale and sets what it claims is tests/test_table_claims.py's, which composes each row once for both
    (composing every seed of every table here too made this test a quarter of the suite)."""
    spec = load_spec(name)
    for scale in ("lab", "full"):
        plan = make_plan(spec, scale=scale, runs_root=tmp_path / scale)
        if name in EXPECTED_JOBS:
            assert len(plan.jobs()) == EXPECTED_JOBS[name][scale == "full"], scale
        assert len(plan.jobs()) == len(plan.seeds) * len(make_plan(spec, scale=scale, runs_root=tmp_path / "one",
                                                                   seeds=spec.seeds[:1]).jobs())
    lab = make_plan(spec, runs_root=tmp_path / "lab")
    smoke = make_plan(spec, smoke=True, runs_root=tmp_path / "smoke")
    assert preflight(smoke) == len(lab.jobs()) // len(lab.seeds)  # one seed


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates_without_a_gpu(name):
    from hydra import compose, initialize_config_dir

    from grpo_lab.config import finalize, register_configs, validate

    register_configs()

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=[f"experiment={name}"]))
    validate(cfg, machine=False)            # learner.device=cuda: checked where the recipe runs
    # Paper-scale recipes: a pretrained model from a local path, vLLM rollouts, no SFT warm-up.
    assert cfg.model.builder == "pretrained" and cfg.model.path.startswith("/models/")
    assert cfg.rollout.engine == "vllm" and cfg.learner.lr == 1e-6 and cfg.warmup.max_steps == 0
    assert cfg.task.source == "local_dataset"


def test_variant_files_beat_the_experiment_at_full_scale(tmp_path):
    plan = make_plan(load_spec("dapo"), scale="full", runs_root=tmp_path)
    write_variant_files(plan)
    jobs = [j for j in plan.jobs() if "seed=0" in j]
    cfgs = {job[0].split("=")[1]: cfg for job, cfg in compose_jobs(plan, jobs)}
    base, top = cfgs["grpo"].algorithm, cfgs["dynamic_sampling"].algorithm
    assert (base.aggregation, base.clip_high, base.overlong.filter, base.overlong.soft_buffer,
            base.dynamic_sampling.enabled) == ("seq_mean_token_mean", 0.2, False, 0, False)
    assert (top.aggregation, top.clip_high, top.overlong.filter, top.overlong.soft_buffer,
            top.dynamic_sampling.enabled) == ("token_mean", 0.28, True, 4096, True)
    assert cfgs["clip_higher"].algorithm.overlong.soft_buffer == 0  # rungs below do not leak upwards
    assert cfgs["grpo"].rollout.group_size == 16 and cfgs["grpo"].algorithm.minibatches == 16


def test_group_size_table_holds_the_sample_budget_fixed(tmp_path):
    plan = make_plan(load_spec("group_size"), runs_root=tmp_path)
    write_variant_files(plan)
    jobs = [j for j in plan.jobs() if "seed=0" in j]
    per_step = set()
    for _job, cfg in compose_jobs(plan, jobs):
        per_step.add(cfg.rollout.group_size * cfg.trainer.prompts_per_step)
        assert cfg.trainer.total_samples == 38400 and cfg.rollout.engine == "hf"
    assert per_step == {256}


def write_spec(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("body, message", [
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: [x=1]}]\nvaraints: []\n",
     "unknown key(s) varaints"),
    ("title: t\nvariants: [{name: a, overrides: [rollout=hf]}]\n", "`paper_finding` is required"),
    ("title: t\npaper_finding: p\nfixed: [seed=3]\nsweep: {a.b: '1,2'}\n", "'seed' is set by make_table.py"),
    ("title: t\npaper_finding: p\nfixed: ['algorithm.epochs=1,4']\nvariants: [{name: a, overrides: []}]\n",
     "is a sweep; put swept keys under `sweep:`"),
    ("title: t\npaper_finding: p\nfixed: [algorithm.clip_high=0.3]\n"
     "variants: [{name: a, overrides: [algorithm.clip_high=0.28]}]\n", "the command line would override the variant"),
    ("title: t\npaper_finding: p\nevery_scale: [reward.noise.kind=flip]\n"
     "variants: [{name: a, overrides: [reward.noise.kind=none]}]\n", "the command line would override the variant"),
    ("title: t\npaper_finding: p\nfixed: [algorithm=dpo]\nevery_scale: [algorithm=grpo]\n"
     "variants: [{name: a, overrides: []}]\n", "algorithm set in both `fixed` and `every_scale`"),
    ("title: t\npaper_finding: p\nsweep: {a: '1,2'}\ncolumns: [final_acc, nonsense]\n", "unknown column 'nonsense'"),
    ("title: t\npaper_finding: p\n", "nothing to compare"),
    ("title: t\npaper_finding: p\nsweep: {a: '1,2'}\ntarget: 65\n", "accuracy fraction in [0, 1]"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: []}, {name: a, overrides: []}]\n",
     "variant names must be unique"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: []}]\nsft_control: {match: b}\n",
     "sft_control.match must name a variant"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: []}]\npaper_direction: {a: higher}\n",
     "paper_direction['a'] must be one of better, worse, same, got 'higher'"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: []}]\npaper_direction: {b: better}\n",
     "paper_direction: 'b' is not a variant; variants: a"),
    ("title: t\npaper_finding: p\nsweep: {x.y: '1,2'}\npaper_direction: {x.y=3: worse}\n",
     "paper_direction: 'x.y=3' selects no row; sweep values: x.y=1,2"),
])
def test_bad_table_files_fail_with_a_clear_message(tmp_path, body, message):
    with pytest.raises(TableSpecError) as err:
        load_spec(write_spec(tmp_path, body))
    assert message in str(err.value)


# Schema errors (through the ConfigStore dataclass, grpo_lab/tables/spec.py) name the key and what it must be.
OK = "title: t\npaper_finding: p\nvariants: [{name: a, overrides: []}]\n"


@pytest.mark.parametrize("body, message", [
    # unknown keys, at the top, in a variant and in sft_control
    (OK + "seed: [0]\n", "unknown key(s) seed; valid keys: baseline,"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: [], overides: []}]\n",
     "variants[0]: unknown key(s) overides; valid: full_overrides, name, overrides, paper"),
    (OK + "sft_control: {match: a, evals: 2, wall_time: 30}\n",
     "sft_control: unknown key(s) wall_time; valid: evals, match, paper, wall_time_s"),
    # wrong types
    (OK + "seeds: [0, one]\n", "`seeds[1]`: Value 'one' of type 'str' could not be converted to Integer; "
                               "`seeds` must be a list of integers, e.g. [0, 1, 2]"),
    (OK + "target: high\n", "`target` must be an accuracy fraction in [0, 1], e.g. 0.65, got 'high'"),
    (OK + "cumulative: maybe\n", "`cumulative` must be true or false, got 'maybe'"),
    ("title: t\npaper_finding: p\nvariants: [{name: a, overrides: rollout=hf}]\n",
     "`variants[0].overrides` must be a list of override strings, e.g. ['algorithm=dapo'], got 'rollout=hf'"),
    (OK + "sft_control: {match: a, evals: many}\n", "`sft_control.evals`: Value 'many' of type 'str' could not "
                                                   "be converted to Integer; `sft_control` must be"),
    # missing fields
    ("paper_finding: p\nvariants: [{name: a, overrides: []}]\n", "`title` is required (text)"),
    ("title: t\npaper_finding: p\nvariants: [{overrides: [rollout=hf]}]\n", "variants[0]: `name` is required"),
    (OK + "sft_control: {evals: 2}\n", "sft_control.match must name a variant whose runs set the wall-time budget"),
])
def test_schema_errors_name_the_key(tmp_path, body, message):
    with pytest.raises(TableSpecError) as err:
        load_spec(write_spec(tmp_path, body))
    assert message in str(err.value), str(err.value)


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    with pytest.raises(TableSpecError) as err:
        load_spec(write_spec(tmp_path, "paper_finding: p\nseeds: oops\nvariants: [{name: a, bogus: 1}]\nx: time\n"))
    text = str(err.value)
    for key in ("`title` is required", "`seeds` must be", "variants[0]: unknown key(s) bogus", "`x` must be samples"):
        assert key in text, text


def test_the_table_schema_is_in_the_config_store():
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from grpo_lab.tables.spec import SCHEMA_NAME, register_table_schema

    register_table_schema()
    node = ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml").node
    assert node.x == "samples" and node.seeds == [0, 1, 2] and OmegaConf.is_missing(node, "title")


def test_a_job_that_does_not_validate_stops_the_table_before_launch(tmp_path):
    spec = load_spec(write_spec(tmp_path, """
        title: t
        paper_finding: p
        variants:
          - {name: ok, overrides: [rollout.temperature=1.0]}
          - {name: cold, overrides: [rollout.temperature=0.0]}
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", seeds=[0])
    with pytest.raises(TableSpecError) as err:
        preflight(plan)
    assert "1 of 2 jobs" in str(err.value) and "+variant=cold" in str(err.value)
    assert "rollout.temperature=0.0 must be > 0" in str(err.value)


def test_cumulative_ladder_and_variant_file(tmp_path):
    spec = load_spec("dapo")
    ladder = dict((v.name, ov) for v, ov in variant_overrides(spec, "lab"))
    assert ladder["grpo"] == ["algorithm.aggregation=seq_mean_token_mean"]
    assert ladder["token_level_loss"][-1] == "algorithm.aggregation=token_mean"
    assert "algorithm.aggregation=seq_mean_token_mean" not in ladder["token_level_loss"]
    text = variant_yaml("dapo_row", ["algorithm=dapo", "algorithm.clip_high=0.3"])
    assert text.startswith("# @package _global_")
    assert "override /algorithm: dapo" in text and "clip_high: 0.3" in text and "run_name: dapo_row_s${seed}" in text


def _fake_run(d: Path, variant: str, seed: int, acc: float | None, status: str = "completed", extra: str = ""):
    d.mkdir(parents=True)
    (d / ".hydra").mkdir()
    (d / ".hydra" / "overrides.yaml").write_text(f"- +variant={variant}\n- seed={seed}\n- rollout=hf\n{extra}")
    (d / "config.yaml").write_text(f"seed: {seed}\nrun_name: {variant}_s{seed}\nrollout: {{temperature: {variant!r}}}\n")
    rows = [{"step": 0, "samples": 0, "eval/accuracy": 0.5},
            {"step": 150, "samples": 38400, "perf/step_time_s": 0.2, "eval/accuracy": acc}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    final = {} if acc is None else {"eval/accuracy": acc}
    (d / "summary.json").write_text(json.dumps({
        "status": status, "error": None if status == "completed" else "RuntimeError: boom",
        "run_name": f"{variant}_s{seed}", "initial": {"eval/accuracy": 0.5}, "final": final, "steps": 150}))


def test_findings_report_differences_with_confidence_intervals(tmp_path):
    spec = load_spec(write_spec(tmp_path, """
        title: findings
        paper_finding: "b beats a (arXiv 0000.00000)"
        paper_metric: "%"
        variants:
          - {name: a, overrides: [rollout.temperature=1.0], paper: "30"}
          - {name: b, overrides: [rollout.temperature=0.9], paper: "50"}
          - {name: c, overrides: [rollout.temperature=0.8]}
        baseline: a
        target: 0.6
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    runs = plan.runs_dir
    for i, (acc_a, acc_b, acc_c) in enumerate([(0.60, 0.70, 0.61), (0.62, 0.71, 0.55), (0.61, 0.72, 0.66)]):
        _fake_run(runs / f"a{i}", "a", i, acc_a)
        _fake_run(runs / f"b{i}", "b", i, acc_b)
        _fake_run(runs / f"c{i}", "c", i, acc_c)
    _fake_run(runs / "c_failed", "c", 3, None, status="failed")
    (runs / "dead" / ".hydra").mkdir(parents=True)  # a job that died before the trainer wrote anything
    notes = [f"job `{j.relative_to(runs)}` failed before writing" for j in unrecorded_jobs(runs)]
    assert notes == ["job `dead` failed before writing"]
    result = build(plan, header_extra={"command": "test"}, launch_notes=notes)
    md = result["md"].read_text()
    assert result["findings"]["best"] == "b" and result["findings"]["baseline"] == "a"
    # b: +10 pp over a with a CI that excludes 0; c: CIs overlap; the paper column sits next to ours.
    # Δ is paired by seed: b − a = .10, .09, .11 -> +10.0 ± t_{.975,2}·0.01/√3 = ± 2.5 pp.
    assert "| b | 50 | 71.0 ± 2.5 (n=3) | +10.0 ± 2.5 |" in md
    assert "paired by seed" in md and "widest Δ half-width in this table:" in md
    # c − a = +.01, −.07, +.05: sd 6.1 pp -> 26 seeds for ±2.5 pp (b's sd of 1 pp needs 3)
    assert "seeds for ±2.5 pp on every row at the spread observed: **26** (ran 3)" in md
    assert result["findings"]["seeds_for_target_half_width"] == 26 and result["findings"]["seeds_run"] == 3
    assert "(CI excludes 0)" in md and "The paper's best row is **b**; our best agrees." in md
    # The paper's direction for b comes from its numbers (50 > 30): the paired CI lies above 0.
    assert "| +10.0 ± 2.5 | better | reproduced |" in md
    assert "| c | – | 60.7 ± 13.7 (n=3) | -0.3 ± 15.2 | – | – |" in md  # the paper says nothing about c
    assert result["findings"]["paper_direction"] == {"b": {"paper": "better", "greedy": "reproduced"}}
    assert "greedy accuracy: reproduced 1 of 1" in md
    assert "| c | 3 ok / 1 failed |" in md and "RuntimeError: boom" in md and "job `dead`" in md


def test_seeds_for_a_half_width_by_hand():
    from grpo_lab.report.stats import seeds_for_half_width

    assert seeds_for_half_width(0.02, 0.025) == 5       # t_{.975,4}·2/√5 = 2.48 pp; 4 seeds: 3.18
    assert seeds_for_half_width(0.01, 0.025) == 3       # 4.30·1/√3 = 2.48
    assert seeds_for_half_width(0.001, 0.025) == 2      # never fewer than 2 (no interval from one seed)
    assert seeds_for_half_width(float("nan"), 0.025) is None
    assert seeds_for_half_width(1.0, 0.025, max_seeds=50) is None


@pytest.mark.parametrize("direction, d, half, verdict", [
    ("better", 0.05, 0.02, "reproduced"),                  # CI [+3, +7] above 0
    ("better", -0.05, 0.02, "contradicted"),               # CI [−7, −3] below 0
    ("better", 0.01, 0.02, "unresolved, paper's side"),    # CI [−1, +3]: Δ > 0, CI includes 0
    ("better", -0.01, 0.02, "unresolved, other side"),
    ("worse", -0.05, 0.02, "reproduced"),                  # the paper says lower: CI [−7, −3]
    ("worse", 0.05, 0.02, "contradicted"),
    ("worse", -0.01, 0.02, "unresolved, paper's side"),
    ("same", 0.01, 0.02, "consistent"),                    # no difference claimed; CI includes 0
    ("same", 0.03, 0.02, "contradicted"),
    ("better", 0.05, float("nan"), "n/a (one seed)"),
])
def test_direction_verdicts_by_hand(direction, d, half, verdict):
    from grpo_lab.tables.findings import direction_verdict

    assert direction_verdict(direction, d, half) == verdict


def test_explicit_directions_select_rows_by_sweep_values_and_judge_mean_at_k_too(tmp_path):
    """paper_direction keys select sweep rows (several key=value terms); each row gets a verdict on greedy
    accuracy and on mean@k, from paired Δ against its block's baseline."""
    spec = load_spec(write_spec(tmp_path, """
        title: clip
        paper_finding: "0.2 is best (arXiv 1707.06347)"
        sweep: {rollout.temperature: "1.0,0.9,0.8"}
        baseline: rollout.temperature=1.0
        paper_direction: {"rollout.temperature=0.9": worse, "rollout.temperature=0.8": same}
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    # greedy per seed (and mean@k = greedy − 0.1, or −0.2 for t=0.8)
    accs = {"1.0": (.60, .62, .61), "0.9": (.50, .53, .51), "0.8": (.60, .63, .61)}
    for t, values in accs.items():
        for seed, acc in enumerate(values):
            d = plan.runs_dir / f"t{t}_{seed}"
            _fake_run(d, f"t{t}", seed, acc, extra=f"- rollout.temperature={t}\n")
            summary = json.loads((d / "summary.json").read_text())
            summary["final"]["eval/sampled_accuracy"] = acc - (0.2 if t == "0.8" else 0.1)
            (d / "summary.json").write_text(json.dumps(summary))
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    md = result["md"].read_text()
    # 0.9 − 1.0 = −.10, −.09, −.10 greedy and the same for mean@k: −9.7 ± 1.4, below 0 -> reproduced twice.
    # 0.8 − 1.0 = 0, +.01, 0 greedy (CI includes 0: consistent); mean@k −.10, −.09, −.10 (contradicted).
    assert ("| t0.9 | 51.3 ± 3.8 (n=3) | -9.7 ± 1.4 | 41.3 ± 3.8 (n=3) | -9.7 ± 1.4 | worse | "
            "reproduced; reproduced |") in md
    assert ("| t0.8 | 61.3 ± 3.8 (n=3) | +0.3 ± 1.4 | 41.3 ± 3.8 (n=3) | -9.7 ± 1.4 | same | "
            "consistent; contradicted |") in md
    assert "| t1.0 (baseline) | 61.0 ± 2.5 (n=3) | 0 | 51.0 ± 2.5 (n=3) | 0 | – | – |" in md
    found = result["findings"]["paper_direction"]
    assert found["t0.8"] == {"paper": "same", "greedy": "consistent", "sampled": "contradicted"}
    assert "greedy accuracy: reproduced 1, consistent 1 of 2; mean@k: reproduced 1, contradicted 1 of 2" in md


def smoke_table(name: str, cache: Path, tmp_path: Path, launcher: dict | None = None) -> subprocess.CompletedProcess:
    # Extra overrides after `--` make the smoke jobs reuse the session's cached tiny-model warm-up
    # (conftest); a table whose smoke set turns the warm-up off (the pretrained SmolLM2 recipe) sizes its
    # own smoke run instead.
    pretrained = any(override_key(o) == "warmup.max_steps" for o in load_spec(name).smoke)
    return subprocess.run(
        [sys.executable, "scripts/make_table.py", name, "--runs-root", str(tmp_path / "runs"),
         "--tables-root", str(tmp_path / "tables"), "--", f"cache_dir={cache}", *([] if pretrained else TASK + WARMUP)],
        # PYTHONPATH: the script imports this checkout's grpo_lab even where the venv's editable install is another's.
        cwd=REPO, env={**os.environ, "SMOKE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO), **(launcher or {})},
        capture_output=True, text=True,
        timeout=900)


def check_smoke_table(name: str, proc: subprocess.CompletedProcess, tmp_path: Path) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "tables" / f"{name}.md").read_text()
    assert "(SMOKE: tiny budgets, one seed; not a result)" in md
    assert "**What the paper found.**" in md and "**What we found**" in md and "- **Machine:**" in md
    assert (tmp_path / "tables" / f"{name}.csv").is_file() and (tmp_path / "tables" / f"{name}.png").is_file()
    assert "## Failed runs" not in md, md
    assert not (REPO / "tables" / f"{name}.md").exists() or "SMOKE" not in (REPO / "tables" / f"{name}.md").read_text()
    return md


@pytest.mark.slow
def test_smoke_table_end_to_end(warm_cache, tmp_path):
    # Two jobs at a time (joblib), as the committed tables ran: the warm-ups (one per task) are built
    # before the multirun, one prewarm job per task and seed.
    proc = smoke_table("std_norm", warm_cache, tmp_path, launcher={"LAUNCHER": "joblib", "JOBS": "2"})
    md = check_smoke_table("std_norm", proc, tmp_path)
    assert "warm-up cache filled before the parallel launch" in md
    prewarmed = sorted(p.name for p in (tmp_path / "runs" / "_prewarm" / "std_norm").glob("table-std_norm-*/*")
                       if p.is_dir())
    assert [n for n in prewarmed if "chain_sum" in n] and [n for n in prewarmed if "partial_sums" in n], prewarmed
    # Two blocks (task: chain_sum, partial_sums), each row once per block.
    for row in ("group_std", "no_std", "batch_std"):
        for task in ("chain_sum", "partial_sums"):
            assert any(row in line and task in line and "| 1 ok / 0 failed |" in line for line in md.splitlines()), (
                row, task)


@pytest.mark.slow
@pytest.mark.parametrize("name", TABLES)
def test_smoke_every_table(name, warm_cache, tmp_path):
    proc = smoke_table(name, warm_cache, tmp_path)
    md = check_smoke_table(name, proc, tmp_path)
    if name == "algorithms":
        assert "| sft_control | 1 ok / 0 failed |" in md
        # A launch stopped before its SFT control completed: --sft-only runs just that control again.
        control = next((tmp_path / "runs" / name / "sft_control").iterdir())
        summary = json.loads((control / "summary.json").read_text())
        (control / "summary.json").write_text(json.dumps({**summary, "status": "stopped"}))
        proc = subprocess.run([sys.executable, "scripts/make_table.py", name, "--sft-only", "--runs-root",
                               str(tmp_path / "runs"), "--tables-root", str(tmp_path / "tables"), "--",
                               f"cache_dir={warm_cache}", *TASK, *WARMUP],
                              cwd=REPO, env={**os.environ, "SMOKE": "1", "WANDB_MODE": "offline",
                                             "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        md = (tmp_path / "tables" / f"{name}.md").read_text()
        assert "| sft_control | 1 ok / 0 failed |" in md and "SFT controls without a completed run: run by" in md
        assert re.search(r"wall time [\d.]+ min for .*; SFT controls finished .*; wall time [\d.]+ min", md)
        assert json.loads((control / "summary.json").read_text())["status"] == "completed"
        assert list((tmp_path / "runs" / "_archive").glob(f"{name}-sft-*/{control.name}/summary.json"))


def test_rows_grouped_by_config_keys_keep_their_variant_names(tmp_path):
    spec = load_spec(write_spec(tmp_path, """
        title: by config
        paper_finding: "p (arXiv 0000.00000)"
        variants:
          - {name: a, overrides: [rollout.temperature=1.0]}
          - {name: b, overrides: [rollout.temperature=0.9]}
        baseline: b
        group_by: [rollout.temperature]
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    for i in range(2):
        _fake_run(plan.runs_dir / f"a{i}", "a", i, 0.6 + i / 100)
        _fake_run(plan.runs_dir / f"b{i}", "b", i, 0.5 + i / 100)
    result = build(plan, header_extra={}, launch_notes=[])
    assert result["keys"] == ["rollout.temperature"]
    assert result["findings"]["baseline"] == "b" and result["findings"]["best"] == "a"
    assert "| b (baseline) |" in result["md"].read_text()


def test_the_readme_lists_exactly_what_the_committed_tables_say():
    """The lab notebook's table list (tables/README.md) is generated (grpo_lab.tables.readme): it must match
    tables/ as committed."""
    from grpo_lab.tables import readme

    assert readme.main(["--check"]) == 0, "tables/README.md's tables block is stale: run `make readme-tables`"


def test_a_readme_row_puts_each_blocks_finding_under_its_own_name(tmp_path):
    """A block with no completed run has no "Best mean" line; the findings of the blocks after it once
    moved up one block each in the README (matched by position, not by block)."""
    from grpo_lab.tables import readme

    spec = load_spec(write_spec(tmp_path, BLOCKS_SPEC))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    for variant, values in {"grpo": (.70, .72, .71), "dapo": (.80, .81, .82)}.items():
        for seed, acc in enumerate(values):
            _fake_run(plan.runs_dir / f"chain_sum_{variant}{seed}", variant, seed, None, status="failed",
                      extra="- task=chain_sum\n")
            _fake_run(plan.runs_dir / f"gcd_{variant}{seed}", variant, seed, acc, extra="- task=gcd\n")
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    assert list(result["findings"]["blocks"]) == ["task=chain_sum", "task=gcd"]    # the one without runs first
    assert result["md"].read_text().count("Best mean final accuracy") == 1
    row = readme.table_row(result["md"])
    assert "*task=gcd*: Best mean final accuracy: **dapo**" in row and "*task=chain_sum*: Best" not in row


def test_readme_rows_come_from_the_table_files(tmp_path):
    from grpo_lab.tables import readme

    (tmp_path / "t.md").write_text("# A title\n\n- **Command:** `make table-t`\n"
                                   "- **Date:** x; wall time 3.5 min for 6 jobs; seeds 3 added y; wall time 1.0 min for 2 jobs\n\n"
                                   "**What we found** (... widest Δ half-width: **2.0 pp**; seeds ...: **3** (ran 4)):\n\n"
                                   "Best mean final accuracy: **b** (60.0%), +10.0 ± 2.0 pp over the baseline a (CI excludes 0).\n")
    (tmp_path / "t_findings.json").write_text(json.dumps(
        {"rows": {"a": 0.5, "b": 0.6}, "max_diff_half_width": 0.02, "seeds_for_target_half_width": 3,
         "seeds_run": 4}))
    (tmp_path / "smoke.md").write_text("# no findings beside it: not listed\n")
    block = readme.render(tmp_path)
    assert ("| [t](t.md) | A title | `make table-t` | 4.5 min in 2 launches | a 50.0, b 60.0 % | "
            "2.0 pp (4 seeds; 3 for ±2.5) | Best mean final accuracy: "
            "**b** (60.0%), +10.0 ± 2.0 pp over the baseline a (CI excludes 0). |") in block
    assert "smoke" not in block
    text = f"intro\n{readme.BEGIN}\nold rows\n{readme.END}\noutro\n"
    assert readme.updated(text, tmp_path) == f"intro\n{block}\noutro\n"
    with pytest.raises(ValueError, match="no generated tables block"):
        readme.updated("no markers", tmp_path)


def test_readme_lists_every_block_of_a_table(tmp_path):
    """A table with one baseline per task lists each block's numbers and finding (the second block's
    finding was once left out of the README), and each block's own seed count: a block with no Δ (one
    row completed) once shifted the later blocks' counts, printing "? seeds"."""
    from grpo_lab.tables import readme

    (tmp_path / "b.md").write_text(
        "# Blocks\n\n- **Command:** `make table-b`\n- **Date:** x; wall time 2.0 min for 4 jobs\n\n"
        "*task=p*\n\n**What we found** (...: **5** (ran 3)):\n\nBest mean final accuracy: **y** (30.0%), first.\n\n"
        "*task=g*\n\n**What we found** (...):\n\nBest mean final accuracy: **x** (10.0%) — the baseline itself.\n\n"
        "*task=q*\n\n**What we found** (...: **4** (ran 2)):\n\nBest mean final accuracy: **x** (50.0%), second.\n")
    block = {"task=p": {"rows": {"task=p x": 0.2, "task=p y": 0.3}, "max_diff_half_width": 0.031,
                        "seeds_for_target_half_width": 5, "seeds_run": 3},
             "task=g": {"rows": {"task=g x": 0.1}, "max_diff_half_width": None,
                        "seeds_for_target_half_width": None, "seeds_run": 3},
             "task=q": {"rows": {"task=q, x": 0.5, "task=q, y": 0.4}, "max_diff_half_width": 0.029,
                        "seeds_for_target_half_width": 4, "seeds_run": 2}}
    (tmp_path / "b_findings.json").write_text(json.dumps({"blocks": block, "rows": {}}))
    row = readme.table_row(tmp_path / "b.md")
    assert "| 2.0 min | *task=p*: x 20.0, y 30.0; *task=g*: x 10.0; *task=q*: x 50.0, y 40.0 % |" in row
    assert "| *task=p*: 3.1 pp (3 seeds; 5 for ±2.5); *task=q*: 2.9 pp (2 seeds; 4 for ±2.5) |" in row
    assert ("*task=p*: Best mean final accuracy: **y** (30.0%), first. *task=g*: Best mean final accuracy: **x** "
            "(10.0%) — the baseline itself. *task=q*: Best mean final accuracy: **x** (50.0%), second.") in row


# Two tasks, each its own block with its own grpo baseline.
BLOCKS_SPEC = """
        title: blocks
        paper_finding: "x (arXiv 0000.00000)"
        sweep: {task: "gcd,chain_sum"}
        variants:
          - {name: grpo, overrides: [rollout.temperature=1.0]}
          - {name: dapo, overrides: [rollout.temperature=0.9]}
        within: [task]
        baseline: grpo
        target: 0.6
    """


def test_blocks_compare_each_row_with_their_own_baseline(tmp_path):
    """within: [task]: one findings section per task, Δ against that task's grpo row, paired by seed."""
    spec = load_spec(write_spec(tmp_path, BLOCKS_SPEC))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    assert plan.blocks() == [["task=gcd"], ["task=chain_sum"]]
    accs = {"gcd": {"grpo": (.20, .22, .24), "dapo": (.30, .31, .35)}, "chain_sum": {"grpo": (.70, .72, .71),
                                                                                      "dapo": (.70, .71, .72)}}
    for task, rows in accs.items():
        for variant, values in rows.items():
            for seed, acc in enumerate(values):
                _fake_run(plan.runs_dir / f"{task}_{variant}{seed}", variant, seed, acc, extra=f"- task={task}\n")
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    md = result["md"].read_text()
    # gcd: dapo − grpo = .10, .09, .11 per seed -> +10.0 ± 2.5; chain_sum: 0, −.01, +.01 -> +0.0 ± 2.5
    assert "*task=gcd*" in md and "*task=chain_sum*" in md
    assert "| dapo | 32.0 ± " in md and "| +10.0 ± 2.5 |" in md and "| +0.0 ± 2.5 |" in md
    assert set(result["findings"]["blocks"]) == {"task=gcd", "task=chain_sum"}
    assert result["findings"]["rows"]["task=gcd dapo"] == pytest.approx(0.32)


def test_a_launch_that_pins_a_block_key_keeps_the_blocks_apart(tmp_path):
    """`--add-seeds 3 -- task=gcd` puts task=gcd among the launch's shared overrides; the table built after it
    still has one block per task (it once ignored task as shared, merged both tasks into a block "task=None"
    and paired each gcd seed with a chain_sum run of the same seed)."""
    spec = load_spec(write_spec(tmp_path, BLOCKS_SPEC))
    plan = make_plan(spec, extra=["task=gcd"], runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    assert "task=gcd" in plan.base
    assert plan.blocks() == [["task=gcd"]]            # this launch's SFT controls: gcd's only
    assert plan.pinned_block == ["task=gcd"]          # named in the header's "seeds 3 of task=gcd added"
    assert make_plan(spec, runs_root=tmp_path / "runs").pinned_block == []
    accs = {("gcd", "grpo"): (.20, .22, .24, .21), ("gcd", "dapo"): (.30, .31, .35, .31),
            ("chain_sum", "grpo"): (.70, .72, .71), ("chain_sum", "dapo"): (.70, .71, .72)}
    for (task, variant), values in accs.items():
        for seed, acc in enumerate(values):
            _fake_run(plan.runs_dir / f"{task}_{variant}{seed}", variant, seed, acc, extra=f"- task={task}\n")
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    assert set(result["findings"]["blocks"]) == {"task=gcd", "task=chain_sum"}
    # gcd: dapo − grpo = .10, .09, .11, .10 per seed; chain_sum's 3 seeds stay in their own block
    assert result["findings"]["rows"]["task=gcd dapo"] == pytest.approx(0.3175)
    assert result["findings"]["rows"]["task=chain_sum grpo"] == pytest.approx(0.71)
    assert "task=None" not in result["md"].read_text()


@pytest.mark.slow
def test_an_added_launch_runs_in_directories_of_its_own(tmp_path):
    """Hydra numbers an added launch's jobs from 0 again and a run's name holds only variant and seed, so
    `--add-seeds 3 -- task=chain_sum` once ran into the directories `--add-seeds 3 -- task=gcd` had left
    (0_grpo_s3: Hydra rewrote its overrides to chain_sum, the trainer refused, the gcd run was relabelled).
    Now preflight refuses a job whose directory exists, and an added launch names its directories apart."""
    spec = load_spec(write_spec(tmp_path, BLOCKS_SPEC))
    runs = tmp_path / "runs"
    for task, seeds in (("gcd", range(4)), ("chain_sum", range(3))):
        for seed in seeds:
            for num, variant in enumerate(("grpo", "dapo")):
                name = f"{num}_{variant}_s3" if seed == 3 else f"{task}_{variant}{seed}"  # gcd's seed 3: added alone
                _fake_run(runs / spec.name / name, variant, seed, 0.5, extra=f"- task={task}\n")
    plan = make_plan(spec, extra=["task=chain_sum"], seeds=[3], runs_root=runs, tables_root=tmp_path / "tables")
    with pytest.raises(TableSpecError, match=r"job `\+variant=grpo seed=3`: TableSpecError: its run directory "
                                             r"\S*/0_grpo_s3 already exists"):
        preflight(plan)
    # a first launch moves the earlier runs away (archive_previous), so its --dry-run is not stopped by them
    assert preflight(plan, earlier_runs_move=True) == 2
    proc = subprocess.run([sys.executable, "scripts/make_table.py", str(spec.path), "--runs-root", str(runs),
                           "--dry-run", "--", "task=chain_sum"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0 and "6 jobs validated" in proc.stderr, proc.stderr
    plan.name_runs_apart()
    assert preflight(plan) == 2
    gcd_overrides = (plan.runs_dir / "0_grpo_s3" / ".hydra" / "overrides.yaml").read_text()
    # Hydra's own multirun places them (each job then stops at the trainer's first check, total_steps=-1)
    subprocess.run([*plan.command, "trainer.total_steps=-1"], cwd=REPO, capture_output=True, text=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert sorted(d.name for d in plan.runs_dir.glob("added-*")) == [f"added-{plan.stamp}_0_grpo_s3",
                                                                     f"added-{plan.stamp}_1_dapo_s3"]
    assert (plan.runs_dir / "0_grpo_s3" / ".hydra" / "overrides.yaml").read_text() == gcd_overrides


def test_a_row_whose_runs_disagree_on_a_block_key_is_refused(tmp_path):
    """The invariant behind the blocks: every run of a row has the row's block value."""
    from grpo_lab.report import load_runs
    from grpo_lab.report.runs import Group
    from grpo_lab.tables.findings import block_value

    for seed, task in enumerate(("gcd", "gcd", "chain_sum")):
        _fake_run(tmp_path / f"r{seed}", "grpo", seed, 0.5, extra=f"- task={task}\n")
    gcd, gcd_too, chain_sum = load_runs([tmp_path / f"r{i}" for i in range(3)])

    def row(*runs):
        return Group("variant=grpo", {"variant": "grpo"}, list(runs))

    assert block_value(row(gcd, gcd_too), "task") == "gcd"
    with pytest.raises(ValueError, match=r"row 'variant=grpo' holds runs of different task=\['chain_sum', 'gcd'\]"):
        block_value(row(gcd, chain_sum), "task")


def test_lab_only_sweep_keys_leave_the_full_scale_recipe_its_own_value(tmp_path):
    """A lab task sweep (chain_sum vs partial_sums) must not replace a full-scale recipe's own data: at
    --scale full the key is not swept, the table is one block, and jobs/command carry no task override."""
    spec = load_spec(write_spec(tmp_path, """
        title: t
        paper_finding: "x (arXiv 0000.00000)"
        variants: [{name: a, overrides: [algorithm=grpo]}, {name: b, overrides: [algorithm=dapo]}]
        sweep: {task: "chain_sum,partial_sums", algorithm.clip_low: "0.1,0.2"}
        within: [task]
        lab_only_sweep: [task]
        experiment: gpu_clip
        target: 0.6
    """))
    lab = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    full = make_plan(spec, scale="full", runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    assert lab.blocks() == [["task=chain_sum"], ["task=partial_sums"]] and len(lab.jobs()) == 2 * 2 * 2 * 3
    assert full.blocks() == [[]] and len(full.jobs()) == 2 * 2 * 3
    assert not any(o.startswith("task=") for job in full.jobs() for o in job)
    assert not any(a.startswith("task=") for a in full.command)
    assert "algorithm.clip_low=0.1,0.2" in full.command
    with pytest.raises(TableSpecError, match="lab_only_sweep: 'seed' is not a sweep key"):
        load_spec(write_spec(tmp_path, """
            title: t
            paper_finding: "x (arXiv 0000.00000)"
            variants: [{name: a, overrides: [algorithm=grpo]}]
            lab_only_sweep: [seed]
        """))


def test_every_scale_overrides_reach_the_jobs_of_both_scales_and_fixed_only_the_lab_ones(tmp_path):
    """`fixed` is the lab scale's (its engine and budget); --scale full runs `experiment` instead. What makes
    the rows what the table says (the noise table's reward.noise.kind=flip) goes in `every_scale`: in
    `fixed` alone it was lost at full scale and the rows' flip_prob flipped nothing."""
    spec = load_spec(write_spec(tmp_path, """
        title: t
        paper_finding: "x (arXiv 0000.00000)"
        fixed: [rollout=hf, trainer.total_steps=150]
        every_scale: [reward.noise.kind=flip]
        variants: [{name: p0, overrides: [reward.noise.flip_prob=0.0]}, {name: p0.2, overrides: [reward.noise.flip_prob=0.2]}]
        experiment: gpu_noise
        target: 0.6
    """))
    lab = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    full = make_plan(spec, scale="full", runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    assert {"rollout=hf", "trainer.total_steps=150", "reward.noise.kind=flip"} <= set(lab.base)
    assert "experiment=gpu_noise" not in lab.base
    assert {"experiment=gpu_noise", "reward.noise.kind=flip"} <= set(full.base)
    assert "rollout=hf" not in full.base and "trainer.total_steps=150" not in full.base
    assert all("reward.noise.kind=flip" in job for plan in (lab, full) for job in plan.jobs())


def test_within_must_name_a_sweep_key(tmp_path):
    with pytest.raises(TableSpecError, match="within: 'task' is not a sweep key"):
        load_spec(write_spec(tmp_path, """
            title: t
            paper_finding: "x (arXiv 0000.00000)"
            variants: [{name: a, overrides: [rollout.temperature=1.0]}]
            within: [task]
            target: 0.6
        """))


def test_added_seeds_join_the_same_jobs_and_keep_the_first_launch_as_the_tables_header():
    from grpo_lab.tables.launch import jobs_but_seeds, merge_added_launch

    first = ["python", "-m", "grpo_lab.train", "-m", "+variant=a,b", "task.test_size=1000", "seed=0,1,2",
             "logger.group=table-t-1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    added = ["python", "-m", "grpo_lab.train", "-m", "+variant=a,b", "task.test_size=1000", "seed=3",
             "logger.group=table-t-2"]
    assert jobs_but_seeds(first) == jobs_but_seeds(added)      # seeds, wandb group and launcher may differ
    assert jobs_but_seeds(first) != jobs_but_seeds(added + ["trainer.total_steps=10"])  # a changed job may not
    # The plan's warning about a shared override is in the table once; a failure worded as the first
    # launch's is this launch's own and stays (it was once dropped as a repeat).
    warning, failed = "the override x replaces variant a's", "the multirun exited with status 1: ..."
    merged = merge_added_launch(
        {"command": "make_table.py t", "machine": "m", "date": "d0; wall time 5.0 min for 6 jobs",
         "launch_notes": [warning, failed]},
        {"seeds": [3], "date": "d1; wall time 2.0 min for 2 jobs", "exit_code": 1,
         "launch_notes": [warning, failed, "job x failed"]},
        "make_table.py t --add-seeds 3", "seeds 3", inherited=[warning])
    assert merged["command"] == "make_table.py t" and merged["machine"] == "m"
    assert merged["date"] == "d0; wall time 5.0 min for 6 jobs; seeds 3 added d1; wall time 2.0 min for 2 jobs"
    assert merged["launch_notes"] == [warning, failed, "seeds 3 added by `make_table.py t --add-seeds 3` on d1; "
                                      "wall time 2.0 min for 2 jobs (exit 1)", failed, "job x failed"]
    # seeds added on another machine (a later session's): the note says which
    elsewhere = merge_added_launch({"command": "c", "machine": "m", "date": "d0"},
                                   {"date": "d1", "exit_code": 0, "machine": "m2"}, "c --add-seeds 4", "seeds 4")
    assert elsewhere["launch_notes"] == ["seeds 4 added by `c --add-seeds 4` on d1 on m2 (exit 0)"]
    # the interpreter and the table's own paths may differ between checkouts; the jobs may not
    moved = [a.replace("python", "/elsewhere/.venv/bin/python") for a in added[:1]] + added[1:] + [
        "hydra.sweep.dir=/elsewhere/outputs/tables/t", "hydra.searchpath=['file:///elsewhere/.variants']"]
    assert jobs_but_seeds(first) == jobs_but_seeds(moved)


def _two_variant_table(tmp_path):
    """A two-variant table spec and a runner of scripts/make_table.py on it (runs under tmp_path/runs)."""
    spec_path = write_spec(tmp_path, """
        title: t
        paper_finding: "x (arXiv 0000.00000)"
        variants:
          - {name: a, overrides: [rollout.temperature=1.0]}
          - {name: b, overrides: [rollout.temperature=0.9]}
    """)

    def make_table(*args):
        return subprocess.run([sys.executable, "scripts/make_table.py", str(spec_path), "--runs-root",
                               str(tmp_path / "runs"), *args], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)

    return spec_path, make_table


@pytest.mark.slow
def test_add_seeds_refuses_before_running_anything(tmp_path):
    """--add-seeds: no first launch, a seed the table already holds, or jobs that differ in more than their
    seeds each fail in seconds with what to change, and nothing on disk moves."""
    spec_path, add = _two_variant_table(tmp_path)

    proc = add("--add-seeds", "3")
    assert proc.returncode == 2 and "run the table first (without --add-seeds)" in proc.stderr
    plan = make_plan(load_spec(spec_path), runs_root=tmp_path / "runs")
    for v in ("a", "b"):
        _fake_run(plan.runs_dir / f"{v}0", v, 0, 0.5)
    (plan.runs_dir / "table_meta.json").write_text(json.dumps({"command": "first", "launch_command": plan.command}))
    before = sorted(p.name for p in plan.runs_dir.iterdir())
    proc = add("--add-seeds", "0")
    assert proc.returncode == 2 and "seed(s) [0] already have runs" in proc.stderr
    proc = add("--add-seeds", "3", "--", "trainer.total_steps=10")
    assert proc.returncode == 2 and "differ from every earlier launch of the table (the first: `first`)" in proc.stderr
    assert sorted(p.name for p in plan.runs_dir.iterdir()) == before
    # more seeds of some rows: the baseline (a, the first) among them, or nothing pairs with them
    proc = add("--add-seeds", "3", "--variants", "b")
    assert proc.returncode == 2 and "leaves out the baseline row a" in proc.stderr
    # more seeds of one row; then every row at one of those seeds would run that row's seed twice
    proc = add("--add-seeds", "3", "--variants", "a", "--dry-run")
    assert proc.returncode == 0 and "1 jobs validated" in proc.stderr, proc.stderr
    only_a = make_plan(load_spec(spec_path), runs_root=tmp_path / "runs", seeds=[3], only=["a"])
    (plan.runs_dir / "table_meta.json").write_text(json.dumps({
        "command": "first", "launch_command": plan.command, "seeds": [0],
        "added_launches": [{"launch_command": only_a.command, "seeds": [3]}]}))
    proc = add("--add-seeds", "3")
    assert proc.returncode == 2 and "seed(s) [3] already have runs" in proc.stderr
    proc = add("--add-seeds", "3", "--variants", "a,b", "--dry-run")
    assert proc.returncode == 2 and "seed(s) [3] already have runs" in proc.stderr
    proc = add("--add-seeds", "4", "--variants", "a,b", "--dry-run")
    assert proc.returncode == 0 and "2 jobs validated" in proc.stderr, proc.stderr


def test_added_seeds_of_some_rows_are_jobs_an_earlier_launch_ran():
    """--add-seeds --variants a: a subset of a launch's jobs (each key at values that launch ran) may take
    more seeds; a seed is taken once any launch sharing one of the jobs ran it."""
    from grpo_lab.tables.launch import jobs_overlap, jobs_within

    def launch(variants, seeds="0,1", *more):
        return ["python", "-m", "grpo_lab.train", "-m", f"+variant={variants}", "task.test_size=1000", *more,
                f"seed={seeds}", "logger.group=table-t-1", "hydra.sweep.dir=outputs/tables/t"]

    every = launch("a,b,c")
    assert jobs_within(launch("a"), every) and jobs_within(launch("c,a", "5"), every) and jobs_within(every, every)
    assert not jobs_within(launch("a,d"), every)                           # d was never a row
    assert not jobs_within(launch("a", "0", "trainer.total_steps=10"), every)  # another job
    assert not jobs_within(every, launch("a"))                            # b and c were not in it
    assert jobs_overlap(every, launch("a")) and jobs_overlap(launch("a,d"), every)
    assert not jobs_overlap(launch("b"), launch("a")) and not jobs_overlap(launch("a", "0", "k=1"), every)


def test_added_rows_must_be_jobs_no_earlier_launch_ran():
    """--add-rows: a launch's jobs are new only when some key has one value in it and another one in each
    earlier launch; Hydra's parser tells one value from a sweep."""
    from grpo_lab.tables.launch import repeated_jobs_problem

    def launch(*overrides):
        return ["python", "-m", "grpo_lab.train", "-m", "task=a,b", "algorithm.clip_low=0.1,0.2", *overrides,
                "seed=0,1,2", "logger.group=table-t-1", "hydra.sweep.dir=outputs/tables/t"]

    one_epoch = launch("algorithm.epochs=1")
    assert repeated_jobs_problem([one_epoch], launch("algorithm.epochs=4")) is None
    assert repeated_jobs_problem([one_epoch], launch("++algorithm.epochs=4")) is None   # the same key
    # the same jobs (any seeds), a key the first launch left at its default, or a sweep over the old value
    assert repeated_jobs_problem([one_epoch], launch("algorithm.epochs=1")) == shlex.join(one_epoch)
    assert repeated_jobs_problem([one_epoch], launch("algorithm.epochs=1", "trainer.total_steps=10")) is not None
    assert repeated_jobs_problem([one_epoch], launch("algorithm.epochs=1,4")) is not None
    assert repeated_jobs_problem([launch()], launch("algorithm.epochs=4")) is not None
    # new to the first launch but not to rows added since
    four = launch("algorithm.epochs=4")
    assert repeated_jobs_problem([one_epoch, four], launch("algorithm.epochs=4")) == shlex.join(four)
    assert repeated_jobs_problem([one_epoch, four], launch("algorithm.epochs=2")) is None
    # a list value is one value
    assert repeated_jobs_problem([launch("k=[1,2]")], launch("k=[1,3]")) is None


def test_add_rows_refuses_before_running_anything_and_add_seeds_finds_added_rows(tmp_path):
    """--add-rows fails in seconds, leaving the runs as they were, when it could repeat a job; once rows were
    added, --add-seeds recognises their jobs (not only the first launch's) and their seeds."""
    spec_path, make_table = _two_variant_table(tmp_path)

    proc = make_table("--add-rows", "--", "trainer.total_steps=4")
    assert proc.returncode == 2 and "run the table first (without --add-rows)" in proc.stderr
    first = make_plan(load_spec(spec_path), runs_root=tmp_path / "runs", extra=["trainer.total_steps=2"])
    rows = make_plan(load_spec(spec_path), runs_root=tmp_path / "runs", extra=["trainer.total_steps=4"], seeds=[0])
    for v in ("a", "b"):
        _fake_run(first.runs_dir / f"{v}0", v, 0, 0.5, extra="- trainer.total_steps=2\n")
    (first.runs_dir / "table_meta.json").write_text(json.dumps({
        "command": "first", "launch_command": first.command, "seeds": [0],
        "added_launches": [{"launch_command": rows.command, "seeds": [0]}]}))
    before = sorted(p.name for p in first.runs_dir.iterdir())
    for extra in (["trainer.total_steps=2"], ["trainer.total_steps=4"], ["trainer.total_steps=2", "task.test_size=9"]):
        proc = make_table("--add-rows", "--", *extra)
        assert proc.returncode == 2 and "could repeat jobs of an earlier launch" in proc.stderr, proc.stderr
    proc = make_table("--add-rows", "--add-seeds", "1", "--", "trainer.total_steps=8")
    assert proc.returncode == 2 and "two different launches" in proc.stderr
    proc = make_table("--add-seeds", "0", "--", "trainer.total_steps=4")
    assert proc.returncode == 2 and "seed(s) [0] already have runs of these jobs" in proc.stderr
    assert sorted(p.name for p in first.runs_dir.iterdir()) == before
    # seed 1 of the added rows' jobs passes every check (the dry run stops before launching)
    proc = make_table("--add-seeds", "1", "--dry-run", "--", "trainer.total_steps=4")
    assert proc.returncode == 0 and "2 jobs validated" in proc.stderr, proc.stderr
    # Rows added to runs whose warm-ups were recorded start as long a warm-up as theirs, wherever they run.
    for v in ("a", "b"):
        summary = first.runs_dir / f"{v}0" / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()),
                                       "warmup": {"steps": 300, "digest": "abcd", "inputs": "k"}}))
    proc = make_table("--add-rows", "--dry-run", "--", "trainer.total_steps=8")
    assert proc.returncode == 0 and "warmup.replay_steps={0:300}" in proc.stderr, proc.stderr
    assert "added rows replay the recorded warm-up lengths (warmup.replay_steps: seed 0: 300 steps)" in proc.stderr


# ------------------------------------------------------------------ a table's committed record (record.py)

RECORD_SPEC = """
        title: record
        paper_finding: "b beats a (arXiv 0000.00000)"
        variants:
          - {name: a, overrides: [rollout.temperature=1.0]}
          - {name: b, overrides: [rollout.temperature=0.9]}
        baseline: a
        target: 0.6
"""
RECORD_SPECS = {
    "by_overrides": RECORD_SPEC,      # rows named by their variant
    # rows grouped by a config key: the record's labels name no variant; the spec's overrides tell which
    "by_config": RECORD_SPEC + "        group_by: [rollout.temperature]\n        paper_direction: {b: better}\n",
}


def _recorded_table(tmp_path: Path, body: str):
    """A built table (3 seeds of a and b, one failed run) with its table_meta.json, as a launch leaves it."""
    spec_path = write_spec(tmp_path, body)
    plan = make_plan(load_spec(spec_path), runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    temperature = {"a": 1.0, "b": 0.9}

    def run(d, variant, seed, acc, **kw):
        _fake_run(d, variant, seed, acc, **kw)
        (d / "config.yaml").write_text(f"seed: {seed}\nrun_name: {variant}_s{seed}\n"
                                       f"rollout: {{temperature: {temperature[variant]}}}\n")

    for i, (acc_a, acc_b) in enumerate([(0.60, 0.70), (0.62, 0.71), (0.61, 0.72)]):
        run(plan.runs_dir / f"{2 * i}_a_s{i}", "a", i, acc_a)
        run(plan.runs_dir / f"{2 * i + 1}_b_s{i}", "b", i, acc_b)
    run(plan.runs_dir / "6_b_s3", "b", 3, None, status="failed")
    (plan.runs_dir / "table_meta.json").write_text(json.dumps({
        "command": "python scripts/make_table.py t", "machine": "m", "date": "d0; wall time 1.0 min for 7 jobs",
        "launch_notes": ["warm-up (9 s)"], "launch_command": plan.command, "seeds": [0, 1, 2, 3]}))
    return spec_path, plan


@pytest.mark.parametrize("kind", sorted(RECORD_SPECS))
def test_a_table_restored_from_its_committed_record_is_the_same_table(tmp_path, kind):
    """tables/<name>_runs.csv + tables/<name>_meta.json stand in for run directories a fresh checkout lacks:
    the table rebuilt from them has the same cells, per-run values, paired findings and failed runs."""
    from grpo_lab.tables.record import restore

    spec_path, plan = _recorded_table(tmp_path, RECORD_SPECS[kind])
    header = {"command": "python scripts/make_table.py t", "machine": "m", "date": "d0"}
    first = build(plan, header_extra=header, launch_notes=["warm-up (9 s)"])
    assert first["meta"] == tmp_path / "tables" / f"{plan.spec.name}_meta.json"
    saved = {p.name: p.read_text() for p in (tmp_path / "tables").iterdir() if p.suffix in (".csv", ".json", ".md")}
    stem = plan.spec.name
    assert json.loads(saved[f"{stem}_meta.json"])["seeds"] == [0, 1, 2, 3]

    shutil.rmtree(plan.runs_dir)                                   # a fresh checkout: no outputs/
    notes = restore(plan)
    assert notes and notes[0].startswith("7 runs (seeds 0,1,2,3) restored from")
    assert notes[0].endswith("with their learning curves")
    assert restore(plan) == []                                     # a second restore changes nothing
    again = build(plan, header_extra=header, launch_notes=["warm-up (9 s)"])
    for name in (f"{stem}.csv", f"{stem}_runs.csv", f"{stem}_findings.json", f"{stem}_curves.csv"):
        assert (tmp_path / "tables" / name).read_text() == saved[name], name
    # header + 2 evaluations of each of the 6 completed runs + the failed one's step-0 evaluation
    assert saved[f"{stem}_curves.csv"].count("\n") == 1 + 6 * 2 + 1
    md = again["md"].read_text()
    assert md == saved[f"{stem}.md"]
    # b − a = .10, .09, .11 -> +10.0 ± 2.5 pp, paired by seed, as computed from the run directories
    assert "| b | 71.0 ± 2.5 (n=3) | +10.0 ± 2.5 |" in md and "3 ok / 1 failed |" in md
    # the reach column counts a recorded run that reached the target, as the table built from its metrics did
    assert "38,400 ± 0 (3/3 reached)" in md and "RuntimeError: boom" in md
    restored = json.loads((plan.runs_dir / "1_b_s0" / "summary.json").read_text())
    assert restored["recorded"]["final_acc"] == 0.7 and restored["final"] == {"eval/accuracy": 0.7}


def test_a_stopped_launch_carries_over_to_a_checkout_without_its_runs_and_continues_there(tmp_path):
    """A table of hours outlives the checkout that started it: a first launch stopped after its seed-0 runs is
    recorded with its launch (stopped_launch in the meta); a checkout holding only the record restores the
    finished runs and the launch, which the same command then continues: finished runs kept, the rest to do."""
    from grpo_lab.tables import state
    from grpo_lab.tables.launch import same_launch, variant_contents
    from grpo_lab.tables.record import committed_stopped_launch, restore

    spec_path, plan = _recorded_table(tmp_path, RECORD_SPECS["by_overrides"])
    (plan.runs_dir / "table_meta.json").unlink()                  # a first launch writes it when it finishes
    for d in plan.runs_dir.iterdir():
        if not d.name.endswith("_s0") and d.name != "2_a_s1":
            shutil.rmtree(d)                                       # seed 0 finished; the others never started
    (plan.runs_dir / "2_a_s1" / "summary.json").unlink()          # ... but this one, stopped mid-run
    jobs = [{"overrides": [f"+variant={v}", f"seed={seed}", f"logger.group={plan.group}"], "dir": f"{i}_{v}_s{seed}"}
            for i, (v, seed) in enumerate((v, seed) for seed in range(3) for v in "ab")]
    (plan.runs_dir / "make_table.log").write_text("seed 0 done\n")
    state.write_launch(plan.runs_dir, {
        "invocation": "python scripts/make_table.py t", "command": [f"{REPO}/.venv/bin/python", *plan.command[1:]],
        "group": plan.group, "stamp": plan.stamp, "run_dir_prefix": "", "seeds": [0, 1, 2], "added_what": None,
        "date": "2026-12-08 00:13 UTC", "parallel_jobs": 1, "jobs": jobs, "sft_controls": [],
        "variants": variant_contents(plan), "previous_meta": None,
        "attempts": [{"invocation": "python scripts/make_table.py t", "started": "2026-12-08T00:13:19",
                      "started_ts": 1.0, "pid": 1, "host": "elsewhere"}]})
    built = build(plan, header_extra={"command": "python scripts/make_table.py t", "machine": "m"}, launch_notes=[])
    meta = json.loads(built["meta"].read_text())
    ran = (plan.runs_dir / "make_table.log").stat().st_mtime - 1.0   # what it ran so far: started at 1.0
    assert meta["date"] == f"2026-12-08 00:13 UTC; wall time {ran / 60:.1f} min so far; stopped before it finished"
    assert meta["seeds"] == [0, 1, 2] and meta["wall_time_s"] == ran
    carried = meta["stopped_launch"]
    assert carried["command"][0] == ".venv/bin/python" and str(REPO) not in json.dumps(carried)
    # the stopped attempt ends when its log last changed, so its wall time still counts where it continues
    assert carried["attempts"][0]["ended_ts"] == (plan.runs_dir / "make_table.log").stat().st_mtime

    shutil.rmtree(plan.runs_dir)                                   # a fresh checkout: only the record
    assert committed_stopped_launch(plan) == carried
    assert "incomplete" in (tmp_path / "tables" / f"{plan.spec.name}_runs.csv").read_text()
    notes = restore(plan)                                          # the unfinished run is not restored: it runs again
    assert notes[0].startswith("2 runs (seeds 0) restored from") and "continues it" in notes[1]
    assert committed_stopped_launch(plan) is None and restore(plan) == []
    record = state.read_launch(plan.runs_dir)
    assert record["jobs"] == jobs and same_launch(record, plan, added=False)
    assert not (plan.runs_dir / "table_meta.json").exists()        # written when the continued launch finishes
    states = {d.name: state.run_state(d).state for d in state.planned_runs(record, plan.runs_dir)}
    assert states == {"0_a_s0": state.DONE, "1_b_s0": state.DONE, "2_a_s1": state.TODO, "3_b_s1": state.TODO,
                      "4_a_s2": state.TODO, "5_b_s2": state.TODO}


def _recorded_table_without_runs(tmp_path):
    """A table built and recorded, its run directories then removed (a fresh checkout holds only the record),
    and its scripts/make_table.py command line: (plan, make_table(*args) -> the finished process)."""
    spec_path, plan = _recorded_table(tmp_path, RECORD_SPECS["by_overrides"])
    build(plan, header_extra={"command": "first"}, launch_notes=[])
    shutil.rmtree(plan.runs_dir)

    def make_table(*args):
        return subprocess.run([sys.executable, "scripts/make_table.py", str(spec_path), "--runs-root",
                               str(tmp_path / "runs"), "--tables-root", str(tmp_path / "tables"), *args], cwd=REPO,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    return plan, make_table


@pytest.mark.slow
def test_add_seeds_extends_a_table_restored_from_its_record(tmp_path):
    """--add-seeds in a checkout without the table's run directories: the record is restored first, the
    seeds it holds are refused, a new seed passes every check (dry run) and nothing is replaced."""
    plan, make_table = _recorded_table_without_runs(tmp_path)

    proc = make_table("--add-seeds", "2")
    assert proc.returncode == 2 and "seed(s) [2] already have runs of these jobs" in proc.stderr, proc.stderr
    assert "7 runs (seeds 0,1,2,3) restored from" in proc.stderr
    proc = make_table("--add-seeds", "4", "--dry-run")
    assert proc.returncode == 0 and "2 jobs validated" in proc.stderr, proc.stderr
    proc = make_table("--add-seeds", "4", "--dry-run", "--", "trainer.total_steps=10")
    assert proc.returncode == 2 and "differ from every earlier launch" in proc.stderr
    assert len([d for d in plan.runs_dir.iterdir() if (d / "summary.json").exists()]) == 7
    # Without a record (nor run directories) it still says what to run first.
    (tmp_path / "tables" / f"{plan.spec.name}_meta.json").unlink()
    shutil.rmtree(plan.runs_dir)
    proc = make_table("--add-seeds", "4")
    assert proc.returncode == 2 and "run the table first (without --add-seeds)" in proc.stderr


def test_a_dry_run_of_add_seeds_checks_against_the_record_and_writes_nothing(tmp_path):
    """--add-seeds --dry-run in a checkout without the table's run directories: the checks read the committed
    record (a seed it holds is refused, a new one passes) and no run directory is restored onto disk."""
    plan, make_table = _recorded_table_without_runs(tmp_path)

    proc = make_table("--add-seeds", "2", "--dry-run")
    assert proc.returncode == 2 and "seed(s) [2] already have runs of these jobs" in proc.stderr, proc.stderr
    proc = make_table("--add-seeds", "4", "--dry-run")
    assert proc.returncode == 0 and "2 jobs validated" in proc.stderr, proc.stderr
    assert not plan.runs_dir.exists()


def _make_table_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_table_script", REPO / "scripts" / "make_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag, value, message", [
    ("--add-seeds", "abc", "argument --add-seeds: 'abc' is not a comma list of seeds (e.g. --add-seeds 3,4)"),
    ("--seeds", "abc", "argument --seeds: 'abc' is not a comma list of seeds (e.g. --seeds 3,4)"),
    ("--add-seeds", ",", "argument --add-seeds: ',' is not a comma list of seeds"),
    ("--add-seeds", "3,", "argument --add-seeds: '3,' is not a comma list of seeds"),
    # empty: it would run nothing, and an empty --add-seeds read as a plain launch moves the runs aside
    ("--add-seeds", "", "argument --add-seeds: empty: give the seeds to run, e.g. --add-seeds 3,4"),
    ("--seeds", "", "argument --seeds: empty"),
])
def test_a_seed_list_that_is_not_one_is_refused_by_the_parser(flag, value, message, capsys):
    make_table = _make_table_script()
    with pytest.raises(SystemExit) as exit_:
        make_table.parse_args(["dapo", flag, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    args, _ = make_table.parse_args(["dapo", flag, "3, 4"])
    assert (args.add_seeds or args.seeds) == [3, 4]


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "tables").glob("*.md") if p.name != "README.md"))
def test_every_committed_table_rebuilds_from_its_record(name, tmp_path):
    """Each committed table can be extended by a later session: --report-only in a checkout without its
    runs restores them from tables/<name>_runs.csv and _meta.json and rebuilds the same numbers."""
    tables = tmp_path / "tables"
    shutil.copytree(REPO / "tables", tables)
    proc = subprocess.run([sys.executable, "scripts/make_table.py", name, "--report-only", "--tables-root", str(tables),
                           "--runs-root", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for f in (f"{name}.csv", f"{name}_findings.json"):
        assert (tables / f).read_text() == (REPO / "tables" / f).read_text(), f
    committed = (REPO / "tables" / f"{name}_runs.csv").read_text().replace(f"outputs/tables/{name}/", "")
    assert (tables / f"{name}_runs.csv").read_text().replace(f"{tmp_path}/runs/{name}/", "") == committed


def test_contrast_ci_by_hand():
    """A difference of differences paired by seed, and a relative drop, computed by hand."""
    from grpo_lab.report import contrast_ci

    ppo_p, ppo_0 = {0: 0.60, 1: 0.62, 2: 0.58, 3: 0.9}, {0: 0.70, 1: 0.70, 2: 0.70}
    grpo_p, grpo_0 = {0: 0.50, 1: 0.54, 2: 0.52}, {0: 0.70, 1: 0.72, 2: 0.71}
    # per seed: (ppo_p − ppo_0) − (grpo_p − grpo_0) = .10, .10, .07 (seed 3 lacks terms: left out)
    mean, half, n = contrast_ci({"a": ppo_p, "b": ppo_0, "c": grpo_p, "d": grpo_0}, {"a": 1, "b": -1, "c": -1, "d": 1})
    assert n == 3 and mean == pytest.approx(0.09)
    sd = math.sqrt(((0.01) ** 2 * 2 + 0.02 ** 2) / 2)
    assert half == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-5)
    # relative: (grpo_p − grpo_0) / grpo_0 = −.2/.7, −.18/.72, −.19/.71
    mean, _, n = contrast_ci({"p": grpo_p, "z": grpo_0}, {"p": 1, "z": -1}, relative_to=grpo_0)
    assert n == 3 and mean == pytest.approx((-0.2 / 0.7 - 0.18 / 0.72 - 0.19 / 0.71) / 3)


@pytest.mark.parametrize("expect, mean, half, verdict", [
    ("> 0", 0.05, 0.02, "reproduced"),          # CI [+3, +7] above 0
    ("> 0", -0.05, 0.02, "contradicted"),
    ("> 0", 0.01, 0.02, "not resolved"),
    ("< -0.15", -0.25, 0.05, "reproduced"),     # CI [−30, −20] below −15
    ("< -0.15", -0.05, 0.05, "contradicted"),   # CI [−10, 0] above −15
    ("< -0.15", -0.14, 0.05, "not resolved"),
    ("> -0.05", 0.0, float("nan"), "n/a (one seed)"),
])
def test_threshold_verdicts_by_hand(expect, mean, half, verdict):
    from grpo_lab.tables.findings import threshold_verdict

    assert threshold_verdict(expect, mean, half) == verdict


@pytest.mark.parametrize("contrast, message", [
    ("{name: x, terms: {}, expect: '> 0'}", "`terms` is empty"),
    ("{name: x, terms: {'algorithm=ppo a': 1}, expect: 'bigger'}", "expect='bigger' must be a side of a threshold"),
    ("{name: x, terms: {'algorithm=sac a': 1}, expect: '> 0'}", "'algorithm=sac' selects no row"),
    ("{name: x, terms: {'algorithm=ppo z': 1}, expect: '> 0'}", "'z' is not a variant"),
    ("{name: x, terms: {'algorithm=ppo a': 1}, relative_to: 'q', expect: '> 0'}", "'q' is not a variant"),
    ("{name: x, terms: {'algorithm=ppo a': 1}, expect: '> 0', column: 'mean:actor/entropy'}",
     "column='mean:actor/entropy' must also be one of `columns`"),
])
def test_bad_contrasts_fail_with_a_clear_message(tmp_path, contrast, message):
    body = ("title: t\npaper_finding: p\nsweep: {algorithm: 'ppo,grpo'}\nwithin: [algorithm]\n"
            "variants: [{name: a, overrides: []}, {name: b, overrides: [x=1]}]\n"
            f"contrasts: [{contrast}]\n")
    with pytest.raises(TableSpecError) as err:
        load_spec(write_spec(tmp_path, body))
    assert message in str(err.value)


def test_contrasts_across_blocks_in_the_table(tmp_path):
    """Claims comparing rows of different blocks: the contrast per seed, its interval and verdict in the
    table's header and findings JSON."""
    spec = load_spec(write_spec(tmp_path, """
        title: contrasts
        paper_finding: "b hurts x less than y"
        sweep: {algorithm: 'x,y'}
        within: [algorithm]
        variants:
          - {name: a, overrides: [rollout.temperature=1.0]}
          - {name: b, overrides: [rollout.temperature=0.9]}
        baseline: a
        contrasts:
          - {name: x_vs_y, claim: "x drops less", expect: "> 0",
             terms: {"algorithm=x b": 1, "algorithm=x a": -1, "algorithm=y b": -1, "algorithm=y a": 1}}
          - {name: y_rel, expect: "< -0.15", relative_to: "algorithm=y a",
             terms: {"algorithm=y b": 1, "algorithm=y a": -1}}
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    accs = {("x", "a"): (0.70, 0.72, 0.71), ("x", "b"): (0.68, 0.71, 0.69),
            ("y", "a"): (0.70, 0.70, 0.72), ("y", "b"): (0.50, 0.52, 0.53)}
    for (algo, variant), values in accs.items():
        for seed, acc in enumerate(values):
            _fake_run(plan.runs_dir / f"{algo}_{variant}{seed}", variant, seed, acc, extra=f"- algorithm={algo}\n")
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    md = result["md"].read_text()
    # x_vs_y per seed: (−.02 − .01 − .02) − (−.20 − .18 − .19) = .18, .17, .17 -> mean 17.3 pp
    found = result["findings"]["contrasts"]
    assert found["x_vs_y"]["seeds"] == 3 and found["x_vs_y"]["mean"] == pytest.approx(0.52 / 3)
    assert found["x_vs_y"]["verdict"] == "reproduced" and found["y_rel"]["verdict"] == "reproduced"
    assert "| x drops less | x_vs_y: 1·[algorithm=x b] − 1·[algorithm=x a] − 1·[algorithm=y b] + 1·[algorithm=y a] |" in md


def test_a_contrast_of_a_column_pairs_each_runs_value_by_seed(tmp_path):
    """A contrast with `column`: per seed, the named column of each term's run (a logged metric's mean, the
    steps to the target) instead of the final accuracy; a seed whose run never reached the target leaves it."""
    spec = load_spec(write_spec(tmp_path, """
        title: contrasts of columns
        paper_finding: "b keeps its ratios closer to 1 and gets there sooner (arXiv 0000.00000)"
        variants:
          - {name: a, overrides: [rollout.temperature=1.0]}
          - {name: b, overrides: [rollout.temperature=0.9]}
        baseline: a
        target: 0.6
        x: step
        columns: [final_acc, steps_to_target, "mean:actor/log_ratio_std"]
        contrasts:
          - {name: steadier, claim: "b's log-ratios spread less", expect: "< 0", column: "mean:actor/log_ratio_std",
             terms: {b: 1, a: -1}}
          - {name: sooner, claim: "b reaches 60 % in fewer steps", expect: "< 0", column: steps_to_target,
             terms: {b: 1, a: -1}}
    """))
    plan = make_plan(spec, runs_root=tmp_path / "runs", tables_root=tmp_path / "tables")
    # (log-ratio std logged at steps 50 and 100, the step the accuracy reached 0.6, or None)
    values = {"a": [(0.30, 0.34, 100), (0.31, 0.33, 100), (0.29, 0.33, None)],
              "b": [(0.10, 0.12, 50), (0.11, 0.13, 50), (0.12, 0.12, 100)]}
    for variant, per_seed in values.items():
        for seed, (std1, std2, reached) in enumerate(per_seed):
            d = plan.runs_dir / f"{variant}{seed}"
            _fake_run(d, variant, seed, 0.7 if reached else 0.55)
            lines = [{"step": 50, "samples": 12800, "actor/log_ratio_std": std1,
                      "eval/accuracy": 0.65 if reached == 50 else 0.5},
                     {"step": 100, "samples": 25600, "actor/log_ratio_std": std2,
                      "eval/accuracy": 0.65 if reached else 0.52}]
            with open(d / "metrics.jsonl", "a") as f:
                f.write("".join(json.dumps(m) + "\n" for m in lines))
    result = build(plan, header_extra={"command": "test"}, launch_notes=[])
    found = result["findings"]["contrasts"]
    # mean std per run: a 0.32, 0.32, 0.31; b 0.11, 0.12, 0.12 -> b - a = -0.21, -0.20, -0.19
    assert found["steadier"]["seeds"] == 3 and found["steadier"]["mean"] == pytest.approx(-0.20)
    assert found["steadier"]["verdict"] == "reproduced" and found["steadier"]["column"] == "mean:actor/log_ratio_std"
    # steps to 60 %: a 100, 100, never; b 50, 50, 100 -> seeds 0 and 1 only: -50, -50
    assert found["sooner"]["seeds"] == 2 and found["sooner"]["mean"] == pytest.approx(-50)
    md = result["md"].read_text()
    assert "| b's log-ratios spread less | steadier: mean:actor/log_ratio_std of 1·[b] − 1·[a] |" in md
