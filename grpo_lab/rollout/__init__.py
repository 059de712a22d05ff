"""Rollout engines behind one protocol (`RolloutEngine`), chosen by `rollout.engine`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_lab.registry import Registry
from grpo_lab.rollout.base import Rollout, RolloutEngine
from grpo_lab.rollout.errors import EngineDeadError, EngineTimeoutError, RolloutEngineError
from grpo_lab.schema import Config, RolloutConfig

# Facts: `requires_module` (a module that must be importable, checked before anything loads; None =
# none), `own_process` (the engine computes in processes of its own, beside the learner's threads) and
# `reserves_memory_fraction` (it reserves rollout.gpu_memory_utilization of the device, for the memory plan),
# `parallel` (rollout.tensor_parallel_size / data_parallel_size > 1 are possible), `reads` (the rollout.*
# settings only this engine reads; set under another engine they are refused, grpo_lab/config_reads.py).
ROLLOUT_ENGINES = Registry("rollout engine", defaults={"requires_module": None, "own_process": False,
                                                       "reserves_memory_fraction": False, "parallel": False,
                                                       "reads": ()})


@ROLLOUT_ENGINES.register("vllm", requires_module="vllm", own_process=True, reserves_memory_fraction=True,
                          parallel=True)
def _vllm(model_dir: Path, rollout_cfg, *, seed: int, device: str) -> RolloutEngine:
    from grpo_lab.rollout.vllm_engine import VLLMEngine  # imports vllm only when chosen

    tp, dp = int(rollout_cfg.tensor_parallel_size), int(rollout_cfg.data_parallel_size)

    def replica(k: int = 0) -> RolloutEngine:
        return VLLMEngine(model_dir, gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                          max_model_len=rollout_cfg.max_model_len, enforce_eager=rollout_cfg.enforce_eager,
                          dtype=rollout_cfg.dtype, seed=seed, tensor_parallel_size=tp,
                          kv_cache_bytes=rollout_cfg.kv_cache_bytes,
                          generate_timeout_s=rollout_cfg.generate_timeout_s,
                          sync_timeout_s=rollout_cfg.sync_timeout_s,
                          sync_transport=rollout_cfg.sync_transport,
                          sync_bucket_mb=rollout_cfg.sync_bucket_mb,
                          sync_changed_only=rollout_cfg.sync_changed_only,
                          learner_device=str(device).split(":")[0], placement=(k, dp))

    if dp == 1:
        return replica()
    from grpo_lab.rollout.data_parallel import DataParallelEngine

    return DataParallelEngine(replica, dp)


@ROLLOUT_ENGINES.register("hf", reads=("sampler",))
def _hf(model_dir: Path, rollout_cfg, *, seed: int, device: str) -> RolloutEngine:
    from grpo_lab.rollout.hf_engine import HFEngine
    return HFEngine.from_dir(model_dir, dtype=rollout_cfg.dtype, device=device,
                             sampler=rollout_cfg.sampler)


def rollout_section(**values: Any) -> DictConfig:
    """A whole typed ``rollout`` section, the schema's defaults under `values` (max_new_tokens resolved
    from the default task's unless given), for an engine started outside a run's config: the judge's,
    the critic LLM's, a test's."""
    whole = OmegaConf.merge(OmegaConf.structured(Config), {"rollout": values})
    return OmegaConf.merge(OmegaConf.structured(RolloutConfig), OmegaConf.to_container(whole.rollout, resolve=True))


def make_engine(model_dir: Path, rollout_cfg, *, seed: int, device: str = "cpu") -> RolloutEngine:
    """The engine `rollout_cfg` (a whole rollout section: the run's, or `rollout_section(...)`) names."""
    return ROLLOUT_ENGINES.get(rollout_cfg.engine)(model_dir, rollout_cfg, seed=seed, device=device)


__all__ = ["Rollout", "RolloutEngine", "ROLLOUT_ENGINES", "make_engine", "rollout_section", "RolloutEngineError",
           "EngineDeadError", "EngineTimeoutError"]
