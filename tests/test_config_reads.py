"""A setting that differs from its default but that nothing in the composed run reads is refused before
anything loads, naming the key and what would read it (grpo_lab/config_reads.py); every leaf of the schema
is classified, so a new key cannot slip through. That every committed recipe and table job still
validates is tests/test_config_groups.py's, test_recipes.py's and test_tables.py's."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import grpo_lab.second_models  # noqa: F401  (registers interaction=critic and its `reads` fact)
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.config_reads import covered_keys, schema_leaves, unread_errors
from grpo_lab.schema import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=["rollout=hf", "logger=none", *overrides]))


def test_every_schema_key_is_read_always_or_by_a_rule():
    """A new schema key with no reader classification fails here, by name: put it in ALWAYS_READ (with why)
    or give the part that reads it the fact (an entry's signature, `only_reads`, `reads`, a switch)."""
    covered = covered_keys()
    missing = [k for k in schema_leaves() if k not in covered]
    assert not missing, f"schema keys no rule of grpo_lab/config_reads.py classifies: {missing}"


@pytest.mark.parametrize("overrides, message", [
    (["reward.noise.flip_prob=0.2"],
     "reward.noise.flip_prob=0.2 is read only with reward.noise.kind=flip, so this run would ignore it; set "
     "reward.noise.kind=flip or leave flip_prob at its default 0.0"),
    (["algorithm=ipo", "algorithm.preference.label_smoothing=0.1"],
     "algorithm.preference.label_smoothing=0.1 is read only with algorithm.preference.loss=dpo or "
     "algorithm.preference.loss=rdpo"),
    (["algorithm=grpo", "algorithm.preference.label_flip_prob=0.1"],
     "algorithm.preference.label_flip_prob=0.1 is read only with algorithm.objective=preference"),
    (["algorithm=dpo", "algorithm.clip_high=0.28"], "algorithm.clip_high=0.28 is read only with "
     "algorithm.objective=policy_gradient"),
    (["algorithm=grpo", "algorithm.critic.lr=0.01"], "set algorithm.critic.enabled=true"),
    (["algorithm=grpo", "algorithm.lam=0.9"], "algorithm.lam=0.9 is read only with algorithm.advantage=gae"),
    (["interaction.improvement_coef=2"], "set interaction.reward=improvement"),
    (["interaction.critic.update_every=2"], "set interaction.environment=critic"),
    (["reward.judge.builder=pretrained"], "set reward.weights having=llm_judge"),
    (["rollout=vllm", "rollout.sampler=shared_prefill"], "set rollout.engine=hf"),
    (["learner.lora.alpha=32"], "set learner.lora.rank > 0 or leave alpha at its default 16.0"),
    (["learner.total_steps=50"], "learner.total_steps=50 is read only with learner.lr_schedule=cosine or "
     "learner.lr_schedule=linear, so this run would ignore it; set learner.lr_schedule=cosine or "
     "learner.lr_schedule=linear or leave it unset (default: trainer.total_steps)"),
])
def test_a_setting_nothing_reads_is_refused_naming_the_key_and_its_reader(overrides, message):
    cfg = _compose(overrides)
    assert any(message in e for e in unread_errors(cfg)), unread_errors(cfg)
    with pytest.raises(ConfigError, match="so this run would ignore it"):
        validate(cfg, machine=False)


@pytest.mark.parametrize("overrides", [
    ["reward.noise.kind=flip", "reward.noise.flip_prob=0.2"],
    ["algorithm=dpo", "algorithm.preference.label_smoothing=0.1", "algorithm.preference.label_flip_prob=0.1"],
    ["algorithm=dpo", "algorithm.preference.loss=rdpo", "algorithm.preference.label_smoothing=0.1"],
    ["algorithm=ppo"], ["algorithm=dapo"], ["algorithm=group_dpo"],
    ["learner.lr_schedule=cosine", "learner.total_steps=50"],
    ["trainer.total_steps=20"],          # learner.total_steps follows it: its default in this run, not 150
    ["reward.noise.kind=flip", "reward.noise.flip_prob=0.0"],    # at the default: nothing to refuse
])
def test_settings_that_are_read_pass(overrides):
    assert unread_errors(_compose(overrides)) == []
