"""Disjoint CPU cores for the learner and a rollout engine that computes in processes of its own.

Without placement the OS spreads the learner's thread, vLLM's worker, its scheduler (EngineCore) and
its client over all cores. vLLM's processes do not sleep while they wait for each other: a reader of
its shared-memory queues spins (`sched_yield`) for a second after every message
(vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition), so a waiting worker or
scheduler keeps a core busy for the whole learner phase and steals time slices from the learner
whenever the two share a core. `trainer.cpu_placement=split` puts them on disjoint cores, as verl and
OpenRLHF give the learner and the engines devices of their own:

* the learner (this process, every thread) on the first `n_learner` cores (its torch threads);
* the engine's processes (all of them: vLLM's client in `trainer.backend=engine_process`, EngineCore,
  the workers) on the rest, inherited from the thread that spawns them, and vLLM's OpenMP threads bound
  there (VLLM_CPU_OMP_THREADS_BIND; one list per replica and tensor-parallel rank, data_parallel.py).

In the synchronous loop the phases take turns, and the split did not pay there (during the rollout
vLLM's scheduler and worker then share one core while the learner's sits idle): `auto`, the default,
splits only when the engine samples during the learner's phase (trainer.max_staleness > 0).

Placement moves threads, not arithmetic: the learner keeps its thread count, and on a 2-core machine
vLLM's worker keeps its one OpenMP thread (its default binding reserves a core for the scheduler), so a
run's numbers are those of `shared` (tests/test_cpu_placement.py); only where vLLM would have bound more
cores than the split leaves it does the engine's thread count change.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

# auto = split while the engine samples during the learner's phase (trainer.max_staleness > 0), shared in
# the synchronous loop, where the phases take turns: on the default tiny run on two cores the split made
# overlapped steps faster and synchronous ones slower (README, Speed, for the runs and their commands).
CPU_PLACEMENTS = ("auto", "split", "shared")


@dataclass(frozen=True)
class CorePlacement:
    learner: tuple[int, ...]
    engine: tuple[int, ...]


def split_cores(cores: list[int], n_learner: int) -> CorePlacement | None:
    """The first `n_learner` of `cores` (sorted) for the learner, the rest for the engine; None when
    nothing would be left for one of them."""
    cores = sorted(cores)
    if n_learner < 1 or n_learner >= len(cores):
        return None
    return CorePlacement(learner=tuple(cores[:n_learner]), engine=tuple(cores[n_learner:]))


def plan_placement(mode: str, *, overlapped: bool, engine_own_process: bool, engine_on_cpu: bool,
                   spawns_engine: bool, n_learner: int, distributed: bool = False) -> CorePlacement | None:
    """The split for this run, or None where it does not apply: `shared` asked for, or `auto` in the
    synchronous loop (`overlapped` False); an engine that computes in the learner's own process (the hf
    engine) or on a GPU; engine processes that are not this process's children (Ray actors); several
    learner processes (torchrun); an explicit VLLM_CPU_OMP_THREADS_BIND (the user placed the engine); a
    platform without CPU affinity; an OMP_NUM_THREADS below the cores this process may use, which is how
    parallel sweep jobs share a machine (joblib's workers get cores // n_jobs): every job would pin its
    learner to the same first cores."""
    wanted = mode == "split" or (mode == "auto" and overlapped)
    if (not wanted or not engine_own_process or not engine_on_cpu or not spawns_engine or distributed
            or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not hasattr(os, "sched_setaffinity")):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if 0 < int(os.environ.get("OMP_NUM_THREADS") or 0) < len(cores):
        return None
    return split_cores(cores, n_learner)


def pin_process(cores) -> None:
    """Every thread of this process onto `cores` (os.sched_setaffinity(0) moves only the calling
    thread; threads started later inherit their creator's set)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):   # a thread that ended meanwhile
            pass


@contextmanager
def engine_cores(placement: CorePlacement | None):
    """While the engine starts: this thread on the engine's cores (the processes it spawns inherit
    them) and vLLM's OpenMP threads bound to them; afterwards the whole process on the learner's."""
    if placement is None:
        yield
        return
    from grpo_lab.rollout.data_parallel import environment

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, placement.engine)
    try:
        with environment({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, placement.engine))}):
            yield
    except BaseException:
        os.sched_setaffinity(0, before)
        raise
    pin_process(placement.learner)
