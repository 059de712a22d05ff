"""Small utilities shared by the end-to-end tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]

# A tiny, fast run on a briefly warmed-up model (a random one earns no reward, so every advantage
# is 0 and nothing would move): few prompts, no periodic eval. The warm-up is cached per session.
TASK = ["task.train_size=4000", "task.dev_size=50", "task.test_size=50"]
WARMUP = ["warmup.max_steps=400", "warmup.eval_every=100", "warmup.target_sampled_dev_accuracy=0.08"]
# Tests that start vLLM give its KV cache a size in bytes, not a share of RAM: on a busy shared machine
# that share may not be free, and vLLM then refuses to start. Every vLLM test config uses it.
VLLM_KV_CACHE_BYTES = 256 * 2**20
VLLM_KV = [f"rollout.kv_cache_bytes={VLLM_KV_CACHE_BYTES}"]
TINY_RUN = ["logger=none", "trainer.total_steps=2", "trainer.prompts_per_step=8", "rollout.group_size=4",
            "trainer.eval_every=0", *TASK, *WARMUP, *VLLM_KV]


def run_train(overrides: list[str], run_dir: Path, cache_dir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m grpo_lab.train` in a subprocess (as a user runs it), its run directory pinned."""
    cmd = [sys.executable, "-m", "grpo_lab.train", *overrides, f"hydra.run.dir={run_dir}", f"cache_dir={cache_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def train_in_process(overrides: list[str], monkeypatch) -> int:
    """`python -m grpo_lab.train <overrides>` in this process (so parts registered by a test file count);
    returns the exit code (Hydra reports a failed run by exiting; summary.json holds the traceback)."""
    from hydra.core.global_hydra import GlobalHydra

    import grpo_lab.train as train

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["grpo_lab.train", "--config-path", str(REPO / "conf"), "--config-name",
                                      "config", *overrides])
    try:
        train.main()
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        GlobalHydra.instance().clear()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_finite_metrics(lines: list[dict]) -> None:
    for line in lines:
        for key, value in line.items():
            assert value is not None and math.isfinite(value), f"step {line['step']}: {key}={value}"


def max_param_change(before_dir: Path, after_dir: Path) -> float:
    before, after = load_file(str(before_dir / "model.safetensors")), load_file(str(after_dir / "model.safetensors"))
    assert before.keys() == after.keys()
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def start_model_dir(cache_dir: Path) -> Path:
    """The model RL started from: the (only) warmed-up checkpoint in the cache."""
    dirs = [p.parent for p in cache_dir.glob("warmup/*/model.safetensors")]
    assert len(dirs) == 1, dirs
    return dirs[0]


__all__ = ["REPO", "TINY_RUN", "VLLM_KV", "VLLM_KV_CACHE_BYTES", "run_train", "train_in_process", "read_metrics", "assert_finite_metrics", "max_param_change",
           "start_model_dir", "TASK", "WARMUP", "torch"]


def ragged_prompts(n: int = 7) -> list[list[int]]:
    """<bos> + 2-5 random tokens of the tiny model's digits alphabet: prompts of different lengths, so a
    batch of them is left-padded."""
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 13, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
