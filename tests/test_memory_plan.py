"""The memory plan (grpo_lab/memory_plan.py) against hand arithmetic, and the recipes against the plan.

Every expected number is worked out in the comment above it; GB = 1e9 bytes.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.memory_plan import check_fits, lora_params, plan_memory, resolve_arch
from grpo_lab.models.arch import KNOWN_ARCHITECTURES, arch_from_hf_config, known_arch
from grpo_lab.schema import ConfigError

register_configs()
CONF = Path(__file__).resolve().parents[1] / "conf"
GPU_RECIPES = sorted(p.stem for p in (CONF / "experiment").glob("gpu_*.yaml"))
QWEN_7B_PARAMS = 7_615_616_512   # Qwen2.5-(Math-)7B, "7.61B" on its model card
# The GPU recipes as first written (fp32, no checkpointing, whole logits, one device).
AS_WRITTEN = ["learner.dtype=fp32", "learner.gradient_checkpointing=false", "learner.logits_chunk_tokens=null",
              "learner.num_devices=1"]


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def meta_param_count(hf_config) -> int:
    """Parameters of the real transformers model, built on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())   # a tied lm_head is counted once


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-7b", "deepseek-math-7b"])
def test_parameter_count_matches_the_real_model(name):
    """The table's arithmetic equals transformers' own model for the same sizes (Llama and Qwen2 code)."""
    from transformers import LlamaConfig, Qwen2Config

    a = KNOWN_ARCHITECTURES[name]
    cls = Qwen2Config if a.qkv_bias else LlamaConfig
    hf = cls(hidden_size=a.hidden_size, num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
             num_key_value_heads=a.num_kv_heads, intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
             tie_word_embeddings=a.tie_word_embeddings)
    assert meta_param_count(hf) == a.num_params()
    assert arch_from_hf_config(hf).num_params() == a.num_params()   # the AutoConfig path agrees


def test_qwen3_qk_norm_is_counted():
    from transformers import Qwen3Config

    hf = Qwen3Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, intermediate_size=512, vocab_size=1000, tie_word_embeddings=False)
    assert arch_from_hf_config(hf).num_params() == meta_param_count(hf)


def test_qwen_7b_count_by_hand():
    # embed + untied lm_head: 2 × 152064 × 3584 = 1,090,011,136
    # per layer: q 3584² + k, v 3584·512 each + o 3584² = 29,360,128; q/k/v biases 3584 + 512 + 512 = 4,608;
    #   MLP 3 × 3584 × 18944 = 203,685,888; two norms 7,168 -> 233,057,792; × 28 = 6,525,618,176
    # + final norm 3,584 -> 7,615,616,512
    assert KNOWN_ARCHITECTURES["qwen2.5-math-7b"].num_params() == QWEN_7B_PARAMS


def test_full_fp32_7b_is_16_bytes_per_param_before_activations():
    cfg = make(["experiment=gpu_algorithms", *AS_WRITTEN])
    plan = plan_memory(cfg, machine=False)
    P = QWEN_7B_PARAMS
    # 4 B weights + 4 B gradients + 8 B AdamW (two fp32 moments) = 16 B/param:
    # 7,615,616,512 × 16 = 121,849,864,192 B ≈ 121.8 GB (121.6 GB when P is rounded to 7.6e9 first)
    states = plan.item("policy weights (fp32)") + plan.item("gradients (fp32)") + plan.item("AdamW state (fp32)")
    assert states == 16 * P == 121_849_864_192
    assert plan.item("reference model") == 0 and plan.item("critic (+AdamW)") == 0    # GRPO, β = 0
    # vLLM colocated at 0.4 of a 141 GB GPU: 56.4 GB, weights and KV cache included
    assert plan.item("rollout engine (vllm)") == pytest.approx(0.4 * 141e9)
    # T = 8 sequences × 4096 = 32,768 tokens; logits 32,768 × 152,064 × 4 B × 4 copies = 79,725,330,432 B
    assert plan.item("logits (fp32)") == 32_768 * 152_064 * 16 == 79_725_330_432
    # per token per layer, fp32: 4 × (4·3584 + 2·(28 + 4)·128 + 4·18944) = 4 × 98,304 = 393,216 B;
    # × 28 layers + final norm 2·3584·4 = 11,038,720 B/token; × 32,768 = 361,716,776,960 B
    assert plan.item("activations") == 32_768 * (28 * 393_216 + 2 * 3584 * 4) == 361_716_776_960
    assert plan.device_memory == 141e9 and plan.fits is False


def test_bf16_keeps_fp32_master_weights_and_halves_activations():
    fp32 = plan_memory(make(["experiment=gpu_algorithms", *AS_WRITTEN]), machine=False)
    bf16 = plan_memory(make(["experiment=gpu_algorithms", *AS_WRITTEN, "learner.dtype=bf16"]), machine=False)
    P = QWEN_7B_PARAMS
    # fp32 master 4 B + bf16 compute copy 2 B; gradients 4 B and AdamW 8 B stay fp32: 18 B/param
    assert bf16.item("policy weights (fp32)") + bf16.item("policy bf16 copy") == 6 * P
    assert bf16.item("AdamW state (fp32)") == fp32.item("AdamW state (fp32)") == 8 * P
    # activations: e = 2 instead of 4, exactly half
    assert bf16.item("activations") * 2 == fp32.item("activations")


def test_tiny_activations_logits_and_checkpointing_by_hand():
    cfg = make()   # tiny_llama h=128, L=2, 4 heads (d=32), I=512; micro-batch 64 × max_model_len 256
    plan = plan_memory(cfg, device_memory=24e9)
    # per token per layer: 4 B × (4·128 + 2·(4 + 4)·32 + 4·512) = 4 × 3,072 = 12,288 B
    # T = min(64, 32 prompts × G 8 / 1 minibatch) × 256 = 16,384; activations 16,384 × (2·12,288 + 2·128·4)
    assert plan.item("activations") == 16_384 * (2 * 12_288 + 1_024) == 419_430_400
    # logits: 16,384 × V (bound 100) × 4 B × 4 copies = 26,214,400
    assert plan.item("logits (fp32)") == 26_214_400
    ckpt = plan_memory(make(["learner.gradient_checkpointing=true", "learner.logits_chunk_tokens=1024"]),
                       device_memory=24e9)
    # checkpointed: layer inputs L·h·4 = 1,024 + one layer 12,288 + final norm 1,024 = 14,336 B/token
    assert ckpt.item("activations") == 16_384 * 14_336 == 234_881_024
    # chunked logits: 1,024 × 100 × 16 = 1,638,400
    assert ckpt.item("logits (fp32)") == 1_638_400
    # a token budget replaces sequences × max_model_len
    budget = plan_memory(make(["learner.max_tokens_per_micro_batch=2048"]), device_memory=24e9)
    assert budget.item("activations") == 2_048 * 25_600


def test_lora_shrinks_trainable_state_and_drops_the_reference():
    P = QWEN_7B_PARAMS
    cfg = make(["experiment=gpu_algorithms", "learner.num_devices=1", "learner.lora.rank=64",
                "algorithm.kl.coef=0.04"])
    plan = plan_memory(cfg, machine=False)
    # Σ(in + out) over q, k, v, o, gate, up, down of Qwen2.5-7B:
    #   (3584+3584) + (3584+512) + (3584+512) + (3584+3584) + 2·(3584+18944) + (18944+3584) = 90,112
    # A = 28 layers × r 64 × 90,112 = 161,480,704 adapter parameters; × 16 B = 2,583,691,264 B ≈ 2.6 GB
    A = lora_params(KNOWN_ARCHITECTURES["qwen2.5-math-7b"], 64, cfg.learner.lora.target_modules)
    assert A == 28 * 64 * 90_112 == 161_480_704
    assert plan.item("LoRA adapters (fp32)") == 16 * A
    assert plan.item("policy base (frozen)") == 2 * P                       # bf16 base, no gradient
    assert plan.item("AdamW state (fp32)") == plan.item("gradients (fp32)") == 0
    assert plan.item("reference model") == 0                               # adapters disabled = reference
    full = plan_memory(make(["experiment=gpu_algorithms", "learner.num_devices=1", "algorithm.kl.coef=0.04"]),
                       machine=False)
    assert full.item("AdamW state (fp32)") == 8 * P > 20 * 8 * A            # 60.9 GB vs 1.3 GB of moments


@pytest.mark.parametrize("overrides,has_ref,has_critic", [
    (["algorithm=grpo"], False, False),                       # β = 0: no reference is loaded
    (["algorithm=grpo", "algorithm.kl.coef=0.04"], True, False),
    (["algorithm=dpo"], True, False),                          # β log π/π_ref needs it with kl.coef = 0
    (["algorithm=ppo"], True, True),                           # KL 0.001 in the reward + a critic
])
def test_reference_and_critic_only_when_the_objective_needs_them(overrides, has_ref, has_critic):
    cfg = make(["experiment=gpu_algorithms", *AS_WRITTEN, *overrides])
    plan = plan_memory(cfg, machine=False)
    P, arch = QWEN_7B_PARAMS, KNOWN_ARCHITECTURES["qwen2.5-math-7b"]
    assert plan.item("reference model") == (4 * P if has_ref else 0)        # frozen fp32 copy
    # critic: trunk (P − untied lm_head 152,064 × 3584 = 7,070,622,208) + value head 3584 + 1, 16 B each
    C = P - 152_064 * 3584 + 3585
    assert arch.trunk_params() + 3585 == C == 7_070_622_721
    assert plan.item("critic (+AdamW)") == (16 * C if has_critic else 0)


def test_sharding_divides_states_not_activations():
    one = plan_memory(make(["experiment=gpu_algorithms", "learner.num_devices=1"]), machine=False)
    eight = plan_memory(make(["experiment=gpu_algorithms", "learner.num_devices=8"]), machine=False)
    assert eight.item("AdamW state (fp32)") * 8 == one.item("AdamW state (fp32)")
    assert eight.item("activations") == one.item("activations")
    assert eight.item("rollout engine (vllm)") == one.item("rollout engine (vllm)")   # per GPU


def test_an_over_budget_config_is_refused_with_the_keys_to_change():
    cfg = make(["experiment=gpu_algorithms", *AS_WRITTEN])
    with pytest.raises(ConfigError) as err:
        validate(cfg, machine=False)
    msg = str(err.value)
    assert "needs 619.7 GB per device but the device has 141.0 GB" in msg
    for key in ("learner.lora.rank=64", "learner.dtype=bf16", "learner.gradient_checkpointing=true",
                "learner.logits_chunk_tokens=", "learner.micro_batch_size=", "learner.num_devices=",
                "rollout.gpu_memory_utilization"):
        assert key in msg, key
    # the combined fix is computed, not guessed: bf16 + checkpointing + chunks fits on 2 sharded GPUs
    assert "fits with learner.num_devices=2" in msg


def test_warn_and_off_do_not_refuse():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(make(["experiment=gpu_algorithms", *AS_WRITTEN, "learner.memory_plan=warn"]), machine=False)
    assert any("does not fit" in str(w.message) for w in caught)
    validate(make(["experiment=gpu_algorithms", *AS_WRITTEN, "learner.memory_plan=off"]), machine=False)
    with pytest.raises(ConfigError, match="learner.memory_plan='maybe'; valid choices: check, warn, off"):
        validate(make(["learner.memory_plan=maybe"]), machine=False)


def test_declared_device_memory_wins_and_unknown_skips():
    # a declared 10 GB device refuses the fp32 SmolLM2 default plan even on machine=False
    with pytest.raises(ConfigError, match="the device has 10.0 GB"):
        validate(make(["model=smollm2_135m", "learner.device_memory_gb=10"]), machine=False)
    # device=auto, machine=False, nothing declared: the device is not known here, nothing is checked
    assert plan_memory(make(["model=smollm2_135m"]), machine=False).fits is None
    # an unknown model directory that is not on this machine: plan skipped, validate passes, render says why
    plan = plan_memory(make(["model=pretrained", "model.path=/models/no-such-model"]), machine=False)
    assert plan.arch is None and plan.fits is None and "skipped" in plan.render()


def test_known_architectures_by_directory_name_and_autoconfig_from_a_local_dir(tmp_path):
    assert known_arch("/models/Qwen2.5-Math-7B").name == "Qwen2.5-Math-7B"
    assert known_arch("/models/Qwen2.5-Math-7B-Instruct/").name == "Qwen2.5-Math-7B"
    assert known_arch("/models/deepseek-math-7b-instruct").name == "deepseek-math-7b"
    assert known_arch("/models/Meta-Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"
    assert known_arch("/models/unknown-7b") is None
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300, tie_word_embeddings=False).save_pretrained(tmp_path)
    arch = resolve_arch(make(["model=pretrained", f"model.path={tmp_path}"]))
    assert (arch.hidden_size, arch.num_layers, arch.num_kv_heads, arch.vocab_size) == (64, 3, 2, 300)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_gpu_recipe_fits_one_141gb_gpu_or_declares_how_many(name):
    cfg = make([f"experiment={name}"])
    validate(cfg, machine=False)              # includes the memory plan at 141 GB (learner.device=cuda)
    plan = plan_memory(cfg, machine=False)
    assert plan.device_memory == 141e9 and plan.fits, plan.render()
    header = (CONF / "experiment" / f"{name}.yaml").read_text().split("\ndefaults:")[0]
    n = cfg.learner.num_devices
    if n > 1:
        assert re.search(rf"NEEDS {n} GPUs", header), f"{name}.yaml's header must say it needs {n} GPUs"


def test_the_tiny_default_fits_this_machine():
    plan = check_fits(make())                 # machine=True: this machine's RAM (no CUDA here)
    assert plan.fits and plan.total < 5e9
    text = plan.render()
    assert "tiny_llama" in text and "total" in text and "fits" in text


def test_a_learned_reward_model_is_planned_beside_the_learner():
    """reward=reward_model: each ensemble member holds the trunk and a scalar head in fp32 (4·C bytes; 2·C when
    it only scores in bf16), and with online refresh also its gradients and AdamW state (16·C), or LoRA
    adapters; C by hand for the tiny model the head adds h + 1 = 129 parameters to its trunk."""
    arch = resolve_arch(make(["experiment=rlhf_tiny"]))
    C = arch.trunk_params() + arch.hidden_size + 1
    assert arch.hidden_size == 128 and C == arch.trunk_params() + 129
    frozen = plan_memory(make(["experiment=rlhf_tiny"]), machine=False)
    assert frozen.item("reward model (frozen)") == 4 * C
    three = plan_memory(make(["experiment=rlhf_tiny", "reward_model.ensemble_size=3"]), machine=False)
    assert three.item("reward model (frozen)") == 3 * 4 * C
    scoring_bf16 = plan_memory(make(["experiment=rlhf_tiny", "reward_model.ensemble_size=3",
                                     "reward.reward_model.dtype=bf16"]), machine=False)
    assert scoring_bf16.item("reward model (frozen)") == 3 * 2 * C
    refreshed = plan_memory(make(["experiment=rlhf_tiny", "reward_model.refresh_every=5"]), machine=False)
    assert refreshed.item("reward model (refreshed, +AdamW)") == 16 * C and refreshed.item("reward model (frozen)") == 0
    assert refreshed.total == frozen.total + 12 * C
    none = plan_memory(make([]), machine=False)
    assert not any(i.name.startswith("reward model") for i in none.items)
