"""Tables that grow on another machine start their added rows where the recorded rows started: each run
records its warm-up (steps, a digest of the weights, the key of its inputs), a table's runs CSV carries them
through its record, a table flags runs of one seed whose starts differ, and `warmup.replay_steps` makes an
added row's warm-up train exactly the recorded length (or reuse a cached warm-up of that length)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import REPO, TINY_RUN
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.report import build_report
from grpo_lab.report.runs import load_runs
from grpo_lab.report.table import warmup_starts
from grpo_lab.schema import ConfigError
from grpo_lab.tables.record import warmup_replay


def make(overrides=()):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def fake_run(root: Path, name: str, seed: int, warmup: dict | None, acc: float = 0.5, algo: str = "grpo") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed: {seed}\nrun_name: {name}\nalgorithm:\n  name: {algo}\n")
    (d / ".hydra").mkdir()
    (d / ".hydra" / "overrides.yaml").write_text(f"- algorithm={algo}\n- seed={seed}\n")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n"
                                     + json.dumps({"step": 2, "eval/accuracy": acc}) + "\n")
    (d / "summary.json").write_text(json.dumps({"status": "completed", "run_name": name, "final": {"eval/accuracy": acc},
                                                **({"warmup": warmup} if warmup else {})}))
    return d


def test_runs_of_one_seed_from_different_warm_ups_are_flagged(tmp_path):
    a = {"steps": 300, "digest": "aaaa", "inputs": "k0"}
    fake_run(tmp_path, "grpo_s0", 0, a)
    fake_run(tmp_path, "ppo_s0", 0, a, algo="ppo")
    fake_run(tmp_path, "rloo_s0", 0, {"steps": 450, "digest": "bbbb", "inputs": "k0"}, algo="rloo")
    fake_run(tmp_path, "grpo_s1", 1, {"steps": 300, "digest": "cccc", "inputs": "k0"})
    fake_run(tmp_path, "ppo_s1", 1, {"steps": 300, "digest": "dddd", "inputs": "k0"}, algo="ppo")
    fake_run(tmp_path, "tool_s1", 1, {"steps": 100, "digest": "eeee", "inputs": "other"}, algo="rloo")  # own inputs
    fake_run(tmp_path, "old_s2", 2, None)                                                              # none recorded
    from grpo_lab.report.runs import group_runs

    groups, _ = group_runs(load_runs(tmp_path), ["algorithm.name"])
    flags = sorted(warmup_starts(groups))
    assert len(flags) == 2
    assert flags[0].startswith("seed 0: warm-ups stopped at different steps") and "`rloo_s0` from bbbb (step 450)" in flags[0]
    assert "`grpo_s0`, `ppo_s0` from aaaa (step 300)" in flags[0] or "`ppo_s0`, `grpo_s0` from aaaa (step 300)" in flags[0]
    assert flags[1].startswith("seed 1: warm-ups of the same length (300 steps) with different weights")
    assert "tool_s1" not in flags[1]


def test_the_runs_csv_carries_each_runs_start_and_the_replay_reads_it(tmp_path):
    runs = tmp_path / "runs"
    for seed, steps in ((0, 300), (1, 450)):
        for algo in ("grpo", "ppo"):
            fake_run(runs, f"{algo}_s{seed}", seed, {"steps": steps, "digest": f"d{seed}", "inputs": "k"}, algo=algo)
    fake_run(runs, "grpo_s2", 2, {"steps": 100, "digest": "x", "inputs": "k"})
    fake_run(runs, "ppo_s2", 2, {"steps": 150, "digest": "y", "inputs": "k"}, algo="ppo")
    out = build_report(str(runs), tmp_path / "table", group_by=["algorithm.name"])
    rows = list(csv.DictReader(open(out["runs_csv"])))
    assert {(r["run"], r["warmup_steps"], r["warmup_digest"], r["warmup_inputs"]) for r in rows} >= {
        ("grpo_s0", "300", "d0", "k"), ("ppo_s1", "450", "d1", "k")}
    assert "## Different starts" in out["markdown"] and "seed 2: warm-ups stopped at different steps" in out["markdown"]
    replay, notes = warmup_replay(runs, [0, 1, 2, 3])
    assert replay == {0: 300, 1: 450}          # seed 2's rows disagree, seed 3 has no runs
    assert any("seed 2" in n for n in notes) and any("seed 0: 300 steps" in n for n in notes)


def test_a_replay_longer_than_the_warm_up_is_refused():
    cfg = make(["warmup.max_steps=100", "warmup.replay_steps={0:150}"])
    with pytest.raises(ConfigError, match=r"warmup.replay_steps=\{0: 150\}.*\[1, warmup.max_steps=100\]"):
        validate(cfg, machine=False)


def test_a_replayed_warm_up_trains_exactly_the_recorded_steps_or_reuses_the_cached_one(tmp_path):
    """The stopping rule (target 0: the first check at step 5) against a replay of 10 steps, and a replay of
    the cached warm-up's own length, which reuses it."""
    from grpo_lab.run_setup import start_run

    base = [*TINY_RUN, "task.train_size=200", "warmup.max_steps=20", "warmup.eval_every=5",
            "warmup.target_sampled_dev_accuracy=0.0", f"cache_dir={tmp_path}"]
    first = start_run(make(base))
    assert first.warmup["steps"] == 5 and not first.warmup["cached"] and len(first.warmup["digest"]) == 16
    same = start_run(make([*base, "warmup.replay_steps={0:5}"]))
    assert same.policy_dir == first.policy_dir and same.warmup["cached"]
    assert same.warmup["digest"] == first.warmup["digest"] and same.warmup["inputs"] == first.warmup["inputs"]
    replayed = start_run(make([*base, "warmup.replay_steps={0:10,1:15}"]))
    assert replayed.policy_dir != first.policy_dir
    assert replayed.warmup["steps"] == 10 and replayed.warmup["replayed_steps"] == 10
    assert replayed.warmup["inputs"] == first.warmup["inputs"] and replayed.warmup["digest"] != first.warmup["digest"]
    other_seed = start_run(make([*base, "seed=1", "warmup.replay_steps={0:10}"]))   # seed 1 is not replayed
    assert other_seed.warmup["steps"] == 5
