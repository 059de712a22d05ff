"""Typed sections built once at the top of a run (grpo_lab.schema.typed_sections), a section's values as a
dict whatever carries it (as_dict), cache keys that do not depend on the carrier, and an objective's needs
stated once (Objective.needs)."""

import dataclasses

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from grpo_lab.cache import cache_key
from grpo_lab.config import finalize, register_configs
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.schema import AlgorithmConfig, Config, LearnerConfig, as_dict, typed_sections
from test_config_groups import CONF


def composed(overrides=()):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def test_every_section_is_a_typed_dataclass_and_labels_outside_the_schema_are_left_out():
    cfg = composed(["+variant=some_row", "rollout.group_size=4", "learner.lora.rank=8"])
    typed = typed_sections(cfg)
    assert isinstance(typed, Config) and not hasattr(typed, "variant")
    assert isinstance(typed.learner, LearnerConfig) and typed.learner.lora.rank == 8
    assert typed.rollout.group_size == 4 and typed.run_name == cfg.run_name
    assert all(dataclasses.is_dataclass(getattr(typed, f.name)) for f in dataclasses.fields(Config)
               if f.name not in ("seed", "run_name", "cache_dir"))


def test_as_dict_and_cache_keys_agree_for_typed_and_omegaconf_sections():
    cfg = composed(["task=gcd"])
    typed = typed_sections(cfg)
    for name in ("model", "task", "warmup", "rollout", "algorithm"):
        assert as_dict(getattr(typed, name)) == OmegaConf.to_container(cfg[name], resolve=True), name
    # The warm-up checkpoint's key: the same with either carrier, so no cache is rebuilt.
    assert cache_key(typed.model, typed.task, typed.warmup, "abc", 0) == cache_key(cfg.model, cfg.task, cfg.warmup,
                                                                                   "abc", 0)
    assert as_dict({"a": 1}) == {"a": 1}


def test_an_objective_states_what_the_learner_needs_once():
    algo = lambda **kw: OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), kw)
    pg = OBJECTIVES.get("policy_gradient")
    plain = pg.needs(algo())
    assert (plain.reference, plain.critic, plain.views, plain.entropy, plain.entropy_grad) == (False, False, None, True,
                                                                                              False)
    assert pg.needs(algo(entropy_coef=0.01)).entropy_grad and pg.needs(algo(kl={"coef": 0.04})).reference
    assert pg.needs(algo(critic={"enabled": True})).critic
    pref = OBJECTIVES.get("preference").needs(algo(objective="preference"))
    assert pref.views == ("chosen", "rejected") and pref.reference and not pref.entropy
