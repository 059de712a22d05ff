"""Config composition and validation: every group choice composes; bad values fail early with a
message that says what to change."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from grpo_lab.config import derive_run_name, finalize, register_configs, validate
from grpo_lab.schema import ConfigError

register_configs()  # what every entry point does before Hydra composes

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["algorithm", "model", "task", "reward", "rollout", "learner", "logger", "interaction"]


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# The GPU recipes' groups (conf/experiment/gpu_*.yaml) compose with one another, not with the tiny CPU
# default: each is checked among the others, off this machine (no CUDA, /models or /data here).
GPU_CONTEXT = {"model": "qwen2_5_math_7b", "task": "math_l3to5", "rollout": "vllm_gpu", "learner": "fsdp_bf16",
               "learner.num_devices": 4}
GPU_CHOICES = {("model", "qwen2_5_math_7b"): {}, ("model", "deepseek_math_7b_instruct"): {},
               ("model", "qwen2_5_32b"): {"learner.num_devices": 32}, ("task", "math_l3to5"): {}, ("task", "math_l3to5_tools"): {}, ("task", "math"): {},
               ("task", "gsm8k_math"): {}, ("rollout", "vllm_gpu"): {}, ("learner", "fsdp_bf16"): {},
               ("task", "dapo_math_17k"): {"model": "qwen2_5_32b", "learner.num_devices": 32,
                                           "rollout.max_model_len": 22528, "learner.max_tokens_per_micro_batch": 22528},
               ("interaction", "critic_qwen2_5_1_5b"): {}}     # its critic: a directory under /models


@pytest.mark.parametrize("group,choice", [(g, c) for g in GROUPS for c in choices(g)])
def test_every_group_choice_composes_and_validates(group, choice):
    if (group, choice) in GPU_CHOICES:
        cfg = make([f"{k}={v}" for k, v in {**GPU_CONTEXT, group: choice, **GPU_CHOICES[group, choice]}.items()])
        validate(cfg, machine=False)
        assert cfg.run_name == derive_run_name(cfg)
        return
    extra = {("model", "pretrained"): ["model.path=/models/any"],
             # The tiny model's 64 x 256-token micro-batch is 38 GB for SmolLM2 by the memory plan
             # (fp32 activations + four copies of 49k-vocabulary logits): more than this machine has.
             ("model", "smollm2_135m"): ["learner.micro_batch_size=8"]}.get((group, choice), [])
    cfg = make([f"{group}={choice}", *extra])
    validate(cfg)
    assert cfg.run_name == derive_run_name(cfg)


def test_defaults_are_the_documented_experiment():
    cfg = make()
    assert (cfg.algorithm.name, cfg.rollout.engine, cfg.rollout.group_size) == ("grpo", "vllm", 8)
    assert cfg.rollout.max_new_tokens == cfg.task.max_completion_tokens  # interpolation resolved once
    assert cfg.run_name == "chain_sum_tiny_llama_grpo_G8_clip0.2_kl0_s0"


def test_run_name_follows_overrides():
    cfg = make(["rollout.group_size=16", "algorithm.kl.coef=0.04", "algorithm.clip_high=0.28", "seed=3"])
    assert cfg.run_name == "chain_sum_tiny_llama_grpo_G16_clip0.2-0.28_kl0.04k3_s3"


def test_run_name_carries_task_and_model():
    assert make(["task=gcd", "model=smollm2_135m"]).run_name.startswith("gcd_smollm2_135m_grpo_G8_")
    assert make(["task=partial_sums"]).run_name.startswith("chain_sum-partial_sums_tiny_llama_")
    cfg = make(["model=pretrained", "model.path=/data/models/Qwen2.5-0.5B-Instruct"])
    assert cfg.run_name.startswith("chain_sum_Qwen2.5-0.5B-Instruct_grpo_")


def test_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as err:
        make(["algorithm.clip_lo=0.1"])
    assert "clip_lo" in str(err.value.__cause__ or err.value)


def test_misspelt_group_choice_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as err:
        make(["algorithm=grop"])
    assert "grpo" in str(err.value)  # Hydra lists the available options


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as err:
        make(["rollout.group_size=eight"])
    assert isinstance(err.value.__cause__, (ValidationError, ConfigKeyError)) or "group_size" in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.group_size=1"], "rollout.group_size to >= 2 or set algorithm.advantage=reinforce_pp"),
    (["algorithm.clip_low=1.5"], "algorithm.clip_low=1.5 must lie in (0, 1)"),
    (["algorithm.clip_high=0"], "algorithm.clip_high=0.0 must lie in (0, 1)"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization=0.0 must lie in (0, 1]"),
    (["rollout.gpu_memory_utilization=1.2"], "rollout.gpu_memory_utilization=1.2 must lie in (0, 1]"),
    (["algorithm.advantage=zscore"], "algorithm.advantage='zscore' is not registered; valid choices:"),
    (["algorithm.aggregation=mean"], "valid choices: seq_mean_token_mean"),
    (["algorithm.kl.estimator=k4"], "algorithm.kl.estimator='k4' is not registered"),
    (["algorithm.dual_clip=0.5"], "algorithm.dual_clip=0.5 must be > 1"),
    (["algorithm.advantage=gae"], "set algorithm.critic.enabled=true"),
    (["+reward.weights.nope=1.0"], "reward.weights.nope='nope' is not registered; valid choices:"),
    (["model=pretrained"], "model=pretrained needs a local model directory: set model.path="),
    (["trainer.total_samples=10"], "trainer.total_samples=10 is smaller than one step's 256 samples"),
])
def test_impossible_values_fail_with_what_to_change(overrides, message):
    cfg = make(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)


def test_bad_values_fail_before_any_model_is_loaded(tmp_path):
    """The CLI stops at validation: no model is built, nothing is cached, the error names the fix."""
    from helpers import run_train

    proc = run_train(["rollout.group_size=1", "logger=none"], tmp_path / "run", tmp_path / "cache", timeout=120)
    assert proc.returncode != 0
    assert "raise rollout.group_size to >= 2" in proc.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("launcher,target", [
    ("joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
    ("slurm", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
])
def test_sweep_launchers_compose(launcher, target):
    """Local parallel sweeps (joblib) and Slurm (submitit, our documented conf/hydra/launcher/slurm.yaml)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == target
    if launcher == "slurm":
        assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.timeout_min == 240


def test_machine_checks_are_separate_from_value_checks():
    """A GPU recipe's values validate anywhere; running it on a machine without CUDA fails at once."""
    import torch

    cfg = make(["learner.device=cuda"])
    validate(cfg, machine=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="learner.device=cuda but this machine has no CUDA device"):
            validate(cfg)


def test_fsdp2_on_cuda_needs_a_gpu_per_rank(monkeypatch):
    """NCCL refuses two ranks of one group on one GPU: 2 torchrun ranks on a machine with 1 GPU fail
    validation, naming NPROC, before any model loads (the machine's GPUs are faked: none here)."""
    import torch
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    cfg = make(["learner.device=cuda", "learner.strategy=fsdp2", "rollout=hf"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"a GPU per torchrun rank: 2 ranks on this machine but 1 GPU\(s\); lower NPROC"):
        validate(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    validate(cfg)


def test_the_smollm2_recipe_composes_validates_and_fits_this_machine():
    """experiment=smollm2_chain_sum (make run-smollm2): chat model, question-form chain_sum, vLLM, LoRA, no
    warm-up; its memory plan fits this machine (validate includes the plan's verdict)."""
    cfg = make(["experiment=smollm2_chain_sum"])
    validate(cfg)
    assert cfg.model.builder == "smollm2_135m" and cfg.task.prompt_format == "question"
    assert cfg.learner.lora.rank > 0 and cfg.warmup.max_steps == 0 and cfg.rollout.engine == "vllm"
