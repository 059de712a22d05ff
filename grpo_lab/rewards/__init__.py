"""Reward functions: ``(completions, **task fields) -> list[float]``, dispatched through ``REWARDS``.

Public API::

    REWARDS: Registry("reward")  correctness | correctness_binary | math_verify | format
    compute_rewards(completions, items, specs) -> (total, per_reward)
    is_correct(completion, item) -> bool
    extract_answer(completion, fmt) / format_solution(answer, fmt, worked)   (answer formats)
"""

from .answers import ANSWER_FORMATS, extract_answer, format_solution
from .core import REWARDS, compute_rewards, is_correct, reward_fields

__all__ = [
    "ANSWER_FORMATS",
    "REWARDS",
    "compute_rewards",
    "extract_answer",
    "format_solution",
    "is_correct",
    "reward_fields",
]
