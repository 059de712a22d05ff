"""Validation of the I/O-side config sections (``reward``, ``rollout``, ``task``), run by
``grpo_lab.config.validate`` before any model or engine loads.

``validate_rollout_reward_task(cfg, errors, machine)`` appends one message per problem; each names the key
and says what to change. Plug-ins named by import path (``reward.weights``, ``task.source``) are
imported here, so an unimportable path fails in a second rather than after the warm-up.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lab.prompts import check_chat_template
from grpo_lab.registry import check_registered
from grpo_lab.rewards import REWARDS
from grpo_lab.rewards.answers import ANSWER_FORMATS
from grpo_lab.rewards.noise import REWARD_NOISE
from grpo_lab.tasks import TASKS


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _timeout(value: Any, key: str, errors: list[str], example: str) -> None:
    if value is None:
        return
    if not _finite(value) or float(value) <= 0:
        errors.append(f"{key}={value} must be a positive number of seconds (e.g. {key}={example}) or null "
                      "for no limit")


def _validate_reward(rw: Any, errors: list[str], machine: bool) -> None:
    if not rw.weights:
        errors.append("reward.weights is empty: name at least one reward, e.g. reward.weights={correctness_binary: 1.0} "
                      "or reward=correctness")
    for name, weight in rw.weights.items():
        if check_registered(REWARDS, str(name), f"reward.weights.{name}", errors):
            # The reward's own settings (e.g. llm_judge's reward.judge): a fact on its REWARDS entry,
            # called as check(reward config, errors, machine).
            check = REWARDS.fact(str(name), "check")
            if check is not None:
                check(rw, errors, machine)
        if not _finite(weight):
            errors.append(f"reward.weights[{name!r}]={weight} must be a finite number")
    _timeout(rw.timeout_s, "reward.timeout_s", errors, "60")
    if not _finite(rw.on_error):
        errors.append(f"reward.on_error={rw.on_error} must be a finite number (the reward a failed sample gets; "
                      "default 0.0)")
    if not (_finite(rw.max_error_frac) and 0.0 <= float(rw.max_error_frac) <= 1.0):
        errors.append(f"reward.max_error_frac={rw.max_error_frac} must lie in [0, 1] (0 = any failed reward "
                      "fails the run; 0.1 tolerates 10 % of a step's samples)")
    _validate_isolation(rw, errors)


def _validate_isolation(rw: Any, errors: list[str]) -> None:
    from grpo_lab.rewards import REWARDS
    from grpo_lab.rewards.core import ISOLATION
    from grpo_lab.rewards.isolation import function_ref

    limit = rw.max_consecutive_timeouts
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        errors.append(f"reward.max_consecutive_timeouts={limit} must be an integer >= 1 (e.g. 3: a reward that "
                      "times out 3 times in a row fails the run) or null for no such rule")
    if rw.isolation not in ISOLATION:
        errors.append(f"reward.isolation={rw.isolation!r}; valid choices: {', '.join(ISOLATION)} (auto: a worker "
                      "process for rewards that may hang, this process for the built-in pure ones)")
        return
    for name in rw.weights:
        if str(name) in REWARDS and (rw.isolation == "process" or REWARDS.fact(str(name), "may_hang")) \
                and rw.isolation != "thread":
            try:
                function_ref(REWARDS.get(str(name)), str(name))
            except ValueError as err:
                errors.append(f"reward.isolation={rw.isolation}: {err}")


def _validate_reward_noise(rw: Any, errors: list[str]) -> None:
    nz = rw.noise
    if not check_registered(REWARD_NOISE, nz.kind, "reward.noise.kind", errors):
        return
    if not (_finite(nz.flip_prob) and 0.0 <= float(nz.flip_prob) <= 1.0):
        errors.append(f"reward.noise.flip_prob={nz.flip_prob} must lie in [0, 1] (e.g. 0.2)")
    for key in ("std", "prompt_bias_std"):
        if not (_finite(nz[key]) and float(nz[key]) >= 0.0):
            errors.append(f"reward.noise.{key}={nz[key]} must be a finite number >= 0 (0 = off)")
    if not _finite(nz.length_bias):
        errors.append(f"reward.noise.length_bias={nz.length_bias} must be a finite number (0 = off)")
    # A flip turns 1 into 0 and 0 into 1: the reward must be one registered 1/0 reward at weight 1
    # (a plug-in is checked on its first values instead).
    if REWARD_NOISE.fact(nz.kind, "binary_only"):
        names = [str(n) for n, w in rw.weights.items() if _finite(w) and float(w) != 0.0]  # weight 0 adds nothing
        registered = [n for n in names if n in REWARDS.names()]
        if registered and (len(names) != 1 or float(rw.weights[names[0]]) != 1.0
                           or not REWARDS.fact(names[0], "binary")):
            errors.append(f"reward.noise.kind={nz.kind} flips a 1/0 reward, but reward.weights="
                          f"{dict(rw.weights)} is not one 1/0 reward at weight 1: use reward=correctness "
                          "(correctness_binary) or reward.noise.kind=gaussian for graded rewards")


def _validate_rollout(r: Any, errors: list[str]) -> None:
    _timeout(r.generate_timeout_s, "rollout.generate_timeout_s", errors, "600")
    kv = r.kv_cache_bytes
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 2**20):
        errors.append(f"rollout.kv_cache_bytes={kv} must be a whole number of bytes >= 1 MiB (e.g. "
                      "rollout.kv_cache_bytes=268435456 for 256 MiB) or null (rollout.gpu_memory_utilization decides)")
    _timeout(r.sync_timeout_s, "rollout.sync_timeout_s", errors, "300")
    if r.max_model_len < 2:
        errors.append(f"rollout.max_model_len={r.max_model_len} must hold a prompt and its completion")
    elif r.max_new_tokens >= r.max_model_len:
        errors.append(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for the prompt within "
                      f"rollout.max_model_len={r.max_model_len}: raise rollout.max_model_len (and the model's "
                      "max_position_embeddings) or lower task.max_completion_tokens")


def _validate_task(t: Any, errors: list[str]) -> None:
    if not check_registered(TASKS, str(t.source), "task.source", errors):
        return
    if t.max_completion_tokens < 1:
        errors.append(f"task.max_completion_tokens={t.max_completion_tokens} must be >= 1 (the longest answer "
                      "the task needs, in tokens)")
    if "{prompt}" not in str(t.prompt_template):
        errors.append(f"task.prompt_template={t.prompt_template!r} must contain '{{prompt}}' (where the "
                      "prompt goes), e.g. 'Question: {prompt}\\nAnswer:'")
    # How prompts reach the model (grpo_lab/prompts.py).
    problem = check_chat_template(t.chat_template)
    if problem:
        errors.append(problem)
    if t.system_prompt is not None and t.chat_template == "none":
        errors.append("task.system_prompt is set but task.chat_template=none sends raw text, which has no place "
                      "for it: set task.chat_template=auto (or a .jinja file) or unset task.system_prompt")
    if t.answer_format is not None and t.answer_format not in ANSWER_FORMATS:
        errors.append(f"task.answer_format={t.answer_format!r}; valid choices: {', '.join(ANSWER_FORMATS)} "
                      "or null (the source's default)")
    # Every split must hold an item: RL draws from train, the warm-up stops on dev accuracy,
    # evaluation reads trainer.eval_split. An empty one used to fail only after the warm-up
    # ("max() arg is an empty sequence").
    if t.train_size is not None and t.train_size < 1:
        errors.append(f"task.train_size={t.train_size} must be >= 1: RL prompts come from the train split")
    for key in ("dev_size", "test_size"):
        v = t[key]
        if v is not None and v < 1:
            errors.append(f"task.{key}={v} must be >= 1: the warm-up stops on dev accuracy and evaluation "
                          f"reads the test split (e.g. task.{key}=200)")
    if t.min_distinct_train_prompts < 0:
        errors.append(f"task.min_distinct_train_prompts={t.min_distinct_train_prompts} must be >= 0 (0 lets a task "
                      "with few distinct train prompts through, with a warning)")
    # The source's own settings: a fact on its TASKS entry (`check`), not a list of names here.
    check = TASKS.fact(str(t.source), "check")
    if check is not None:
        check(t, errors)


def validate_rollout_reward_task(cfg: Any, errors: list[str], machine: bool = True) -> None:
    """Append a message to ``errors`` for every bad value in ``cfg.reward``, ``cfg.rollout`` and
    ``cfg.task``; cheap enough to run before anything loads (reasoning-gym's import is ~1 s).
    ``machine=False`` skips what only this machine can tell (files a reward needs exist here)."""
    _validate_reward(cfg.reward, errors, machine)
    _validate_reward_noise(cfg.reward, errors)
    _validate_rollout(cfg.rollout, errors)
    _validate_task(cfg.task, errors)


__all__ = ["validate_rollout_reward_task"]
