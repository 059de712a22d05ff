"""Choosing a config group replaces that section's choice; it never mixes in the default's."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import register_configs

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
