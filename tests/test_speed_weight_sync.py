"""Weight-sync protocol (grpo_lab/rollout/weight_sync.py, its worker side
grpo_lab/rollout/weight_sync_worker.py): transport selection, bucketing and its round trip, the
worker side's independence from the sender, changed-tensor detection — all without CUDA — and,
against the real CPU engine, a changed-only, many-bucket push after which vLLM's logprobs equal the
learner's (fp32, 1e-3). No timings are asserted (the benchmark is scripts/bench_sync.py)."""

import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
import numpy as np
import torch

from grpo_lab.rollout.weight_sync import ALIGN, ChangeTracker, choose_transport, layer_key, pack_bucket, plan_buckets
from grpo_lab.rollout.weight_sync_worker import unpack_bucket
from helpers import VLLM_KV_CACHE_BYTES

# --------------------------------------------------------------------------------- selection

UA, UB = "GPU-aaaa", "GPU-bbbb"


@pytest.mark.parametrize("engine_cuda, learner, learner_uuid, workers, want", [
    (False, "cpu", None, [], "cpu"),                # CPU build: shared-memory buckets
    (True, "cpu", None, [UA], "cpu"),               # learner on CPU, engine on GPU: host path
    (False, "cuda", UA, [], "cpu"),                 # CPU engine, CUDA learner: host path
    (True, "cuda", UA, [UA], "cuda_ipc"),           # same GPU: CUDA IPC
    (True, "cuda", UA, [UB], "nccl"),               # engine on its own GPU(s): NCCL group
    (True, "cuda", UA, [UA, UA], "cuda_ipc"),       # TP=2 ranks both on the learner's GPU
    # TP=2 over the learner's GPU and another: IPC handles open only on their own GPU and NCCL
    # refuses two ranks on one GPU, so the host path.
    (True, "cuda", UA, [UB, UA], "cpu"),
])
def test_auto_picks_the_transport_from_where_the_weights_live(engine_cuda, learner, learner_uuid, workers, want):
    assert choose_transport("auto", engine_on_cuda=engine_cuda, learner_device=learner,
                            learner_gpu_uuid=learner_uuid, worker_gpu_uuids=workers) == want


def test_explicit_choices_are_kept_or_refused_with_the_fix():
    assert choose_transport("cpu", engine_on_cuda=True, learner_device="cuda", learner_gpu_uuid=UA,
                            worker_gpu_uuids=[UA]) == "cpu"
    assert choose_transport("pickle", engine_on_cuda=False, learner_device="cpu") == "pickle"
    assert choose_transport("nccl", engine_on_cuda=True, learner_device="cuda", learner_gpu_uuid=UA,
                            worker_gpu_uuids=[UB]) == "nccl"
    with pytest.raises(ValueError, match="GPUs other than the learner's.*two ranks on one GPU"):
        choose_transport("nccl", engine_on_cuda=True, learner_device="cuda", learner_gpu_uuid=UA,
                         worker_gpu_uuids=[UA])
    with pytest.raises(ValueError, match="needs the learner and the vLLM engine on CUDA.*auto or cpu"):
        choose_transport("nccl", engine_on_cuda=False, learner_device="cpu")
    for workers in ([UB], [UA, UB]):   # the worker on UB could not open a handle to UA's memory
        with pytest.raises(ValueError, match="every engine GPU to be the learner's GPU.*nccl"):
            choose_transport("cuda_ipc", engine_on_cuda=True, learner_device="cuda", learner_gpu_uuid=UA,
                             worker_gpu_uuids=workers)
    with pytest.raises(ValueError, match="not one of"):
        choose_transport("shm", engine_on_cuda=False, learner_device="cpu")


# --------------------------------------------------------------------------------- what changed

def test_layer_key_follows_vllms_fused_layers():
    assert layer_key("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert layer_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert layer_key("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj"
    assert layer_key("model.norm.weight") == "model.norm"


def _named():
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [("model.embed_tokens.weight", t(16, 8)),
            ("model.layers.0.self_attn.q_proj.weight", t(8, 8)), ("model.layers.0.self_attn.k_proj.weight", t(4, 8)),
            ("model.layers.0.self_attn.v_proj.weight", t(4, 8)), ("model.layers.0.self_attn.o_proj.weight", t(8, 8)),
            ("model.layers.0.mlp.gate_proj.weight", t(16, 8)), ("model.layers.0.mlp.up_proj.weight", t(16, 8)),
            ("model.layers.0.mlp.down_proj.weight", t(8, 16)), ("model.norm.weight", t(8))]


def test_change_tracker_sends_everything_first_then_only_changed_whole_layers():
    named = _named()
    tr = ChangeTracker()
    assert [n for n, _ in tr.changed(named)] == [n for n, _ in named]      # first push: all
    tr.commit(named)
    assert tr.changed(named) == []                                          # nothing moved
    with torch.no_grad():
        named[2][1].add_(1.0)                                               # k_proj, in place (optimizer-style)
        named[7][1].mul_(2.0)                                               # down_proj
    got = [n for n, _ in tr.changed(named)]
    # k_proj drags q_proj and v_proj along: vLLM reloads qkv_proj only as a whole.
    assert got == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                   "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    tr.commit(named)
    # A new tensor under a known name (e.g. a merged LoRA weight, recomputed each step) is a change.
    named[8] = ("model.norm.weight", named[8][1].clone())
    assert [n for n, _ in tr.changed(named)] == ["model.norm.weight"]


def test_change_tracker_resends_fresh_tensors_that_reuse_a_freed_address():
    """Tensors made afresh for every push (LoRA's merged W + BA, FSDP2's gathered state dict) are freed
    after it; the next push's tensors of the same sizes often get their addresses, at version 0 again.
    They are changes, and the tracker must say so (it once compared pointer and version only, and an
    engine fed that way kept weights several steps old without any error).

    Whether the allocator reuses an address is up to it, so the test makes the reuse certain: each push
    wraps the same host memory in a new tensor (torch.from_numpy), i.e. same pointer, version 0, new
    storage, new values."""
    memory = np.zeros((64, 64), dtype=np.float32)
    tr = ChangeTracker()
    addresses = []
    for step in range(4):
        memory[:] = step                                                  # new values, same address
        named = [("model.layers.0.mlp.down_proj.weight", torch.from_numpy(memory))]
        addresses.append(named[0][1].data_ptr())
        assert named[0][1]._version == 0
        assert [n for n, _ in tr.changed(named)] == ["model.layers.0.mlp.down_proj.weight"], step
        tr.commit(named)
        del named
    assert len(set(addresses)) == 1                                       # every push at one address
    # And while the pushed tensor itself is alive and untouched, it is not resent.
    kept = [("model.layers.0.mlp.down_proj.weight", torch.from_numpy(memory))]
    tr.commit(kept)
    assert tr.changed(kept) == []


# --------------------------------------------------------------------------------- buckets

def test_buckets_round_trip_bit_exactly_and_never_split_a_layer():
    named = _named() + [("model.layers.0.input_layernorm.weight", torch.arange(8, dtype=torch.float16)),
                        ("model.layers.0.post_attention_layernorm.weight", torch.ones(3, dtype=torch.bfloat16))]
    # 700 bytes per bucket: smaller than qkv (16*8*4 = 512 + 2*128 = 768 B), which gets a bucket alone.
    buckets = plan_buckets(named, bucket_bytes=700)
    assert len(buckets) > 3
    seen = []
    for b in buckets:
        keys = {layer_key(m.name) for m in b.metas}
        seen += [m.name for m in b.metas]
        assert all(m.offset % ALIGN == 0 for m in b.metas)
        assert b.nbytes <= 700 or len(keys) == 1                            # oversize only for one layer
        buf = torch.full((b.nbytes,), 255, dtype=torch.uint8)
        pack_bucket(b, dict(named), buf)
        for name, view in unpack_bucket(buf, b.metas):
            src = dict(named)[name]
            assert view.dtype == src.dtype and view.shape == src.shape
            assert torch.equal(view, src)
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()   # a view, no copy
    assert seen == [n for n, _ in named]                                    # order kept, each once
    for key in {layer_key(n) for n, _ in named}:                            # each layer in exactly one bucket
        assert sum(any(layer_key(m.name) == key for m in b.metas) for b in buckets) == 1


def test_one_bucket_when_it_fits():
    named = _named()
    [b] = plan_buckets(named, bucket_bytes=2**20)
    assert b.nbytes >= sum(t.numel() * 4 for _, t in named)


def test_worker_side_imports_nothing_from_the_sender():
    """The vLLM worker process imports the shipped functions by their module path; that module must
    load on its own (no sender state, no learner-side imports)."""
    code = ("import sys, grpo_lab.rollout.weight_sync_worker as w\n"
            "assert 'grpo_lab.rollout.weight_sync' not in sys.modules, sorted(sys.modules)\n"
            "import functools, pickle\n"
            "fn = pickle.loads(pickle.dumps(functools.partial(w.worker_load, payload={})))\n"
            "assert fn.func is w.worker_load\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------- real CPU engine

@pytest.mark.slow
@pytest.mark.vllm
def test_changed_only_many_bucket_push_matches_the_learner(tmp_path):
    """Many small buckets (one reused shared-memory buffer, the padded embedding held back until the
    end), a second push with only some layers changed: the engine samples from exactly the learner's
    weights each time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lab.learner.batch import collate, completion_logits, encode_prompt, token_logprobs
    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.rollout.vllm_engine import VLLMEngine

    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet="0123456789+-=", seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tied = policy.config.tie_word_embeddings
    weights = lambda: [(n, p.detach()) for n, p in policy.named_parameters()  # noqa: E731
                       if not (tied and n == "lm_head.weight")]
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.1, max_model_len=128, enforce_eager=True,
                        dtype="float32", seed=0, sync_transport="cpu", sync_bucket_mb=0.05,
                        kv_cache_bytes=VLLM_KV_CACHE_BYTES)
    prompts = [encode_prompt(tok, p) for p in ("12+34=", "55-17=", "90-9=")]

    def gap() -> float:
        out = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3)
        batch = collate(out.prompt_ids, out.completion_ids, tok.pad_token_id, out.sampler_logprobs)
        with torch.no_grad():
            lp = token_logprobs(completion_logits(policy, batch), batch["completion_ids"])
        mask = batch["response_mask"].bool()
        return float((lp - batch["sampler_logprobs"])[mask].abs().max())

    try:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, p in policy.named_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        engine.load_weights(weights())
        assert engine.last_sync["buckets"] > 3 and engine.last_sync["tensors"] == len(weights())
        assert gap() < 1e-3
        with torch.no_grad():                                               # change two layers only
            policy.model.layers[1].self_attn.v_proj.weight.add_(0.5)
            policy.model.embed_tokens.weight.mul_(1.5)
        engine.load_weights(weights())
        assert engine.last_sync["tensors"] == 4                             # q, k, v of layer 1 + embedding
        assert gap() < 1e-3
        engine.load_weights(weights())
        assert engine.last_sync["tensors"] == 0                             # nothing changed: nothing sent
    finally:
        engine.close()
