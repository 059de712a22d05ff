"""The learner at scale: LoRA (only adapters move; the engine gets W + (α/r)·B A; the
reference is the base with adapters off), bf16 autocast over fp32 masters, chunked LM-head
logprobs/entropy, token-budget micro-batches, gradient checkpointing, LR schedules, checkpoints
with LoRA; plus end-to-end runs (HF engine: LoRA + bf16; vLLM: LoRA pushes keep the engine's
logprobs within 1e-3 of the learner's)."""

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from grpo_lab import checkpoint
from grpo_lab.schema import AlgorithmConfig, ConfigError, LearnerConfig
from grpo_lab.learner.batch import completion_stats
from grpo_lab.learner.learner import AdapterDisabledReference, Learner, micro_batches
from grpo_lab.learner.schedules import lr_factor
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.objectives import OBJECTIVES
from helpers import TINY_RUN, assert_finite_metrics, max_param_change, read_metrics, run_train, start_model_dir
from test_learner import toy_batch

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=", seed=0)


def make_learner(model_dir, learner=None, **algo):
    algo_cfg = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), algo)
    learner_cfg = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                                  {"device": "cpu", "micro_batch_size": 64, "grad_clip": 0.0, **(learner or {})})
    return Learner(model_dir, objective=OBJECTIVES.get(algo_cfg.objective), learner_cfg=learner_cfg, algo_cfg=algo_cfg,
                   temperature=1.0, seed=0,
                   max_completion_len=6)


def train_steps(learner, steps=2, n=10):
    for s in range(steps):
        batch = toy_batch(seed=s, n=n)
        learner.score(batch)
        learner.update(batch)


def base_logprobs(model_dir, batch):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return completion_stats(model, batch)[0]


# ---------------------------------------------------------------------------------------------- LoRA
def test_lora_update_changes_only_adapter_weights(model_dir):
    learner = make_learner(model_dir, {"lr": 1e-2, "lora": LORA})
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    train_steps(learner, steps=2)      # step 1 moves B (B = 0 gives A no gradient), step 2 moves A too
    after = learner.policy.state_dict()
    adapters = [k for k in before if ".lora_" in k]
    assert adapters and len(adapters) < len(before)
    for k in before:
        if ".lora_" in k:
            assert not torch.equal(before[k], after[k]), f"adapter {k} did not move"
        else:
            assert torch.equal(before[k], after[k]), f"base weight {k} changed under LoRA"
    # AdamW holds state for the adapters only.
    optimized = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(adapters) and all(p.requires_grad for p in optimized)


def test_merged_sync_weights_equal_base_plus_scaled_delta(model_dir):
    learner = make_learner(model_dir, {"lr": 1e-2, "lora": LORA})
    train_steps(learner, steps=2)
    sync = dict(learner.weights_for_sync())
    state = learner.policy.get_base_model().state_dict()
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    scale = LORA["alpha"] / LORA["rank"]                       # α / r = 8 / 4 = 2
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            prefix = f"model.layers.{layer}.{module}"
            A, B = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            expected = plain[f"{prefix}.weight"] + scale * B @ A           # W + (α/r)·B A, [out, in]
            torch.testing.assert_close(sync[f"{prefix}.weight"], expected, rtol=0, atol=1e-6)
            assert not torch.equal(sync[f"{prefix}.weight"], plain[f"{prefix}.weight"])
        # k_proj is not adapted but travels with q/v (vLLM fuses qkv_proj and reloads it whole);
        # down_proj is fused with nothing, so gate/up stay home.
        assert torch.equal(sync[f"model.layers.{layer}.self_attn.k_proj.weight"],
                           plain[f"model.layers.{layer}.self_attn.k_proj.weight"])
    assert set(sync) == {f"model.layers.{i}.{m}.weight" for i in range(2)
                         for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert set(sync) <= set(plain)                            # base names, nothing peft-specific, no lm_head

    # An engine that loads only these tensors into the starting model computes the learner's logprobs.
    engine = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        params = dict(engine.named_parameters())
        for name, t in sync.items():
            params[name].copy_(t)
    batch = toy_batch(seed=5)
    learner.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(completion_stats(engine, batch)[0], learner.policy_logprobs(batch)[0],
                                   rtol=0, atol=1e-5)


def test_lora_reference_is_the_starting_policy_with_adapters_off(model_dir):
    learner = make_learner(model_dir, {"lr": 1e-2, "lora": LORA}, kl={"coef": 0.05})
    assert isinstance(learner.ref, AdapterDisabledReference) and list(learner.ref.parameters()) == []
    n_params = sum(p.numel() for p in learner.policy.parameters())
    n_base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
    assert n_params < 1.1 * n_base                            # no second copy of the model
    batch = toy_batch(seed=7)
    start = base_logprobs(model_dir, batch)
    train_steps(learner, steps=2)
    learner.score(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["ref_logprobs"][mask], start[mask], rtol=0, atol=1e-6)
    with torch.no_grad():
        now = learner.policy_logprobs(batch)[0]
    assert (now - start)[mask].abs().max() > 1e-4   # the policy itself moved


# ---------------------------------------------------------------------------------------------- bf16
def test_bf16_runs_on_fp32_masters_and_logs_its_mismatch(model_dir):
    learner = make_learner(model_dir, {"dtype": "bf16", "lr": 1e-3}, kl={"coef": 0.05}, entropy_coef=0.01)
    batch = toy_batch(seed=3)
    # The "engine" sampled in fp32: its logprobs are the fp32 model's.
    batch["sampler_logprobs"] = base_logprobs(model_dir, batch)
    learner.score(batch)
    out = learner.update(batch)   # one step per batch: π_learner comes from the update's own forward
    diff = out["rollout/logprob_abs_diff_max"]
    assert 0 < diff < 0.1, diff              # bf16 rounding shows, but stays small (about 1e-2)
    assert all(math.isfinite(v) for v in out.values())
    assert all(p.dtype == torch.float32 for p in learner.policy.parameters())
    state = next(iter(learner.optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert learner.parameters_finite()


def test_bf16_with_lora_and_chunking_runs(model_dir):
    learner = make_learner(model_dir, {"dtype": "bf16", "lora": LORA, "logits_chunk_tokens": 16,
                                       "gradient_checkpointing": True}, kl={"coef": 0.05})
    train_steps(learner, steps=2)
    assert learner.parameters_finite()


# ---------------------------------------------------------------------------------------------- chunks
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_logprobs_and_entropy_equal_unchunked(model_dir, chunk):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = toy_batch(seed=1)
    weights = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    results = []
    for chunk_tokens in (None, chunk):
        model.zero_grad(set_to_none=True)
        logp, ent = completion_stats(model, batch, temperature=0.7, chunk_tokens=chunk_tokens, entropy=True)
        ((logp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6)
    torch.testing.assert_close(e1, e0, rtol=0, atol=1e-6)
    # Gradients reach |g| ~ 16 here and chunks sum the LM head's gradient in another order: equal up
    # to fp32 rounding (well inside the bound below; exactly 0 when one chunk holds everything).
    for k in g0:
        assert float((g1[k] - g0[k]).norm() / g0[k].norm().clamp(min=1e-12)) < 1e-6, k
    with torch.no_grad():                                     # the scoring path (no checkpointing)
        torch.testing.assert_close(completion_stats(model, batch, 0.7, chunk_tokens=chunk)[0], lp0, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- micro-batches
def sgd_delta(learner, batch):
    """Plain SGD with lr 1: the parameter change is minus the accumulated gradient."""
    learner.optimizer = torch.optim.SGD([p for p in learner.policy.parameters() if p.requires_grad], lr=1.0)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    before = copy.deepcopy(learner.policy.state_dict())
    learner.score(batch)
    learner.update(batch)
    return batch, {k: learner.policy.state_dict()[k] - before[k] for k in before}


def test_micro_batches_respect_the_token_budget():
    batch = toy_batch(seed=2, n=12)
    prompt, completion = batch.lengths()
    seen = []
    for idx, micro in micro_batches(batch, 64, max_tokens=24):
        width = micro["input_ids"].shape[1]
        assert len(idx) * width <= 24 or len(idx) == 1
        assert width == int(prompt[idx].max() + completion[idx].max())     # trimmed to its own rows
        assert torch.equal(micro["completion_ids"], batch["completion_ids"][idx, :micro["completion_ids"].shape[1]])
        seen += idx.tolist()
    assert sorted(seen) == list(range(12)) and len(seen) == 12


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_token_budget_micro_batching_leaves_the_update_unchanged(model_dir, aggregation):
    algo = dict(aggregation=aggregation, entropy_coef=0.01, kl={"coef": 0.05})
    one, d_one = sgd_delta(make_learner(model_dir, {"micro_batch_size": 64}, **algo), toy_batch(seed=4, n=12))
    split, d_split = sgd_delta(make_learner(model_dir, {"max_tokens_per_micro_batch": 24}, **algo),
                               toy_batch(seed=4, n=12))
    assert len(list(micro_batches(split, 64, 24))) > 3
    mask = one["response_mask"].bool()
    for k in ("learner_logprobs", "ref_logprobs"):
        torch.testing.assert_close(split[k][mask], one[k][mask], rtol=0, atol=1e-6)
    for k in d_one:
        torch.testing.assert_close(d_split[k], d_one[k], rtol=1e-4, atol=1e-6)
    assert max(d.abs().max() for d in d_one.values()) > 0


def test_token_budget_with_preference_pairs(model_dir):
    """DPO rows hold two views (chosen/, rejected/): the budget trims both alike."""
    deltas = []
    for budget in (None, 30):
        learner = make_learner(model_dir, {"max_tokens_per_micro_batch": budget}, objective="preference")
        learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=1.0)
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
        batch = toy_batch(seed=6, n=12)
        batch["rewards"] = torch.arange(12.0) % 3
        learner.score(batch)
        pairs, _ = OBJECTIVES.get("preference").prepare(batch, learner.algo, normalizer=None, step=1)
        if budget:
            assert len(list(micro_batches(pairs, 64, budget))) > 1
        before = copy.deepcopy(learner.policy.state_dict())
        learner.update(pairs)
        deltas.append({k: learner.policy.state_dict()[k] - before[k] for k in before})
    for k in deltas[0]:
        torch.testing.assert_close(deltas[1][k], deltas[0][k], rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_leaves_the_update_unchanged(model_dir):
    _, plain = sgd_delta(make_learner(model_dir), toy_batch(seed=8))
    _, ckpt = sgd_delta(make_learner(model_dir, {"gradient_checkpointing": True}), toy_batch(seed=8))
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- LR schedule
def test_lr_schedules_by_hand():
    # W = 2 warm-up steps, S = 6: warm-up (s+1)/W = 0.5, 1; then p = (s − 2) / 4 = 0, 1/4, 1/2, 3/4.
    f = lambda name: [lr_factor(s, schedule=name, warmup_steps=2, total_steps=6) for s in range(7)]  # noqa: E731
    assert f("constant") == [0.5, 1, 1, 1, 1, 1, 1]
    assert f("linear") == pytest.approx([0.5, 1, 1, 0.75, 0.5, 0.25, 0.0])
    c = (1 + math.cos(math.pi / 4)) / 2                        # ½(1 + cos(π/4)) = 0.853553...
    assert f("cosine") == pytest.approx([0.5, 1, 1, c, 0.5, 1 - c, 0.0])
    assert lr_factor(3, schedule="cosine", warmup_steps=0, total_steps=4) == pytest.approx((1 + math.cos(0.75 * math.pi)) / 2)


def test_learner_follows_the_schedule_and_checkpoints_it(model_dir):
    cfg = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 3}
    learner = make_learner(model_dir, cfg)
    lrs = []
    for s in range(4):
        batch = toy_batch(seed=s)
        learner.score(batch)
        lrs.append(learner.update(batch)["actor/lr"])
    # s=0: warm-up 1/1; s=1: p=0 -> 1; s=2: p=1/2 -> 0.5; s=3: p=1 -> 0
    assert lrs == pytest.approx([1e-3, 1e-3, 5e-4, 0.0], abs=1e-12)
    resumed = make_learner(model_dir, cfg)
    state = copy.deepcopy(learner.state_dict())
    resumed.optimizer.load_state_dict(state["optimizer"])
    resumed.scheduler.load_state_dict(state["scheduler"])
    assert resumed.scheduler.last_epoch == 4 and resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_with_lora_and_bf16(model_dir, tmp_path):
    cfg = {"lr": 1e-2, "lora": LORA, "dtype": "bf16", "lr_schedule": "linear", "total_steps": 10}
    learner = make_learner(model_dir, cfg)
    train_steps(learner, steps=2)
    ckpt = checkpoint.save(tmp_path, 2, learner=learner, tokenizer=None, state={}, keep=2)
    assert (ckpt / "policy" / "adapter" / "adapter_model.safetensors").is_file()

    # The saved policy is a plain HF directory holding the merged weights.
    merged = AutoModelForCausalLM.from_pretrained(str(ckpt / "policy"), dtype=torch.float32).state_dict()
    for name, t in learner.weights_for_sync():
        torch.testing.assert_close(merged[name], t, rtol=0, atol=0)

    resumed = make_learner(model_dir, cfg)
    resumed.load_state(ckpt / "policy", checkpoint.load(ckpt)["learner"])
    for (k, a), (k2, b) in zip(learner.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert resumed.scheduler.state_dict() == learner.scheduler.state_dict() and resumed.step == 2
    # ... and continues exactly as the uninterrupted learner does.
    for each in (learner, resumed):
        train_steps(each, steps=1)
    for a, b in zip(learner.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


def test_a_lora_checkpoint_does_not_load_into_another_rank(model_dir, tmp_path):
    learner = make_learner(model_dir, {"lora": LORA})
    ckpt = checkpoint.save(tmp_path, 1, learner=learner, tokenizer=None, state={}, keep=1)
    other = make_learner(model_dir, {"lora": {**LORA, "target_modules": ["q_proj", "o_proj"]}})
    with pytest.raises(RuntimeError, match="does not match the policy's adapters"):
        other.load_state(ckpt / "policy", checkpoint.load(ckpt)["learner"])


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("override,message", [
    ("learner.dtype=fp16", "learner.dtype='fp16'; valid choices: fp32, bf16"),
    ("learner.lora.alpha=0", "learner.lora.alpha=0.0 must be > 0"),
    ("learner.max_tokens_per_micro_batch=100", "learner.max_tokens_per_micro_batch=100 is smaller than one sequence"),
    ("learner.logits_chunk_tokens=0", "learner.logits_chunk_tokens=0 must be >= 1"),
    ("learner.lr_schedule=step", "learner.lr_schedule='step' is not registered; valid choices: constant, cosine, linear"),
    ("learner.warmup_steps=200", "learner.total_steps=150 steps, which must exceed learner.warmup_steps=200"),
])
def test_bad_scale_settings_fail_with_what_to_change(override, message):
    from test_config import make
    from grpo_lab.config import validate

    extra = ["learner.lora.rank=4"] if "lora" in override else []
    extra += ["learner.lr_schedule=cosine"] if "warmup" in override else []
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make([override, *extra]))


def test_total_steps_defaults_to_the_trainers():
    from test_config import make

    cfg = make(["trainer.total_steps=37"])
    assert cfg.learner.total_steps == 37 and cfg.learner.lora.rank == 0 and cfg.learner.dtype == "fp32"


# ---------------------------------------------------------------------------------------------- end to end
def test_two_step_run_with_lora_and_bf16(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "rollout=hf", "learner.lora.rank=4", "learner.dtype=bf16", "learner.lr=1e-3",
                      "learner.logits_chunk_tokens=64", "learner.max_tokens_per_micro_batch=256",
                      "learner.lr_schedule=linear"], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [0, 1, 2, 2]
    assert_finite_metrics(lines)
    for line in lines[1:3]:
        assert "rollout/logprob_abs_diff_max" in line   # logged every step (bf16 learner vs fp32 engine)
    # linear over trainer.total_steps=2: s=0 -> 1, s=1 -> 1 - 1/2
    assert lines[1]["actor/lr"] == pytest.approx(1e-3) and lines[2]["actor/lr"] == pytest.approx(5e-4)
    final = run_dir / "checkpoints" / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert max_param_change(start_model_dir(warm_cache), final) > 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.vllm
@pytest.mark.slow          # one vLLM engine start and three steps
def test_vllm_follows_lora_pushes(tmp_path, warm_cache):
    """After each push of merged adapted layers (q, v adapted: k travels with them, since vLLM fuses
    qkv), the engine samples from the learner's policy: logprobs agree within 1e-3 in fp32."""
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "rollout=vllm", "learner.lora.rank=4", "learner.lora.target_modules=[q_proj,v_proj]",
                      "learner.lr=1e-2", "trainer.total_steps=3"], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = read_metrics(run_dir)
    assert_finite_metrics(lines)
    steps = [m for m in lines if "rollout/logprob_abs_diff_max" in m]
    assert len(steps) == 3
    for line in steps[1:]:                       # sampled after one and two pushes
        assert line["rollout/logprob_abs_diff_max"] <= 1e-3, line["rollout/logprob_abs_diff_max"]
    # The pushes carried a real change (lr 1e-2 moves merged weights well past 1e-3).
    assert max_param_change(start_model_dir(warm_cache), run_dir / "checkpoints" / "final") > 1e-3


def test_host_tree_rss_counts_child_processes():
    """perf/host_rss_gib is the whole process tree (the engine's processes are children): a child
    holding 300 MB shows up in it."""
    import subprocess
    import sys

    from grpo_lab.train import host_tree_rss_gib

    alone = host_tree_rss_gib()
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(300 * 2**20); "
                              "b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with_child = host_tree_rss_gib()
    finally:
        child.kill()
        child.wait()
    assert with_child - alone > 0.25, (alone, with_child)


def test_malloc_trim_returns_freed_heap_and_keeps_live_tensors():
    """Why the trainer calls release_freed_host_memory each step: tensors below glibc's mmap threshold
    live on the heap; freeing most of them while a few survive (activations of varying size) leaves
    the pages resident until malloc_trim hands them back. Live tensors keep their values."""
    import ctypes.util

    import psutil

    from grpo_lab.learner.learner import release_freed_host_memory

    if "libc.so.6" not in (ctypes.util.find_library("c") or ""):
        pytest.skip("malloc_trim is glibc's")
    me = psutil.Process()
    chunks = [torch.full((10_000,), float(i)) for i in range(8_000)]   # 40 kB each, 320 MB on the heap
    kept = chunks[::50]                                                 # survivors pin the heap's top
    del chunks
    before = me.memory_info().rss
    release_freed_host_memory()
    after = me.memory_info().rss
    # Without the call nothing comes back; with it, well over the bound below (glibc returns whole
    # free pages only, hence survivors spread over the heap).
    assert before - after > 50 * 2**20, (before, after)
    assert [float(t[0]) for t in kept] == [float(i) for i in range(0, 8_000, 50)]
