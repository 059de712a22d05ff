"""The in-memory weight push into the running vLLM engine: after a learner update, the engine samples
from the *new* policy — its logprobs equal the learner's for the same tokens (fp32, within 1e-3)
and differ from the pre-update policy's."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.learner.batch import collate, completion_logits, encode_prompt, token_logprobs
from grpo_lab.learner.learner import Learner
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.rollout import rollout_section
from grpo_lab.schema import AlgorithmConfig, LearnerConfig
from helpers import VLLM_KV_CACHE_BYTES

pytestmark = pytest.mark.vllm

ROLLOUT = rollout_section(engine="vllm", gpu_memory_utilization=0.1, max_model_len=128, enforce_eager=True,
                          dtype="float32", kv_cache_bytes=VLLM_KV_CACHE_BYTES)
ALGO = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), dict(
    name="grpo", objective="policy_gradient", policy_loss="clipped_surrogate", clip_low=0.2, clip_high=0.2,
    dual_clip=None, aggregation="token_mean", epochs=1, minibatches=1, entropy_coef=0.0,
    kl=dict(coef=0.0, estimator="k3", placement="loss"), critic=dict(enabled=False)))
LEARNER = OmegaConf.merge(OmegaConf.structured(LearnerConfig), dict(
    device="cpu", lr=3e-2, weight_decay=0.0, grad_clip=0.0, micro_batch_size=16, total_steps=10))
# LoRA on every projection: each push carries merged W + (α/r)·B·A tensors made afresh and freed after
# it, whose addresses the next push's tensors get (the case a pointer-and-version change filter missed).
LEARNER_LORA = OmegaConf.merge(LEARNER, dict(lora=dict(rank=4, alpha=8.0, dropout=0.0, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])))


def logprobs_under(model, rollout, pad_id):
    batch = collate(rollout.prompt_ids, rollout.completion_ids, pad_id, rollout.sampler_logprobs)
    with torch.no_grad():
        return token_logprobs(completion_logits(model, batch), batch["completion_ids"]), batch


# Slow tier: each case starts engines of its own; the default suite checks the push through
# tests/test_e2e.py (the vLLM run's step 2 samples after a push and must match the learner's logprobs).
# The change filter's reused-address case is tested deterministically in tests/test_speed_weight_sync.py.
@pytest.mark.parametrize("where", [pytest.param("this_process", marks=pytest.mark.slow),
                                   pytest.param("child_process", marks=pytest.mark.slow),
                                   pytest.param("this_process_lora", marks=pytest.mark.slow)])
def test_engine_follows_the_learner_after_a_push(tmp_path, where):
    from transformers import AutoTokenizer

    from grpo_lab.rollout import make_engine
    from grpo_lab.rollout.engine_process import EngineProcess

    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet="0123456789+-=", seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    learner = Learner(model_dir, objective=OBJECTIVES.get(ALGO.objective),
                      learner_cfg=LEARNER_LORA if where.endswith("lora") else LEARNER, algo_cfg=ALGO,
                      temperature=1.0, seed=0, max_completion_len=6)
    # child_process: trainer.backend=engine_process (weights through shared memory, a push per update).
    engine = EngineProcess(model_dir, ROLLOUT, seed=0) if where == "child_process" else \
        make_engine(model_dir, ROLLOUT, seed=0)
    try:
        prompts = [encode_prompt(tok, p) for p in ("12+34=", "55-17=", "90-9=", "7+71=")]
        sample = lambda seed: engine.generate(prompts, n=4, temperature=1.0, top_p=1.0,  # noqa: E731
                                              max_new_tokens=6, seed=seed)

        # Before any update the engine and the learner hold the same weights.
        first = sample(1)
        learner_lp, batch = logprobs_under(learner.policy, first, tok.pad_token_id)
        mask = batch["response_mask"].bool()
        assert (learner_lp - batch["sampler_logprobs"])[mask].abs().max() < 1e-3

        # A real update (random advantages: every sequence gets a gradient), then the push; three times,
        # since later pushes of the same parameter storages (or of fresh tensors at reused addresses) are
        # where a changed-only filter can go wrong.
        for push in (1, 2, 3):
            old_policy = copy.deepcopy(learner.policy)
            learner.score(batch)
            batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]).clone()
            batch["loss_mask"] = batch["response_mask"]
            learner.update(batch)
            engine.load_weights(learner.weights_for_sync())

            second = sample(1 + push)
            new_lp, batch2 = logprobs_under(learner.policy, second, tok.pad_token_id)
            old_lp, _ = logprobs_under(old_policy, second, tok.pad_token_id)
            mask2 = batch2["response_mask"].bool()
            engine_lp = batch2["sampler_logprobs"]
            assert (new_lp - engine_lp)[mask2].abs().max() < 1e-3, push   # the engine runs the new weights
            assert (old_lp - engine_lp)[mask2].abs().max() > 1e-2, push   # ... not the old ones
            batch = batch2
    finally:
        engine.close()
