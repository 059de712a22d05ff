"""Multi-turn rollouts: the actor answers, an environment replies (feedback, or done), the actor revises.

Public API::

    ENVIRONMENTS: Registry("environment")   verifier_feedback (or a plug-in class "package.module:Class")
        facts: learns (trains during the run: its state_dict goes into checkpoints), alphabet (characters
        its messages use, added to the tiny character model's vocabulary when an interaction is on)
    Environment, EnvReply, StepRecord        the contract (grpo_lab/interaction/base.py)
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
ENVIRONMENTS = Registry("environment", defaults={"learns": False, "alphabet": "", "needs_reference": False})

from grpo_lab.interaction import verifier as _verifier  # noqa: E402,F401  (registers verifier_feedback)
from grpo_lab.interaction.base import Environment, EnvReply, StepRecord  # noqa: E402
from grpo_lab.interaction.rewards import TURN_REWARDS, score_turns, step_record, turn_metrics  # noqa: E402
from grpo_lab.interaction.rollout import multi_turn_rollout  # noqa: E402


def build_environment(cfg: Any, *, tokenizer: Any, task: Any) -> Environment | None:
    """The run's environment, constructed once as `cls(cfg, tokenizer=..., task=...)`; None when
    interaction.environment is null (single-turn)."""
    name = cfg.interaction.environment
    return None if name is None else ENVIRONMENTS.get(name)(cfg, tokenizer=tokenizer, task=task)


def reference_problem(interaction_cfg: Any, task: Any) -> str | None:
    """What is wrong with `task` for the configured environment (None: nothing): an environment that
    compares answers with references (`needs_reference`) cannot serve items without one."""
    name = interaction_cfg.get("environment") if hasattr(interaction_cfg, "get") else None
    if name is None or not ENVIRONMENTS.fact(name, "needs_reference"):
        return None
    missing = sum(not str(it.answer).strip() for items in task.splits.values() for it in items)
    if not missing:
        return None
    return (f"interaction.environment={name} compares every answer with the item's reference answer, but "
            f"{missing} items of task {task.name!r} have none: point task.answer_field at the field holding the "
            "answers, or choose an environment that needs no reference (or interaction=none)")


def message_alphabet(interaction_cfg: Any) -> str:
    """Characters a character-level tokenizer needs for the environment's messages and their raw format
    (grpo_lab.prompts.RAW_MESSAGE_OPEN/CLOSE); "" without an environment, so a single-turn run's model
    and warm-up caches are untouched."""
    from grpo_lab.prompts import RAW_MESSAGE_CLOSE, RAW_MESSAGE_OPEN

    name = interaction_cfg.get("environment") if hasattr(interaction_cfg, "get") else None
    if name is None:
        return ""
    cls = ENVIRONMENTS.get(name)
    own = ENVIRONMENTS.fact(name, "alphabet") or getattr(cls, "alphabet", "")
    return "".join(sorted(set(RAW_MESSAGE_OPEN + RAW_MESSAGE_CLOSE + own)))


__all__ = ["ENVIRONMENTS", "EnvReply", "Environment", "StepRecord", "TURN_REWARDS", "build_environment",
           "message_alphabet", "multi_turn_rollout", "reference_problem", "score_turns", "step_record", "turn_metrics"]
