"""Choosing a config group replaces that section's choice; it never mixes in the default's. Every recipe
in conf/experiment passes the config checks (those that do not depend on this machine's devices)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


@pytest.mark.parametrize("group, weights", [
    ("correctness", {"correctness_binary": 1.0}),
    ("scorer", {"correctness": 1.0}),
    ("math_verify", {"math_verify": 1.0, "format": 0.1}),
    ("instruct", {"correctness_binary": 1.0, "format": 0.1}),
    ("llm_judge", {"llm_judge": 1.0}),
])
def test_a_reward_group_sets_exactly_its_own_weights(group, weights):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        assert dict(compose("config", overrides=[f"reward={group}"]).reward.weights) == weights
        assert dict(compose("config").reward.weights) == {"correctness_binary": 1.0}   # the default group


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_recipe_passes_the_config_checks(recipe):
    """The GPU recipes cannot run here, but what they say must hold together: a recipe that switched to a
    pretrained model while keeping the tiny model's sizes failed only when it built the model, on the GPU."""
    validate(_compose([f"experiment={recipe}"]), machine=False)


@pytest.mark.parametrize("overrides, message", [
    (["model.builder=pretrained", "model.path=/models/x"],
     "model.builder=pretrained does not take model.hidden_size, model.num_layers"),
    (["interaction=critic", "interaction.critic.model.builder=smollm2_135m"],
     "interaction.critic.model.builder=smollm2_135m does not take interaction.critic.model.hidden_size"),
])
def test_model_settings_another_builder_takes_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(_compose(overrides), machine=False)
    assert message in str(err.value) and "=null" in str(err.value)
    validate(_compose(["model=pretrained", "model.path=/models/x"]), machine=False)   # the group's own section
