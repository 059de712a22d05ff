"""Overlapped generation and learning (trainer.max_staleness=1): the engine samples step k+1
while the learner trains on step k, every batch is at most one update old, and a resumed run still
equals the uninterrupted one (the batch sampled ahead is part of the checkpoint)."""

from __future__ import annotations

import pytest

from helpers import TINY_RUN, assert_finite_metrics, max_param_change, read_metrics, run_train, start_model_dir

OVERLAP = [*TINY_RUN, "trainer.total_steps=4", "trainer.max_staleness=1", "trainer.checkpoint_every=2"]
TIMING = ("wall_time_s", "perf/")


def without_timings(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in lines]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])])
def test_one_step_stale_pipeline_runs_and_logs_its_staleness(engine, tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    proc = run_train([f"rollout={engine}", *OVERLAP], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    assert_finite_metrics(lines)
    steps = [m for m in lines if "perf/step_time_s" in m]
    # step 1 is sampled from the starting weights and trained on them; later batches are one update old
    assert [m["rollout/staleness"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert max_param_change(start_model_dir(warm_cache), run_dir / "checkpoints" / "final") > 0


@pytest.mark.slow
def test_a_rollout_correction_reweights_the_stale_batches(tmp_path, warm_cache):
    """trainer.max_staleness=1 with algorithm.rollout_correction: the weights π_learner/π_engine carry the
    staleness too (the learner scores at the current weights, the engine sampled one update before), so from
    step 2 on the engine and the learner disagree and the correction truncates some tokens."""
    run_dir = tmp_path / "run"
    proc = run_train(["rollout=hf", *OVERLAP, "algorithm.rollout_correction.level=token",
                      "algorithm.rollout_correction.upper=1.0"], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    assert_finite_metrics(lines)
    steps = [m for m in lines if "perf/step_time_s" in m]
    assert [m["rollout/staleness"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    # step 1: one engine and one learner at the same weights (fp32, ~1e-7 apart); later a whole update apart
    assert steps[0]["rollout/logprob_abs_diff_mean"] < 1e-4
    assert all(m["rollout/logprob_abs_diff_mean"] > 1e-3 for m in steps[1:])
    assert all(0 < m["rollout/correction_truncated_frac"] < 1 and m["rollout/correction_ess"] <= 1 for m in steps[1:])


@pytest.mark.slow
def test_resume_with_a_batch_sampled_ahead_equals_the_uninterrupted_run(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    assert run_train(["rollout=hf", *OVERLAP], run_dir, warm_cache).returncode == 0
    reference = read_metrics(run_dir)
    proc = run_train(["rollout=hf", *OVERLAP, f"trainer.resume={run_dir / 'checkpoints' / 'step_2'}"], run_dir,
                     warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert without_timings(read_metrics(run_dir)) == without_timings(reference)


@pytest.mark.slow
@pytest.mark.vllm
def test_splitting_the_cores_between_learner_and_engine_changes_no_number(tmp_path, warm_cache):
    """trainer.cpu_placement=split (the learner on one core, vLLM's processes on the other) moves threads,
    not arithmetic: the overlapped run logs exactly what the shared-cores run logs (timings aside)."""
    runs = {}
    for placement in ("shared", "split"):
        run_dir = tmp_path / placement
        proc = run_train(["rollout=vllm", "trainer.backend=engine_process", f"trainer.cpu_placement={placement}",
                          *OVERLAP], run_dir, warm_cache)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("cpu placement: learner on cores" in proc.stdout) == (placement == "split")
        runs[placement] = without_timings(read_metrics(run_dir))
    assert runs["split"] == runs["shared"]
