"""trainer.backend=engine_process: the rollout engine in a child process, behind a pipe.

The same run must give the same metrics as the single-process run with the same seed (the HF engine is
deterministic given its seed and thread count; only perf/ timings differ), weights must reach the
child (step 2 samples from the pushed ones), the engine's errors must come back as the same exception
types, and a child that dies must raise EngineDeadError, not hang the loop.
"""

import os
import signal

import pytest

from helpers import TINY_RUN, read_metrics, run_train, start_model_dir

# An entropy bonus moves the weights even where a sample earns no reward, so step 2 samples from
# weights pushed into the child.
RUN = [*TINY_RUN, "rollout=hf", "trainer.eval_every=0", "algorithm.entropy_coef=0.01", "learner.lr=0.01"]


def comparable(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/") and k != "wall_time_s"} for m in lines]


@pytest.mark.slow
def test_engine_process_matches_single_process(tmp_path, warm_cache):
    local = run_train(RUN, tmp_path / "local", warm_cache)
    assert local.returncode == 0, local.stderr[-3000:]
    child = run_train([*RUN, "trainer.backend=engine_process"], tmp_path / "child", warm_cache)
    assert child.returncode == 0, child.stderr[-3000:]
    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "child")
    assert [m["step"] for m in b] == [0, 1, 2, 2]
    assert comparable(a) == comparable(b)
    assert a[2]["actor/entropy"] != a[1]["actor/entropy"]   # step 2 sampled from the pushed weights


def hf_engine(cache):
    from grpo_lab.rollout import rollout_section
    from grpo_lab.rollout.engine_process import EngineProcess

    cfg = rollout_section(engine="hf", dtype="float32")
    return EngineProcess(start_model_dir(cache), cfg, seed=0, num_threads=1)


def test_engine_process_errors_and_death(warm_cache):
    from grpo_lab.rollout import EngineDeadError

    engine = hf_engine(warm_cache)
    try:
        out = engine.generate([[1, 2, 3]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
        assert len(out.completion_ids) == 2 and out.group_ids == [0, 0]
        # The engine's own error, raised in the child, comes back with its type and message.
        with pytest.raises(TypeError, match="unexpected keyword"):
            engine.generate([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0, bogus=1)
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code"):
            engine.generate([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
        with pytest.raises(EngineDeadError, match="closed"):
            engine.generate([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    finally:
        engine.close()
    assert not engine._proc.is_alive()
