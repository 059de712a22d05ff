"""Checks on the data run before any training, the warm-up included: a local dataset holding a prompt
longer than the engine's context is refused at once (naming the file, the row count and the keys to
change), or with task.drop_overlong=true its long rows are dropped with a printed count. And a step
whose objective leaves nothing to train on (DPO without a preference pair) is skipped with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_train

# The default tiny model and warm-up, on a local JSONL file (rollout=hf: no vLLM engine).
RUN = ["rollout=hf", "logger=none", "trainer.total_steps=1", "trainer.prompts_per_step=2", "rollout.group_size=2",
       "trainer.eval_every=0", "task.source=local_dataset", "task.name=sums", "task.train_size=42",
       "task.dev_size=4", "task.test_size=4", "warmup.max_steps=5", "warmup.eval_every=5",
       "hydra/job_logging=none", "hydra/hydra_logging=none"]


def sums_file(tmp_path: Path, rows: int = 50) -> Path:
    """``rows`` short sums, one of which (row 7) has a 10,000-character prompt."""
    lines = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(rows)]
    lines[7]["prompt"] = "1+" * 4_999 + "1="
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_a_prompt_over_the_context_is_refused_before_the_warm_up(tmp_path):
    data = sums_file(tmp_path)
    proc = run_train([*RUN, f"task.path={data}"], tmp_path / "run", tmp_path / "cache", timeout=300)
    assert proc.returncode != 0
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert f"1 of 50 prompts of task.path={data}" in error, error
    assert "rollout.max_model_len" in error and "task.drop_overlong=true" in error
    assert not (tmp_path / "cache" / "warmup").exists()    # refused before the warm-up began


@pytest.mark.slow
def test_drop_overlong_drops_the_long_rows_with_a_count(tmp_path):
    data = sums_file(tmp_path)
    proc = run_train([*RUN, f"task.path={data}", "task.drop_overlong=true"], tmp_path / "run", tmp_path / "cache",
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "task.drop_overlong: dropped 1 of 50 prompts" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"


def test_a_dpo_step_without_a_preference_pair_is_skipped_with_a_message(tmp_path):
    # Near-greedy sampling: both samples of a group agree, so their rewards do and no pair forms.
    proc = run_train(["algorithm=dpo", "rollout.temperature=1e-6", "rollout.group_size=2", "rollout=hf", "logger=none",
                      "trainer.total_steps=2", "trainer.prompts_per_step=2", "trainer.eval_every=0",
                      "warmup.max_steps=0", "task.train_size=50", "task.dev_size=4", "task.test_size=4"],
                     tmp_path / "run", tmp_path / "cache", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: nothing to train on" in proc.stdout
    steps = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "perf/step_time_s" in m]
    assert len(steps) == 2 and all(m["actor/empty_batch"] == 1.0 and m["rollout/preference_pairs"] == 0.0
                                   for m in steps)
