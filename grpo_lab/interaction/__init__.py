"""Multi-turn rollouts: the actor answers, an environment replies (feedback, or done), the actor revises.

Public API::

    ENVIRONMENTS: Registry("environment")   verifier_feedback, python_tool (or a plug-in class "package.module:Class")
        facts: learns (trains during the run: its state_dict goes into checkpoints), alphabet (characters
        its messages use, added to the tiny character model's vocabulary when an interaction is on)
    Environment, EnvReply, StepRecord        the contract (grpo_lab/interaction/base.py)
    TOOLS: Registry("tool")                  python (the sandboxed interpreter of python_tool,
                                             grpo_lab/interaction/sandbox.py), or a plug-in factory
    build_environment(cfg, *, tokenizer, task) -> Environment | None
    message_alphabet(interaction_cfg) -> str     "" without an environment
    multi_turn_rollout(engine, tokenizer, items, env, *, group_size, max_turns, rollout_cfg, seed) -> Rollout
    TURN_REWARDS / score_turns(rollout, seq_items, reward_cfg, interaction_cfg)   rewards of conversations
    step_record(scored) -> StepRecord;  turn_metrics(scored) -> interaction/ metrics

Environment tokens never train the actor: the rollout marks them (Rollout.loss_masks) and the learner's
collate multiplies them out of response_mask.
"""

from __future__ import annotations

from typing import Any

from grpo_lab.registry import Registry

# Facts: `learns` (trains during the run; its state_dict holds weights and optimizer state), `alphabet`
# (characters its messages use), `needs_reference` (it compares answers with each item's reference
# answer, so every item must have one).
# `reads`: the interaction.* sub-sections this environment reads (interaction=critic: ("critic",)); set
# under another environment they are refused (grpo_lab/config_reads.py).
ENVIRONMENTS = Registry("environment", defaults={"learns": False, "alphabet": "", "needs_reference": False,
                                                 "reads": ()})

from grpo_lab.interaction import verifier as _verifier  # noqa: E402,F401  (registers verifier_feedback)
from grpo_lab.interaction import tool_env as _tool_env  # noqa: E402,F401  (registers python_tool)
from grpo_lab.interaction.tool_env import TOOLS  # noqa: E402
from grpo_lab.interaction.base import Environment, EnvReply, StepRecord  # noqa: E402
from grpo_lab.interaction.rewards import TURN_REWARDS, score_turns, step_record, turn_metrics  # noqa: E402
from grpo_lab.interaction.rollout import multi_turn_rollout  # noqa: E402


def build_environment(cfg: Any, *, tokenizer: Any, task: Any) -> Environment | None:
    """The run's environment, constructed once as `cls(cfg, tokenizer=..., task=...)`; None when
    interaction.environment is null (single-turn)."""
    name = cfg.interaction.environment
    return None if name is None else ENVIRONMENTS.get(name)(cfg, tokenizer=tokenizer, task=task)


def reference_problem(interaction_cfg: Any, task: Any) -> str | None:
    """What is wrong with `task` for the configured environment or the environments its warm-up
    demonstrations are written in (None: nothing): an environment that compares answers with references
    (`needs_reference`) cannot serve items without one."""
    own = interaction_cfg.environment
    named = [n for n in environments_named(interaction_cfg) if ENVIRONMENTS.fact(n, "needs_reference")]
    if not named:
        return None
    name = named[0]
    missing = sum(not str(it.answer).strip() for items in task.splits.values() for it in items)
    if not missing:
        return None
    where = f"interaction.environment={name}" if name == own else f"interaction.warmup_demos_from names {name}, which"
    return (f"{where} compares every answer with the item's reference answer, but "
            f"{missing} items of task {task.name!r} have none: point task.answer_field at the field holding the "
            "answers, or choose an environment that needs no reference (or interaction=none)")


def demo_environments(interaction_cfg: Any) -> list[str]:
    """Environments whose messages the warm-up's revision demonstrations are written in:
    interaction.warmup_demos_from when set, else the run's own environment (none when single-turn)."""
    named, own = interaction_cfg.warmup_demos_from, interaction_cfg.environment
    if named:
        return [str(n) for n in named]
    return [] if own is None else [str(own)]


def environments_named(interaction_cfg: Any) -> list[str]:
    """The run's environment (if any), then those its warm-up demonstrations are written in, each once."""
    own = interaction_cfg.environment
    return list(dict.fromkeys([*([str(own)] if own is not None else []), *demo_environments(interaction_cfg)]))


def message_alphabet(interaction_cfg: Any) -> str:
    """Characters a character-level tokenizer needs for the environment's messages, those of the
    environments its warm-up demonstrations are written in, and their raw format
    (grpo_lab.prompts.RAW_MESSAGE_OPEN/CLOSE); "" when there are none, so a single-turn run's model and
    warm-up caches are untouched."""
    from grpo_lab.prompts import RAW_MESSAGE_CLOSE, RAW_MESSAGE_OPEN

    names = environments_named(interaction_cfg)
    if not names:
        return ""
    chars = "".join(ENVIRONMENTS.fact(n, "alphabet") or getattr(ENVIRONMENTS.get(n), "alphabet", "") for n in names)
    return "".join(sorted(set(RAW_MESSAGE_OPEN + RAW_MESSAGE_CLOSE + chars)))


__all__ = ["ENVIRONMENTS", "EnvReply", "Environment", "StepRecord", "TOOLS", "TURN_REWARDS", "build_environment",
           "demo_environments", "message_alphabet", "multi_turn_rollout", "reference_problem", "score_turns", "step_record", "turn_metrics"]
