"""Reward functions: ``(completions, **task fields) -> list[float]``, dispatched through ``REWARDS``.

Public API::

    REWARDS: Registry("reward")  correctness | correctness_binary | math_verify | format | llm_judge
             | reward_model (registered by grpo_lab.second_models, where the models live)
             (or a plug-in "package.module:function", imported on first use by the registry)
    compute_rewards(completions, items, specs, *, timeout_s, on_error, max_error_frac, settings, isolation,
                    max_consecutive_timeouts, resolved)
        -> RewardResult: unpacks as (total, per_reward); .metrics counts failures; .info holds
           per-sample extras (e.g. "llm_judge/feedback"), .sample_info(i) one sample's
    RewardValues(values, info={key: per-sample list}): what a reward may return to add such extras
    RewardScorer(reward_cfg, specs=None)(completions, items) -> RewardResult   (a run's rewards, resolved once)
    is_correct(completion, item) -> bool
    stop_reward_worker()   ends the worker process that runs rewards which may hang (reward.isolation)
    extract_answer(completion, fmt) / format_solution(answer, fmt, worked)   (answer formats)
"""

from . import llm_judge as _llm_judge  # noqa: F401  (registers "llm_judge"; imports no model until called)
from .answers import ANSWER_FORMATS, answer_marked, extract_answer, format_solution
from .core import (REWARDS, RewardError, RewardResult, RewardScorer, RewardTimeout, RewardValues, compute_rewards,
                   contained_settings, is_correct, reward_fields)
from .isolation import RewardWorkerStopped, stop_reward_worker

__all__ = [
    "ANSWER_FORMATS",
    "REWARDS",
    "RewardError",
    "RewardResult",
    "RewardScorer",
    "RewardTimeout",
    "RewardValues",
    "RewardWorkerStopped",
    "answer_marked",
    "compute_rewards",
    "contained_settings",
    "extract_answer",
    "format_solution",
    "is_correct",
    "reward_fields",
    "stop_reward_worker",
]
