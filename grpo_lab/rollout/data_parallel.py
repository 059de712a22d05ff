"""More than one engine: `rollout.data_parallel_size` replicas behind the one engine protocol.

Each replica is a whole engine (vLLM: its own processes and, on a GPU machine, its own
`rollout.tensor_parallel_size` devices). A step's prompts are split into contiguous shards, one per
replica, generated concurrently (each call only waits on its replica's processes, so threads
suffice), and put back in prompt order; new weights go to every replica. Request seeds stay those of
the single engine (seed + the prompt's index in the whole step), so with the same weights the
replicas return exactly what one engine returns (tests/test_speed_data_parallel.py); only the
wall time changes. This is what verl and OpenRLHF call rollout data parallelism (several vLLM
engines, prompts dispatched among them).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from grpo_lab.rollout.base import Rollout, RolloutEngine


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges splitting n items over `shards` replicas, sizes differing by at most 1
    (empty ranges when n < shards)."""
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for k in range(shards):
        end = start + base + (k < extra)
        bounds.append((start, end))
        start = end
    return bounds


def placement_env(replica: int, replicas: int, *, per_replica_devices: int, on_cuda: bool,
                  cpu_cores: list[int]) -> dict[str, str]:
    """Environment a replica's processes start with, so replicas never share hardware: on CUDA its
    own `per_replica_devices` GPUs (CUDA_VISIBLE_DEVICES, counted within what this process sees); on
    the CPU build its own cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, one core
    list per tensor-parallel rank, separated by '|')."""
    if on_cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        mine = devices[replica * per_replica_devices:(replica + 1) * per_replica_devices]
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    start, end = shard_bounds(len(cpu_cores), replicas)[replica]
    cores = cpu_cores[start:end] or cpu_cores[:1]
    ranks = [cores[a:b] or cores[:1] for a, b in shard_bounds(len(cores), per_replica_devices)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)}


@contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` while the block runs (engine processes inherit it when spawned)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class DataParallelEngine:
    """`size` engine replicas with one engine's interface (grpo_lab.rollout.base.RolloutEngine)."""

    def __init__(self, make_replica: Callable[[int], RolloutEngine], size: int):
        self.replicas: list[RolloutEngine] = []
        try:
            for k in range(size):   # one at a time: each start claims its own memory and devices
                self.replicas.append(make_replica(k))
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="rollout-dp")

    def _each(self, calls: list[Callable[[], object]]) -> list:
        """Run one call per replica concurrently; the first failure is raised after all have ended."""
        futures = [self._pool.submit(c) for c in calls]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:   # noqa: PERF203 — every replica must finish before we raise
                first_error = first_error or e
                results.append(None)
        if first_error is not None:
            raise first_error
        return results

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        bounds = [(a, b) for a, b in shard_bounds(len(prompt_ids), len(self.replicas)) if b > a]

        def call(replica: RolloutEngine, start: int, end: int):
            return lambda: replica.generate(prompt_ids[start:end], n=n, temperature=temperature, top_p=top_p,
                                            max_new_tokens=max_new_tokens, logprobs=logprobs,
                                            seed=None if seed is None else seed + start)
        parts = self._each([call(r, a, b) for r, (a, b) in zip(self.replicas, bounds)])
        for part, (start, _) in zip(parts, bounds):
            part.group_ids = [g + start for g in part.group_ids]   # group = prompt index in the whole step
        return Rollout.concat(parts)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named_tensors)   # read once, sent to every replica
        self._each([lambda r=r: r.load_weights(named) for r in self.replicas])

    def engine_pids(self) -> list[int]:
        return [pid for r in self.replicas for pid in getattr(r, "engine_pids", list)()]

    def close(self) -> None:
        errors = []
        for r in self.replicas:
            try:
                r.close()
            except Exception as e:   # close every replica, then report
                errors.append(e)
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
        if errors:
            raise errors[0]
