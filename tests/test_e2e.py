"""Two RL steps end to end with each rollout engine: the run learns something (parameters move),
logs finite metrics, and leaves the record the table makers read."""

import json

import pytest

from helpers import TINY_RUN, assert_finite_metrics, max_param_change, read_metrics, run_train, start_model_dir


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_step_run(engine, tmp_path, warm_cache):
    run_dir, cache = tmp_path / "run", warm_cache
    proc = run_train([f"rollout={engine}", *TINY_RUN], run_dir, cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["samples"] == 2 * 8 * 4                       # steps × prompts × G
    assert f"rollout={engine}" in summary["overrides"]

    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [0, 1, 2, 2]               # eval before, two steps, eval after
    assert_finite_metrics(lines)
    train_line = lines[1]
    for key in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "perf/rollout_s",
                "perf/learn_s", "perf/sync_s", "rollout/logprob_abs_diff_max", "rollout/zero_adv_group_frac"):
        assert key in train_line, key
    # The engine sampled from the learner's policy: its logprobs agree with the learner's (fp32).
    assert train_line["rollout/logprob_abs_diff_max"] < 1e-3

    assert max_param_change(start_model_dir(cache), run_dir / "checkpoints" / "final") > 0
    resolved = (run_dir / "config.yaml").read_text()
    assert f"engine: {engine}" in resolved and "run_name: grpo_G4_clip0.2_kl0_s0" in resolved
