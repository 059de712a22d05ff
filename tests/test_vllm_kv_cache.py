"""rollout.kv_cache_bytes: vLLM's KV cache in absolute bytes instead of a share of (free) memory,
validated, counted by the memory plan, and honoured by the engine (what every vLLM test uses, so a
busy shared machine does not make vLLM refuse to start)."""

from __future__ import annotations

import pytest

from grpo_lab.memory_plan import plan_memory
from helpers import VLLM_KV_CACHE_BYTES, ragged_prompts
from test_robust_rewards_tasks import errors_of, make


@pytest.mark.parametrize("value", ["0", "-5", "1000"])
def test_a_bad_kv_cache_size_names_its_key(value):
    errs = errors_of([f"rollout.kv_cache_bytes={value}"])
    assert any(e.startswith("rollout.kv_cache_bytes") and "268435456" in e for e in errs), errs


def test_the_memory_plan_counts_the_bytes_not_the_share():
    common = ["rollout=vllm", f"rollout.kv_cache_bytes={VLLM_KV_CACHE_BYTES}"]
    small, large = (plan_memory(make([*common, f"rollout.gpu_memory_utilization={u}"]), device_memory=24e9)
                    for u in (0.05, 0.9))
    engine = small.item("rollout engine (vllm)")
    assert engine == large.item("rollout engine (vllm)") and VLLM_KV_CACHE_BYTES < engine < 2 * VLLM_KV_CACHE_BYTES
    assert errors_of(common) == []


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_sized_in_bytes_starts_whatever_memory_is_free(tmp_path):
    """0.99 of the machine's RAM is never free while anything else runs, so vLLM would refuse to start
    on the share; with kv_cache_bytes the share is ignored."""
    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.rollout import make_engine, rollout_section

    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet="0123456789+-=", seed=0)
    engine = make_engine(model_dir, rollout_section(engine="vllm", gpu_memory_utilization=0.99, max_model_len=64,
                                                    enforce_eager=True, dtype="float32",
                                                    kv_cache_bytes=VLLM_KV_CACHE_BYTES), seed=0)
    try:
        out = engine.generate(ragged_prompts(3), n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
        assert len(out) == 6
    finally:
        engine.close()
