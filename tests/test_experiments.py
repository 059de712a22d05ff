"""The experiments in conf/experiment are short deltas over the config groups (model, task, rollout, learner),
and a run launched over several processes refuses a learner.num_devices that is not torchrun's world size
(the memory plan shards over learner.num_devices; the processes are what the learner shards over)."""

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError

register_configs()
CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GPU_EXPERIMENTS = [e for e in EXPERIMENTS if e.startswith("gpu_")]
# Settings the groups hold (conf/model, conf/task, conf/rollout/vllm_gpu.yaml, conf/learner/fsdp_bf16.yaml):
# a GPU experiment chooses them in its defaults list instead of copying them.
GROUP_KEYS = {"model": None, "task": None, "rollout": {"enforce_eager", "dtype"},
              "learner": {"device", "dtype", "gradient_checkpointing", "logits_chunk_tokens"}}


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def settings_lines(name: str) -> int:
    """Lines of conf/experiment/<name>.yaml that set something (not comments, not blank)."""
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_is_a_short_delta(name):
    """The GPU recipes once copied their model, data, engine and learner settings (40-48 lines each, 30-38
    of them shared); now those live in groups and each recipe holds only what is its own."""
    bound = 30 if name in GPU_EXPERIMENTS else 35
    assert settings_lines(name) <= bound, f"conf/experiment/{name}.yaml sets {settings_lines(name)} lines " \
        f"(at most {bound}): move settings it shares with other recipes into a conf/<group> file"
    if name not in GPU_EXPERIMENTS:
        return
    body = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    for section, keys in GROUP_KEYS.items():
        copied = set(body.get(section) or {}) if keys is None else keys & set(body.get(section) or {})
        assert not copied, f"{name}.yaml sets {section}.{sorted(copied)}: choose a conf/{section} file instead"


def test_the_groups_from_the_shell_are_the_recipe():
    """`model=... task=... rollout=vllm_gpu learner=fsdp_bf16` plus the recipe's own values is the recipe:
    the groups are usable without an experiment file, and the experiment is exactly the delta."""
    from_groups = make(["model=qwen2_5_math_7b", "task=math_l3to5", "rollout=vllm_gpu", "learner=fsdp_bf16",
                        "algorithm=grpo", "reward=math_verify", "learner.lr=1e-6", "learner.num_devices=4",
                        "warmup.max_steps=0", "trainer.prompts_per_step=128", "trainer.total_steps=400",
                        "trainer.eval_every=25", "logger.project=grpo_lab_std_norm"])
    validate(from_groups, machine=False)
    assert from_groups == make(["experiment=gpu_std_norm"])


def test_a_task_from_the_shell_replaces_the_recipes_task():
    """The tasks table's full-scale sweep (`experiment=gpu_tasks task=gcd`) runs the swept task; with the
    data written inline in the recipe, the recipe's MATH data overrode every swept task."""
    cfg = make(["experiment=gpu_tasks", "task=gcd"])
    assert (cfg.task.source, cfg.task.name, cfg.task.path) == ("reasoning_gym", "gcd", None)
    assert make(["experiment=gpu_tasks"]).task.name == "math_l3to5"


def tiny(num_devices: int, *extra: str):
    return make(["rollout=hf", f"learner.num_devices={num_devices}", *extra])


def test_num_devices_other_than_torchruns_world_size_is_refused_naming_both(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as err:
        validate(tiny(8))
    assert ("learner.num_devices=8 but torchrun started 4 processes (WORLD_SIZE=4): launch with NPROC=8 "
            "(torchrun --nproc_per_node 8") in str(err.value) and "or set learner.num_devices=4" in str(err.value)
    validate(tiny(4))                                   # agreement passes
    # The GPU recipe as its old launch line started it: 4 processes for a recipe planned over 8 GPUs.
    with pytest.raises(ConfigError, match=r"learner.num_devices=8 but torchrun started 4 processes"):
        validate(make(["experiment=gpu_algorithms"]))
    validate(make(["experiment=gpu_algorithms"]), machine=False)   # composed off the machine: not checked


def test_fsdp2_without_torchrun_counts_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"learner.num_devices=2 but this is one process \(WORLD_SIZE unset"):
        validate(tiny(2, "learner.strategy=fsdp2"))
    validate(tiny(1, "learner.strategy=fsdp2"))
    validate(tiny(2))           # one process, strategy single: not a torchrun launch, not checked
    monkeypatch.setenv("WORLD_SIZE", "1")
    validate(tiny(1, "learner.strategy=fsdp2"))
