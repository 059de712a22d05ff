"""trainer.cpu_placement (split, or auto with trainer.max_staleness > 0): the learner's threads and the
engine's processes on disjoint cores (grpo_lab/cpu_placement.py; a bad value is in the bad-input
catalogue). The split by hand, when it applies, that processes started inside `engine_cores` inherit
the engine's cores while every thread of this process ends on the learner's, and a real vLLM engine
placed that way: all its processes and threads on the engine's core, one OpenMP thread in the worker
(as vLLM's own binding gives it on two cores), the same greedy rows."""

import multiprocessing as mp
import os
import threading

import pytest

from grpo_lab.cpu_placement import CorePlacement, engine_cores, pin_process, plan_placement, split_cores

two_cores = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs CPU affinity and at least two cores")


@pytest.fixture
def restore_affinity():
    """Every thread of the test process back on the cores it had (the placement pins the whole process)."""
    before = os.sched_getaffinity(0)
    yield
    pin_process(before)


def test_the_learner_takes_the_first_cores_and_the_engine_the_rest():
    assert split_cores([1, 0], 1) == CorePlacement(learner=(0,), engine=(1,))
    assert split_cores(list(range(8)), 3) == CorePlacement(learner=(0, 1, 2), engine=(3, 4, 5, 6, 7))
    assert split_cores([4, 6, 5, 7], 2) == CorePlacement(learner=(4, 5), engine=(6, 7))   # a cgroup's cores
    # Nothing left for one side: no split (the OS shares the cores, as before).
    assert split_cores([0, 1], 2) is None and split_cores([0, 1], 0) is None and split_cores([0], 1) is None


@two_cores
def test_the_split_applies_only_to_engine_processes_this_process_starts_on_the_cpu(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    ok = dict(overlapped=True, engine_own_process=True, engine_on_cpu=True, spawns_engine=True, n_learner=1)
    split = CorePlacement(learner=(cores[0],), engine=tuple(cores[1:]))
    assert plan_placement("split", **ok) == plan_placement("auto", **ok) == split
    assert plan_placement("split", **{**ok, "overlapped": False}) == split
    assert plan_placement("auto", **{**ok, "overlapped": False}) is None   # the synchronous loop: shared
    assert plan_placement("shared", **ok) is None
    assert plan_placement("split", **{**ok, "engine_own_process": False}) is None   # hf: the learner's own process
    assert plan_placement("split", **{**ok, "engine_on_cpu": False}) is None        # vLLM on a GPU
    assert plan_placement("split", **{**ok, "spawns_engine": False}) is None        # Ray actors
    assert plan_placement("split", **ok, distributed=True) is None                  # torchrun ranks
    assert plan_placement("split", **{**ok, "n_learner": len(cores)}) is None       # learner.num_threads = all
    monkeypatch.setenv("OMP_NUM_THREADS", str(len(cores) - 1))                      # a parallel sweep's job
    assert plan_placement("split", **ok) is None
    monkeypatch.setenv("OMP_NUM_THREADS", str(len(cores)))                          # the whole machine
    assert plan_placement("split", **ok) == split
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")                            # the user placed vLLM
    assert plan_placement("split", **ok) is None


def _report_affinity(queue):
    queue.put((sorted(os.sched_getaffinity(0)), os.environ.get("VLLM_CPU_OMP_THREADS_BIND")))


@two_cores
def test_processes_started_inside_inherit_the_engine_cores_and_this_process_ends_on_the_learner_cores(
        restore_affinity, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    placement = split_cores(cores, 1)
    started_before = threading.Event()
    waiting = threading.Thread(target=started_before.wait, daemon=True)   # a thread that exists already
    waiting.start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with engine_cores(placement):
        child = ctx.Process(target=_report_affinity, args=(queue,))
        child.start()
    child_cores, child_bind = queue.get(timeout=60)
    child.join(timeout=60)
    assert child_cores == list(placement.engine)
    assert child_bind == ",".join(map(str, placement.engine))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ                  # restored for this process
    for tid in os.listdir("/proc/self/task"):                              # every thread, the waiting one too
        assert sorted(os.sched_getaffinity(int(tid))) == list(placement.learner)
    started_before.set()


@two_cores
def test_a_failed_engine_start_leaves_the_affinity_as_it_was(restore_affinity):
    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError, match="engine did not start"):
        with engine_cores(split_cores(sorted(before), 1)):
            raise RuntimeError("engine did not start")
    assert os.sched_getaffinity(0) == before


@pytest.mark.slow
@two_cores
def test_a_placed_vllm_engine_runs_on_its_cores_with_one_thread_and_writes_the_same_rows(
        tmp_path, restore_affinity, monkeypatch):
    import psutil
    import torch

    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.rollout import make_engine, rollout_section
    from grpo_lab.rollout.hf_engine import HFEngine
    from helpers import VLLM_KV_CACHE_BYTES, ragged_prompts

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet="0123456789+-=", seed=0)
    placement = split_cores(sorted(os.sched_getaffinity(0)), 1)
    rollout = rollout_section(engine="vllm", gpu_memory_utilization=0.05, max_model_len=64, enforce_eager=True,
                              dtype="float32", kv_cache_bytes=VLLM_KV_CACHE_BYTES)
    with engine_cores(placement):
        engine = make_engine(model_dir, rollout, seed=0)
    try:
        for pid in engine.engine_pids():
            for t in psutil.Process(pid).threads():
                assert sorted(os.sched_getaffinity(t.id)) == list(placement.engine), (pid, t.id)
        assert engine._rpc(lambda worker: torch.get_num_threads()) == [len(placement.engine)]
        args = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0)
        assert engine.generate(ragged_prompts(), **args).completion_ids == \
            HFEngine.from_dir(model_dir).generate(ragged_prompts(), **args).completion_ids
    finally:
        engine.close()
