"""Every algorithm recipe (conf/algorithm/*.yaml) composes with the default config and validates,
names the components its paper defines, cites its arXiv id, and runs two RL steps end to end on
the tiny random model with finite metrics and moved parameters.

The end-to-end runs call the real Hydra entry point (`grpo_lab.train.main`) in this process, one
recipe after another, sharing one model cache: no interpreter start-up per recipe, and the model is
built once. Every run swaps the task reward for `digit_fraction` (below): a random model never
answers chain_sum correctly, so the task's 1/0 reward would be 0 for every sample, every
advantage 0, and no recipe could show that its parameters move.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from safetensors.torch import load_file

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.rewards import REWARDS
from helpers import train_in_process

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
RECIPES = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))

# The defining components of each recipe, as the papers state them. The YAML files
# may set more; these are the values that make each algorithm what it is.
DEFINING = {
    "ppo": {"advantage": "gae", "critic.enabled": True, "policy_loss": "clipped_surrogate", "clip_low": 0.2,
            "clip_high": 0.2, "aggregation": "token_mean", "kl.placement": "reward", "kl.estimator": "k1",
            "gamma": 1.0, "lam": 0.95},
    "grpo": {"advantage": "group_zscore", "policy_loss": "clipped_surrogate", "clip_low": 0.2, "clip_high": 0.2,
             "kl.estimator": "k3", "kl.placement": "loss"},
    "dr_grpo": {"advantage": "group_mean", "aggregation": "seq_mean_token_sum_norm", "kl.coef": 0.0},
    "dapo": {"advantage": "group_zscore", "clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean",
             "dynamic_sampling.enabled": True, "overlong.soft_buffer": 2, "kl.coef": 0.0},
    "gspo": {"advantage": "group_zscore", "policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
             "aggregation": "seq_mean_token_mean", "minibatches": 4, "kl.coef": 0.0},
    "rloo": {"advantage": "rloo", "policy_loss": "vanilla_pg", "epochs": 1, "minibatches": 1,
             "kl.placement": "reward"},
    "reinforce_pp": {"advantage": "reinforce_pp", "policy_loss": "clipped_surrogate", "kl.placement": "reward",
                     "kl.estimator": "k1", "gamma": 1.0},
    "reinforce_pp_baseline": {"advantage": "group_mean_batch_std", "policy_loss": "clipped_surrogate",
                              "kl.placement": "loss"},
    "cispo": {"advantage": "group_zscore", "policy_loss": "cispo", "cispo_clip_low": None, "aggregation": "token_mean",
              "kl.coef": 0.0},
    "gmpo": {"advantage": "group_zscore", "policy_loss": "gmpo", "gmpo_log_clip_low": 0.4, "gmpo_log_clip_high": 0.4,
             "aggregation": "seq_mean_token_mean", "kl.coef": 0.0},
    "sapo": {"advantage": "group_zscore", "policy_loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
             "aggregation": "seq_mean_token_mean", "kl.coef": 0.0},
    "dppo": {"advantage": "group_mean", "policy_loss": "dppo", "dppo_delta_low": 0.15, "dppo_delta_high": 0.15,
             "aggregation": "seq_mean_token_sum_norm", "kl.coef": 0.0},
    "dpo": {"objective": "preference", "preference.loss": "dpo", "preference.pairing": "best_worst",
            "preference.beta": 0.1, "preference.pairs": "policy"},
    "ipo": {"objective": "preference", "preference.loss": "ipo", "preference.pairing": "best_worst"},
    "group_dpo": {"objective": "preference", "preference.loss": "dpo", "preference.pairing": "all_pairs",
                  "preference.bt_weighting": True,
                  "preference.pairs": "policy"},
}


@REWARDS.register("digit_fraction")
def digit_fraction(completions: list[str], **_) -> list[float]:
    """Test-only reward: digits per completion / 8. Random samples of one group almost never tie,
    so every group carries a learning signal (and DAPO's dynamic sampling keeps it)."""
    return [sum(ch.isdigit() for ch in c) / 8.0 for c in completions]


TINY = ["rollout=hf", "logger=none", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.group_size=4",
        "task.train_size=500", "task.dev_size=20", "task.test_size=20", "warmup.max_steps=0", "trainer.eval_every=0",
        "~reward.weights.correctness_binary", "+reward.weights.digit_fraction=1.0",
        "hydra/job_logging=none", "hydra/hydra_logging=none"]


def compose_recipe(name: str, overrides: list[str] = ()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=[f"algorithm={name}", *overrides]))


@pytest.fixture(scope="module", autouse=True)
def _schema():
    register_configs()
    yield
    GlobalHydra.instance().clear()


def test_issue_recipes_exist():
    assert set(DEFINING) <= set(RECIPES), sorted(set(DEFINING) - set(RECIPES))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_validates_and_cites(name):
    cfg = compose_recipe(name)                   # default task, rollout (vllm) and learner groups
    validate(cfg)
    a = cfg.algorithm
    assert a.name == name
    for key, want in DEFINING.get(name, {}).items():
        got = OmegaConf.select(a, key)
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, f"algorithm.{key}={got}"
    header = (CONF / "algorithm" / f"{name}.yaml").read_text().split("\nname:")[0]
    assert re.search(r"arXiv \d{4}\.\d{4,5}", header), f"{name}.yaml: cite the paper's arXiv id in a comment"


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_cache")


def run_main(overrides: list[str], monkeypatch) -> None:
    """`python -m grpo_lab.train <overrides>`, in this process; the run must succeed."""
    code = train_in_process(overrides, monkeypatch)
    assert not code, f"grpo_lab.train exited with {code}"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_two_steps_end_to_end(name, tmp_path, shared_cache, monkeypatch, one_thread):
    run_dir = tmp_path / "run"
    run_main([f"algorithm={name}", *TINY, f"hydra.run.dir={run_dir}", f"cache_dir={shared_cache}"], monkeypatch)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary["traceback"]
    assert summary["steps"] == 2
    cfg = OmegaConf.load(run_dir / "config.yaml")          # the resolved config that ran
    a = cfg.algorithm
    assert a.name == name

    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]
    steps = [m for m in lines if "perf/step_time_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in lines:  # the recorder writes NaN / inf as null
        bad = {k: v for k, v in m.items() if v is None or (isinstance(v, float) and not math.isfinite(v))}
        assert not bad, f"step {m['step']}: non-finite metrics {bad}"

    # Each configured component left its trace in the metrics (so it ran, not just composed).
    expected = {"actor/grad_norm", "reward/mean", "perf/host_load_1m"}
    if a.objective == "preference":
        loss = a.preference.loss
        expected |= {"rollout/preference_pairs", f"actor/{loss}_reward_margin", f"actor/{loss}_reward_accuracy"}
    else:
        expected |= {"actor/pg_loss", "actor/entropy", "actor/ratio_mean", "actor/advantage_abs_mean"}
    if a.critic.enabled:
        expected |= {"critic/value_loss", "critic/grad_norm", "critic/value_clip_frac"}
    if a.kl.coef > 0:
        expected |= {"reward/kl_penalty"} if a.kl.placement == "reward" else {"actor/kl"}
    if a.dynamic_sampling.enabled:
        expected |= {"rollout/generated_samples"}
    if a.overlong.soft_buffer > 0:
        expected |= {"reward/overlong_penalty"}
    for m in steps:
        assert expected <= m.keys(), f"step {m['step']}: missing {sorted(expected - m.keys())}"
        assert m["actor/grad_norm"] > 0
        if a.critic.enabled:
            assert m["critic/grad_norm"] > 0 and m["critic/value_loss"] > 0

    # On-policy path: one update per batch from the engine's own samples, so the ratio is 1 and
    # nothing is clipped (HF engine and learner agree in fp32 to ~1e-7 per token).
    if a.objective == "policy_gradient" and a.epochs == 1 and a.minibatches == 1 \
            and a.rollout_correction.level is None:
        for m in steps:
            assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
            assert m["actor/clip_frac_low"] == 0 and m["actor/clip_frac_high"] == 0

    # Parameters moved: the final policy differs from the model the run started from.
    starts = [p.parent for p in shared_cache.glob("models/*/model.safetensors")]
    assert len(starts) == 1, starts  # every run builds the same tiny model (same config, alphabet, seed)
    before = load_file(str(starts[0] / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.isfinite(t).all() for t in after.values())
    change = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert change > 0, f"{name}: no parameter changed in two steps"


def compose_experiment(name: str, overrides: list[str] = ()):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=[f"experiment={name}", *overrides]))


# What scripts/device_check.sh adds to experiment=smollm2_gpu_smoke where the GPU machine lacks vLLM's
# CUDA build and SmolLM2's weights.
DEVICE_FALLBACK = ["rollout=hf", "rollout.dtype=bfloat16", "model=pretrained", "model.path=/tmp/smollm2_135m_random",
                   "algorithm.entropy_coef=0.001"]


@pytest.mark.parametrize("fallback", [False, True], ids=["as_written", "device_fallback"])
def test_gpu_smoke_recipe_composes_and_validates(fallback):
    """experiment=smollm2_gpu_smoke (scripts/device_check.sh): SmolLM2-135M, full fine-tuning in bf16 on
    the GPU, vLLM in bf16 with the cuda_ipc push, 3 steps; with the device check's fallbacks too."""
    cfg = compose_experiment("smollm2_gpu_smoke", DEVICE_FALLBACK if fallback else [])
    validate(cfg, machine=False)
    assert cfg.learner.device == "cuda" and cfg.learner.dtype == "bf16" and cfg.learner.lora.rank == 0
    assert cfg.rollout.dtype == "bfloat16" and cfg.rollout.sync_transport == "cuda_ipc"
    assert cfg.trainer.total_steps == 3 and cfg.warmup.max_steps == 0 and cfg.task.prompt_format == "question"
    if fallback:
        assert cfg.rollout.engine == "hf" and cfg.model.builder == "pretrained"
    else:
        assert cfg.rollout.engine == "vllm" and cfg.model.builder == "smollm2_135m"
    header = (CONF / "experiment" / "smollm2_gpu_smoke.yaml").read_text().split("\ndefaults:")[0]
    assert header.startswith("# @package _global_\n") and "device_check.sh" in header


def test_device_check_dry_run_prints_the_tier_the_recipe_and_the_report(tmp_path):
    """`bash scripts/device_check.sh --dry-run` runs nothing but read-only probes and prints each step."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pip, tier, train, report = (next((line for line in lines if key in line), None) for key in (
        "pip install", "pytest -m gpu", "-m grpo_lab.train", "device_report.py"))
    assert pip and tier and train and report, proc.stdout
    assert "tests/test_gpu.py" in tier and "experiment=smollm2_gpu_smoke" in train and "device_report.md" in report
    # No CUDA build of vLLM here: the recipe falls back to the HF engine, and the report is told so.
    assert "rollout=hf" in train and "vLLM-on-CUDA\\ was\\ NOT\\ checked" in report
    assert not (tmp_path / "gpu_tests.xml").exists() and not (tmp_path / "device_report.md").exists()
