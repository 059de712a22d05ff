"""Which settings a composed run reads, so a setting that nothing reads is refused instead of ignored.

`reward.noise.flip_prob=0.2` without `reward.noise.kind=flip` used to run clean: no noise, no metric, no
warning, and a sweep over flip rates gave identical runs that read as "noise does not hurt". The rule
here: a setting that differs from its schema default but that nothing in the composed run reads is an
error naming the key and what would read it. Which parts read a setting is learnt from the parts the
config selects, never from lists of names kept here:

* **settings by signature**: a registry entry reads the fields of its config section that its function's
  signature names, exactly what `Registry.call` passes it (``reward.noise.*`` by the noise kind,
  ``algorithm.preference.*`` by the preference loss and pairing, ``algorithm.adv_eps/gamma/lam`` by the
  advantage estimator, ``algorithm.clip_*/dual_clip`` by the policy loss, ``interaction.improvement_coef``
  by the turn reward, ``reward.judge`` by the reward functions of ``reward.weights``);
* **facts on entries**: the objective's ``only_reads`` (the ``algorithm.*`` settings only it reads), an
  environment's ``reads`` (its own ``interaction.*`` section), a rollout engine's ``reads`` (the
  ``rollout.*`` settings only it reads), a learning-rate schedule's ``decays`` (it reads total_steps);
* **switches**: a setting that acts only when another one turns its feature on (``_SWITCHED``).

Every other leaf of the schema is in ``ALWAYS_READ`` (with why), and tests/test_config_reads.py fails
for a new schema key that is in neither, naming it. `grpo_lab.run_guard` asks the same question for a
resume: a key that neither side reads may change.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

from omegaconf import OmegaConf

from grpo_lab.schema import Config, RewardModelConfig, RewardModelRewardConfig

# Settings every run reads (dotted prefixes; a section's name covers its keys). Small on purpose: a key
# read only under some choice belongs to a rule below, not here.
ALWAYS_READ: dict[str, str] = {
    "seed": "seeds everything", "run_name": "names the run directory", "cache_dir": "models and warm-ups",
    "model": "the policy (model.builder refuses sizes its builder does not take)",
    "task": "the task source (its own check refuses settings it does not take)",
    "warmup": "the SFT warm-up (warmup.max_steps=0 is checked against the settings that need it)",
    "trainer": "the loop", "logger": "where metrics go",
    "reward.weights": "the reward", "reward.timeout_s": "reward containment", "reward.on_error": "reward containment",
    "reward.max_error_frac": "reward containment", "reward.max_consecutive_timeouts": "reward containment",
    "reward.isolation": "reward containment", "reward.noise.kind": "selects the noise",
    # The engine-specific vLLM settings are not refused under rollout=hf: experiments written for vLLM keep
    # them when a table switches its rows to rollout=hf (gpu_memory_utilization, sync_*, ...).
    "rollout": "the engine (rollout.sampler: see the engines' `reads` fact)",
    "learner": "the optimizer and its device (lora.* and total_steps: see the rules below)",
    "algorithm.name": "the run name", "algorithm.objective": "selects the objective",
    "algorithm.kl.track": "whether the learner holds the reference (and logs KL from it)",
    "algorithm.epochs": "the learner's updates", "algorithm.minibatches": "the learner's updates",
    "algorithm.dynamic_sampling.enabled": "the sampler (every objective)",
    # Unread while dynamic sampling is off, but harmless: a cap that the tables' smoke runs raise for every
    # row (one base override for all rows, dapo's or not).
    "algorithm.dynamic_sampling.max_rounds": "the sampler's cap (see above)",
    "algorithm.overlong.soft_buffer": "the sampler's reward (every objective)",
    "interaction.environment": "selects the environment", "interaction.max_turns": "checked with the environment",
    "interaction.reward": "selects the turn reward",
    "interaction.warmup_revision_frac": "checked by _check_interaction",
    "interaction.warmup_demos_from": "checked by _check_interaction",
}


@dataclasses.dataclass(frozen=True)
class Switch:
    on: Callable[[Any], bool]   # cfg (a plain nested dict, schema defaults filled) -> the feature is on
    hint: str                   # what turns it on, as the message's "set ..."


def _at(cfg: dict, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# Settings read only while another setting turns their feature on.
_SWITCHED: dict[str, Switch] = {
    "algorithm.overlong.soft_penalty": Switch(lambda c: _at(c, "algorithm.overlong.soft_buffer") > 0,
                                              "algorithm.overlong.soft_buffer > 0"),
    "algorithm.preference.pool_prompts": Switch(lambda c: _at(c, "algorithm.preference.pairs") == "start_policy",
                                                "algorithm.preference.pairs=start_policy"),
    "algorithm.kl.estimator": Switch(lambda c: _at(c, "algorithm.kl.coef") > 0, "algorithm.kl.coef > 0"),
    "algorithm.kl.placement": Switch(lambda c: _at(c, "algorithm.kl.coef") > 0, "algorithm.kl.coef > 0"),
    "algorithm.sft_anchor_warmup": Switch(lambda c: _at(c, "algorithm.sft_anchor_coef") > 0,
                                          "algorithm.sft_anchor_coef > 0"),
    **{f"algorithm.critic.{k}": Switch(lambda c: _at(c, "algorithm.critic.enabled"), "algorithm.critic.enabled=true")
       for k in ("lr", "value_clip", "coef", "model_path")},
    **{f"algorithm.rollout_correction.{k}": Switch(lambda c: _at(c, "algorithm.rollout_correction.level") is not None,
                                                   "algorithm.rollout_correction.level=token|sequence|geometric")
       for k in ("mode", "upper", "lower")},
    **{f"learner.lora.{k}": Switch(lambda c: _at(c, "learner.lora.rank") > 0, "learner.lora.rank > 0")
       for k in ("alpha", "dropout", "target_modules")},
}


def schema_leaves(cls: type = Config, prefix: str = "") -> list[str]:
    """Dotted key of every leaf of the schema (a dict- or Any-typed field is one leaf)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += schema_leaves(t, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


# The learned reward model's trunk, data and training: read by a run optimising against it (and by
# `python -m grpo_lab.train_reward_model`, whose validate says so with also_reads).
# Its scoring settings likewise (the reward_model reward is registered above this module, by grpo_lab.second_models,
# so its signature cannot be relied on here).
_SWITCHED.update({key: Switch(lambda c: "reward_model" in (_at(c, "reward.weights") or {}), "reward=reward_model")
                  for key in schema_leaves(RewardModelConfig, "reward_model.")
                  + schema_leaves(RewardModelRewardConfig, "reward.reward_model.")})


def _names(fn: Callable) -> set[str]:
    """Keyword names `fn`'s signature names explicitly (what Registry.call would pass it by name)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _entries(registry, names: Iterable[str]) -> list[tuple[str, Callable]]:
    out = []
    for name in names:
        try:
            out.append((name, registry.get(name)))
        except Exception:   # unregistered: refused by its own check; nothing to say here
            continue
    return out


@dataclasses.dataclass(frozen=True)
class BySignature:
    """The fields of `section` that some entry of `registry` names in its signature are read only when a
    selected entry names them; `selected(cfg)` -> the selected entries' names, or None when unknown."""

    section: str
    registry: Any
    selector: str                                   # the config key that selects, for the message
    selected: Callable[[dict], list[str] | None]

    def fields(self) -> dict[str, list[str]]:
        """Field of the section -> the registered entries whose signature names it."""
        fields = _at(_DEFAULTS, self.section)
        out: dict[str, list[str]] = {}
        for name, fn in _entries(self.registry, self.registry.names()):
            for field in _names(fn) & set(fields):
                out.setdefault(field, []).append(name)
        return out

    def key(self, field: str) -> str:
        return f"{self.section}.{field}"

    def unread(self, cfg: dict) -> dict[str, str]:
        selected = self.selected(cfg)
        if selected is None or len(_entries(self.registry, selected)) < len(selected):
            return {}
        reading = set().union(*(_names(fn) for _, fn in _entries(self.registry, selected)))
        return {self.key(f): " or ".join(f"{self.selector}={n}" for n in names)
                for f, names in self.fields().items() if f not in reading}


def _signature_rules() -> list[BySignature]:
    from grpo_lab.algos import ADVANTAGE_ESTIMATORS, PAIRINGS, POLICY_LOSSES, PREFERENCE_LOSSES
    from grpo_lab.interaction import TURN_REWARDS
    from grpo_lab.rewards import REWARDS
    from grpo_lab.rewards.noise import REWARD_NOISE

    return [
        BySignature("reward.noise", REWARD_NOISE, "reward.noise.kind", lambda c: [_at(c, "reward.noise.kind")]),
        BySignature("algorithm.preference", PREFERENCE_LOSSES, "algorithm.preference.loss",
                    lambda c: [_at(c, "algorithm.preference.loss")]),
        BySignature("algorithm.preference", PAIRINGS, "algorithm.preference.pairing",
                    lambda c: [_at(c, "algorithm.preference.pairing")]),
        BySignature("algorithm", ADVANTAGE_ESTIMATORS, "algorithm.advantage", lambda c: [_at(c, "algorithm.advantage")]),
        BySignature("algorithm", POLICY_LOSSES, "algorithm.policy_loss", lambda c: [_at(c, "algorithm.policy_loss")]),
        BySignature("interaction", TURN_REWARDS, "interaction.reward", lambda c: [_at(c, "interaction.reward")]),
        # reward functions read the `judge` section when their signature names it (llm_judge)
        BySignature("reward", REWARDS, "reward.weights having", lambda c: list(_at(c, "reward.weights") or {})),
    ]


def _fact_rules() -> list[tuple[str, Any, Callable[[dict], list[str]], str]]:
    """(section, registry, selected entries, selector) for registries whose entries carry the fact of the
    settings of `section` only they read: an objective's `only_reads`, an environment's and an engine's
    `reads`."""
    from grpo_lab.interaction import ENVIRONMENTS
    from grpo_lab.rollout import ROLLOUT_ENGINES

    def environments(c):
        i = c["interaction"]
        demos = list(i["warmup_demos_from"] or []) if i["warmup_revision_frac"] else []
        return [e for e in (i["environment"], *demos) if e is not None]

    return [("interaction", ENVIRONMENTS, environments, "interaction.environment"),
            ("rollout", ROLLOUT_ENGINES, lambda c: [c["rollout"]["engine"]], "rollout.engine")]


def _fact_unread(cfg: dict) -> dict[str, str]:
    from grpo_lab.objectives import OBJECTIVES

    out: dict[str, str] = {}
    # The objective's own algorithm.* settings (a prefix covers a section).
    objective = cfg["algorithm"]["objective"]
    if objective in OBJECTIVES:
        owners = {p: n for n in OBJECTIVES.names() for p in OBJECTIVES.get(n).only_reads}
        mine = OBJECTIVES.get(objective).only_reads
        for key in _LEAVES:
            owner = next((p for p in owners if _under(key, p)), None)
            # A key every run reads (algorithm.kl.track: the learner's reference) stays read inside a section
            # the objective otherwise owns.
            if owner and not any(_under(key, p) for p in mine) and not any(_under(key, p) for p in ALWAYS_READ):
                out[key] = f"algorithm.objective={owners[owner]}"
    for section, registry, selected, selector in _fact_rules():
        names = selected(cfg)
        if any(n not in registry for n in names):
            continue
        owners = {f"{section}.{k}": n for n in registry.names() for k in registry.fact(n, "reads")}
        mine = {f"{section}.{k}" for n in names for k in registry.fact(n, "reads")}
        for key in _LEAVES:
            for owner, name in owners.items():
                if _under(key, owner) and not any(_under(key, m) for m in mine):
                    out.setdefault(key, f"{selector}={name}")
    # A decaying learning-rate schedule reads total_steps (its length); a constant one does not.
    from grpo_lab.learner.schedules import LR_SCHEDULES

    schedule = cfg["learner"]["lr_schedule"]
    if schedule in LR_SCHEDULES and not LR_SCHEDULES.fact(schedule, "decays"):
        out["learner.total_steps"] = " or ".join(f"learner.lr_schedule={n}" for n in LR_SCHEDULES.names()
                                                 if LR_SCHEDULES.fact(n, "decays"))
    return out


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


_DEFAULTS: dict = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
_LEAVES = schema_leaves()


def covered_keys() -> dict[str, str]:
    """Every schema leaf some rule classifies -> which rule (for the test that no key slips through)."""
    from grpo_lab.interaction import ENVIRONMENTS
    from grpo_lab.learner.schedules import LR_SCHEDULES
    from grpo_lab.objectives import OBJECTIVES
    from grpo_lab.rollout import ROLLOUT_ENGINES

    out: dict[str, str] = {}
    for key in _LEAVES:
        if any(_under(key, p) for p in ALWAYS_READ):
            out[key] = "always read"
        if key in _SWITCHED:
            out[key] = f"switched by {_SWITCHED[key].hint}"
        if key == "learner.total_steps" and any(LR_SCHEDULES.fact(n, "decays") for n in LR_SCHEDULES.names()):
            out[key] = "read by a decaying learner.lr_schedule"
    for rule in _signature_rules():
        for field in rule.fields():
            for key in _LEAVES:
                if _under(key, rule.key(field)):
                    out[key] = f"read by {rule.selector} entries naming {field}"
    for n in OBJECTIVES.names():
        for p in OBJECTIVES.get(n).only_reads:
            out.update({k: f"read by algorithm.objective={n}" for k in _LEAVES if _under(k, p)})
    for section, registry in (("interaction", ENVIRONMENTS), ("rollout", ROLLOUT_ENGINES)):
        for n in registry.names():
            for r in registry.fact(n, "reads"):
                out.update({k: f"read by {section} entry {n}" for k in _LEAVES if _under(k, f"{section}.{r}")})
    return out


def _plain(cfg: Any) -> dict:
    """A run's config (DictConfig or a recorded dict, possibly older than the schema) as a plain nested dict
    with the schema's defaults filled in and interpolations resolved. The defaults are laid under the run's
    values as plain dicts (OmegaConf.structured(Config) per call cost ~0.2 s, a table's preflight validates
    hundreds of jobs)."""
    given = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    merged = _overlay(copy.deepcopy(_DEFAULTS), {k: v for k, v in given.items() if k in _DEFAULTS})
    return OmegaConf.to_container(OmegaConf.create(merged), resolve=True)


def _overlay(base: dict, top: dict) -> dict:
    """`top`'s values over `base`, section by section (as OmegaConf.merge: a dict meets a dict key by key)."""
    for k, v in top.items():
        base[k] = _overlay(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def _default_in(cfg: dict, key: str) -> Any:
    """The schema's default of `key` in this run: an interpolated default (learner.total_steps =
    ${trainer.total_steps}) resolved against the run's own values."""
    raw = _at(_DEFAULTS, key)
    if isinstance(raw, str) and "${" in raw:
        ref = re.fullmatch(r"\$\{([\w.]+)\}", raw)
        if ref:                                 # a plain reference (the usual case): no config to build
            return _at(cfg, ref.group(1))
        return OmegaConf.create({**cfg, "__default__": raw})["__default__"]
    return raw


def unread_keys(cfg: Any) -> dict[str, str]:
    """Dotted key -> what would read it, for every schema leaf the composed run `cfg` does not read
    (whatever its value)."""
    return _unread_in(_plain(cfg))


def _unread_in(c: dict) -> dict[str, str]:
    """unread_keys of the plain, filled config `c` (_plain's)."""
    out: dict[str, str] = {}
    out.update(_fact_unread(c))    # the objective's and the environments' sections first: the outer reason
    for key, switch in _SWITCHED.items():
        try:
            if not switch.on(c):
                out.setdefault(key, switch.hint)
        except (KeyError, TypeError):
            continue
    for rule in _signature_rules():
        for key, readers in rule.unread(c).items():
            for leaf in _LEAVES:
                if _under(leaf, key):
                    out.setdefault(leaf, readers)
    return out


def unread_errors(cfg: Any, also_reads: Iterable[str] = ()) -> list[str]:
    """A message for every setting that differs from its default but that nothing in the run reads;
    `also_reads`: prefixes an entry point other than a run reads itself (the reward-model trainer's)."""
    c = _plain(cfg)
    errors = []
    for key, readers in sorted(_unread_in(c).items()):
        if any(_under(key, p) for p in also_reads):
            continue
        value, default = _at(c, key), _default_in(c, key)
        if value == default:
            continue
        raw = _at(_DEFAULTS, key)
        leave = (f"leave it unset (default: {raw[2:-1]})" if isinstance(raw, str) and raw.startswith("${")
                 else f"leave {key.rpartition('.')[2]} at its default {default!r}")
        errors.append(f"{key}={value!r} is read only with {readers}, so this run would ignore it; set {readers} "
                      f"or {leave}")
    return errors


__all__ = ["ALWAYS_READ", "covered_keys", "schema_leaves", "unread_errors", "unread_keys"]
