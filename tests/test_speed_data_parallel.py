"""More than one engine (rollout.data_parallel_size): prompts sharded over replicas, results back in
prompt order with the single engine's groups and seeds, weights pushed to every replica; and the
placement that keeps replicas off each other's devices / cores."""

import pytest
import torch

from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.rollout.data_parallel import DataParallelEngine, placement_env, shard_bounds
from grpo_lab.rollout.hf_engine import HFEngine
from helpers import VLLM_KV_CACHE_BYTES, ragged_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=", seed=0)


def test_shards_are_contiguous_balanced_and_cover_everything():
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]


def test_placement_gives_each_replica_its_own_cores_and_ranks():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [placement_env(k, 2, per_replica_devices=1, on_cuda=False, cpu_cores=cores) for k in (0, 1)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3"}, {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7"}]
    # Tensor parallel inside a replica: one core list per rank, '|'-separated (vLLM's CPU format).
    assert placement_env(1, 2, per_replica_devices=2, on_cuda=False, cpu_cores=cores) == {
        "VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}
    assert placement_env(0, 2, per_replica_devices=1, on_cuda=False, cpu_cores=[0, 1]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0"}


def test_placement_on_gpus_counts_within_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    assert placement_env(1, 2, per_replica_devices=2, on_cuda=True, cpu_cores=[0]) == {"CUDA_VISIBLE_DEVICES": "5,7"}


def test_replicas_return_what_one_engine_returns_and_all_take_new_weights(model_dir):
    """Greedy HF engines (real engines in this process): same rows, order and groups as one engine,
    before and after a weight push that changes what they write."""
    one = HFEngine.from_dir(model_dir)
    dp = DataParallelEngine(lambda k: HFEngine.from_dir(model_dir), 3)
    args = dict(n=2, temperature=0.0, top_p=1.0, max_new_tokens=5, seed=3)
    for push in (False, True):
        if push:
            g = torch.Generator().manual_seed(1)
            new = [(k, v.detach() + 0.5 * torch.randn(v.shape, generator=g)) for k, v in one.model.named_parameters()]
            one.load_weights(new)
            dp.load_weights(iter(new))                                   # an iterator is read once, sent to all
        a, b = one.generate(ragged_prompts(), **args), dp.generate(ragged_prompts(), **args)
        assert b.group_ids == a.group_ids == [i for i in range(7) for _ in range(2)]
        assert b.completion_ids == a.completion_ids and b.prompt_ids == a.prompt_ids
        for x, y in zip(a.sampler_logprobs, b.sampler_logprobs):
            # Same tokens; logprobs up to fp32 rounding of kernels picked by batch shape (a shard of 2-3 prompts
            # vs all 7): 2.9e-5 seen after the push on a fresh .venv, so 1e-4.
            torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=1e-4)
        if push:
            assert a.completion_ids != before
        before = a.completion_ids
    dp.close()


def test_a_failing_replica_fails_the_call_after_all_have_ended(model_dir):
    engines = [HFEngine.from_dir(model_dir) for _ in range(2)]
    dp = DataParallelEngine(lambda k: engines[k], 2)
    engines[1].close()                 # replica 1 can no longer generate (its model is gone)
    with pytest.raises(AttributeError):
        dp.generate([[1, 4], [1, 5]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert engines[0].model is not None  # the healthy replica ran its shard and is untouched
    dp.close()


def before_and_after_a_push(model_dir, sizes: list, generate_args: dict) -> list:
    """For each (key, size) vLLM setting in `sizes` (e.g. ("data_parallel_size", 2)): (rollout, rollout after pushing
    the same perturbed weights), from one engine started on the tiny model."""
    from grpo_lab.rollout import make_engine, rollout_section

    g = torch.Generator().manual_seed(2)
    ref = dict(HFEngine.from_dir(model_dir).model.named_parameters())
    new = [(k, v.detach() + 0.3 * torch.randn(v.shape, generator=g)) for k, v in ref.items()]
    results = []
    for key, size in sizes:
        rollout = rollout_section(**{"engine": "vllm", "gpu_memory_utilization": 0.05, "max_model_len": 64,
                                     "enforce_eager": True, "dtype": "float32", key: size,
                                     "kv_cache_bytes": VLLM_KV_CACHE_BYTES})
        engine = make_engine(model_dir, rollout, seed=0)
        try:
            assert isinstance(engine, DataParallelEngine) == (key == "data_parallel_size" and size > 1)
            first = engine.generate(ragged_prompts(), **generate_args)
            engine.load_weights(new)
            results.append((first, engine.generate(ragged_prompts(), **generate_args)))
        finally:
            engine.close()
    assert results[0][0].completion_ids != results[0][1].completion_ids   # the push changed what is written
    return results


@pytest.mark.slow
def test_two_vllm_replicas_sample_exactly_what_one_engine_samples(model_dir):
    """The real thing on this machine's two cores: vLLM data_parallel_size=2 (one core each) vs one
    engine, sampled at temperature 1 with per-prompt seeds, then after the same weight push."""
    one, two = before_and_after_a_push(model_dir, [("data_parallel_size", 1), ("data_parallel_size", 2)],
                                       dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=11))
    for a, b in zip(one, two):
        assert a.completion_ids == b.completion_ids and a.group_ids == b.group_ids


@pytest.mark.slow
def test_a_tensor_parallel_engine_matches_one_device(model_dir):
    """rollout.tensor_parallel_size=2 on this machine's two cores (one per rank): greedy completions and
    their logprobs equal the one-device engine's, before and after a weight push (each rank loads its
    shard of the pushed tensors)."""
    one, two = before_and_after_a_push(model_dir, [("tensor_parallel_size", 1), ("tensor_parallel_size", 2)],
                                       dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0))
    for a, b in zip(one, two):
        assert a.completion_ids == b.completion_ids
        for x, y in zip(a.sampler_logprobs, b.sampler_logprobs):
            torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=1e-4)
