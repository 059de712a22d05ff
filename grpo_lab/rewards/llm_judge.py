"""Reward ``llm_judge``: a frozen judge model reads each completion and writes a score and feedback.

A frozen LLM critic, as in LLM-as-a-judge (Zheng et al., "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", arXiv 2306.05685: the judge is prompted with the question, the
reference and the answer, and its rating is parsed from its text). Here:

* **The judge** is any model a ``MODEL_BUILDERS`` builder makes (``reward.judge.builder``:
  ``smollm2_135m`` offline, or ``pretrained`` + ``reward.judge.path``), served by its own rollout
  engine (``reward.judge.engine``: ``vllm`` by default, ``hf`` works too) through
  ``grpo_lab.rollout.ROLLOUT_ENGINES``. It is started lazily on the first call, **once per process**
  (one engine per distinct judge setting, closed at exit), and it never receives weights: frozen.
* **The prompt** is ``reward.judge.template`` with ``{prompt}`` (the task's text), ``{completion}``
  (the policy's answer, cut to ``max_completion_chars``) and ``{answer}`` (the reference) replaced
  (``str.replace``, so other braces such as ``\\boxed{}`` in the template stay as written), then
  rendered through the judge's chat template (``grpo_lab.prompts``; ``judge.chat_template``,
  ``judge.system_prompt``). ``judge.response_prefix`` (default ``"Score:"``) is appended after the
  assistant turn begins, so even a small judge starts with its number.
* **Decoding is greedy** (temperature 0): the same completion always gets the same score.
* **The score** is the first ``Score: N/M`` (or ``Score: N``, out of ``judge.score_max``) in the
  judge's text, divided by its maximum: ``"Score: 7/10"`` -> 0.7. A text without one, or with a
  score outside [0, max], is returned as NaN, which ``compute_rewards`` counts as a failed sample
  (``reward.on_error``, ``reward/errors``): a contained error, not a crash and not a silent 0.
* **Feedback**: the judge's whole text (prefix included) comes back as
  ``RewardValues.info["feedback"]``, i.e. ``RewardResult.info["llm_judge/feedback"]``, for the
  caller to log beside the sample.

Departures: the judge runs on this process's machine next to the policy's engine (on this 2-core
CPU machine a second vLLM engine costs ~30-60 s to start and its own KV cache, judge.gpu_memory_utilization
of RAM: 0.25 for SmolLM2-135M in fp32, whose weights and start-up profiling come out of that share;
0.1 left vLLM a negative KV budget here); no pairwise or reference-free modes, no position-swap debiasing (single-answer grading only).
"""

from __future__ import annotations

import atexit
import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, Mapping

from grpo_lab.progress import heartbeat
from grpo_lab.schema import JudgeConfig

from .core import REWARDS, RewardValues

log = logging.getLogger(__name__)

# The schema's reward.judge.template (the one source of the default).
DEFAULT_TEMPLATE = JudgeConfig.template

# "Score: 7/10", "score = 7 out of 10", "Score: **8**", "SCORE: 0.5/1" (case-insensitive).
_SCORE = re.compile(r"score\s*(?:[:=]|is)?\s*\**\s*(-?\d+(?:\.\d+)?)\s*\**\s*(?:(?:/|out of)\s*(\d+(?:\.\d+)?))?",
                    re.IGNORECASE)


def parse_score(text: str, score_max: float = 10.0) -> float | None:
    """The first ``Score: N/M`` (or ``Score: N`` out of ``score_max``) in ``text`` as N/M in [0, 1];
    None when there is none or it lies outside [0, M]."""
    m = _SCORE.search(text or "")
    if m is None:
        return None
    num = float(m.group(1))
    den = float(m.group(2)) if m.group(2) is not None else float(score_max)
    if den <= 0 or not (0.0 <= num <= den):
        return None
    return num / den


def render_judge_prompt(template: str, *, prompt: str, completion: str, answer: str, max_chars: int | None) -> str:
    """``template`` with {prompt}, {completion} (cut to ``max_chars``) and {answer} replaced."""
    if max_chars is not None and len(completion) > max_chars:
        completion = completion[:max_chars] + " [...]"
    # One pass, so a completion that itself contains "{answer}" is not expanded.
    values = {"{prompt}": str(prompt), "{completion}": str(completion), "{answer}": str(answer)}
    return re.sub(r"\{prompt\}|\{completion\}|\{answer\}", lambda m: values[m.group(0)], template)


# ------------------------------------------------------------------------------------- the engine
_ENGINES: dict[tuple, tuple[Any, Any]] = {}
# A judge that failed to start is not started again in this process: compute_rewards retries a failed
# batch sample by sample, and each retry would otherwise pay another engine start-up (~40 s) to fail.
_FAILED: dict[tuple, BaseException] = {}
_LOCK = threading.Lock()


def _key(judge: Mapping[str, Any]) -> tuple:
    keys = ("builder", "path", "cache_dir", "engine", "dtype", "max_model_len", "gpu_memory_utilization",
            "chat_template", "system_prompt")
    return tuple(str(judge[k]) for k in keys)


def judge_model_dir(judge: Mapping[str, Any]) -> Path:
    """The judge's HF model directory: built (and cached) by its builder, once per builder."""
    from grpo_lab.models import MODEL_BUILDERS

    builder = str(judge["builder"])
    cache = Path(str(judge["cache_dir"]))
    kwargs = {"path": judge["path"]} if judge["path"] else {}
    # One cached copy per builder, shared by every run, task and seed (pretrained returns `path` itself).
    return Path(MODEL_BUILDERS.call(builder, cache / f"judge_{builder}", alphabet="", seed=0, **kwargs))


def start_judge(judge: Mapping[str, Any]) -> tuple[Any, Any]:
    """The judge's ``(engine, tokenizer)``, started on the first call and reused afterwards.

    A run may call this before its first step so that the start-up (~30-60 s for vLLM on a CPU)
    does not count against ``reward.timeout_s`` of the first reward call.
    """
    key = _key(judge)
    with _LOCK:
        if key in _ENGINES:
            return _ENGINES[key]
        if key in _FAILED:
            raise RuntimeError(f"the judge model failed to start earlier in this process "
                               f"({type(_FAILED[key]).__name__}: {_FAILED[key]})") from _FAILED[key]
        try:
            _ENGINES[key] = _start(judge)
        except Exception as e:
            _FAILED[key] = e
            raise
        return _ENGINES[key]


def _start(judge: Mapping[str, Any]) -> tuple[Any, Any]:
    """Build the judge's model directory, tokenizer (its prompt style) and engine."""
    from transformers import AutoTokenizer

    from grpo_lab.prompts import configure_tokenizer
    from grpo_lab.rollout import ROLLOUT_ENGINES, rollout_section

    model_dir = judge_model_dir(judge)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    configure_tokenizer(tokenizer, chat_template=str(judge["chat_template"]), system_prompt=judge["system_prompt"])
    engine_cfg = rollout_section(
        engine=judge["engine"], gpu_memory_utilization=judge["gpu_memory_utilization"],
        max_model_len=judge["max_model_len"], enforce_eager=True, dtype=judge["dtype"],
        generate_timeout_s=judge["generate_timeout_s"], sync_timeout_s=None)
    with heartbeat(f"judge: starting {model_dir} ({judge['engine']} engine; vLLM on a CPU: about a minute)"):
        engine = ROLLOUT_ENGINES.get(str(judge["engine"]))(model_dir, engine_cfg, seed=0, device="cpu")
    return engine, tokenizer


def close_judges() -> None:
    """Close every judge engine this process started (also run at exit)."""
    with _LOCK:
        for engine, _tok in _ENGINES.values():
            try:
                engine.close()
            except Exception as e:  # closing is best effort; the engines die with the process anyway
                log.warning("closing a judge engine failed: %r", e)
        _ENGINES.clear()
        _FAILED.clear()


atexit.register(close_judges)


# ------------------------------------------------------------------------------------- the reward
def check_llm_judge(rw: Any, errors: list[str], machine: bool = True) -> None:
    """reward.judge settings (the REWARDS `check` fact), checked before anything loads; ``machine``:
    also what only this machine can tell (the judge's model directory exists here)."""
    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.prompts import check_chat_template
    from grpo_lab.registry import check_registered
    from grpo_lab.rollout import ROLLOUT_ENGINES

    j = rw.judge
    if "{completion}" not in str(j.template):
        errors.append("reward.judge.template must contain '{completion}' (where the policy's answer goes); it may "
                      "also use {prompt} and {answer}")
    if check_registered(MODEL_BUILDERS, str(j.builder), "reward.judge.builder", errors):
        if MODEL_BUILDERS.fact(str(j.builder), "needs_path") and not j.path:
            errors.append(f"reward.judge.builder={j.builder} needs reward.judge.path=<local HF model directory>")
        elif j.path and machine and not Path(str(j.path)).expanduser().is_dir():
            # Else the engine starts and a first rollout runs before the judge fails to load.
            errors.append(f"reward.judge.path={j.path!r} is not a directory on this machine: give a local HF model "
                          "directory (saved with save_pretrained; hub names are not downloaded here), or use "
                          "reward.judge.builder=smollm2_135m (offline)")
    check_registered(ROLLOUT_ENGINES, str(j.engine), "reward.judge.engine", errors)
    problem = check_chat_template(j.chat_template)
    if problem:
        errors.append(problem.replace("task.chat_template", "reward.judge.chat_template"))
    if not (isinstance(j.score_max, (int, float)) and math.isfinite(j.score_max) and j.score_max > 0):
        errors.append(f"reward.judge.score_max={j.score_max} must be a positive number (the scale of 'Score: N' "
                      "when the judge writes no '/M')")
    if j.max_new_tokens < 1:
        errors.append(f"reward.judge.max_new_tokens={j.max_new_tokens} must be >= 1 (tokens the judge may write)")
    if j.max_completion_chars is not None and j.max_completion_chars < 1:
        errors.append(f"reward.judge.max_completion_chars={j.max_completion_chars} must be >= 1 or null (no cut)")
    if not 0.0 < float(j.gpu_memory_utilization) <= 1.0:
        errors.append(f"reward.judge.gpu_memory_utilization={j.gpu_memory_utilization} must lie in (0, 1] (on "
                      "the CPU build: the share of RAM for the judge's KV cache; 0.1 works here)")
    if j.max_model_len <= j.max_new_tokens:
        errors.append(f"reward.judge.max_model_len={j.max_model_len} must exceed reward.judge.max_new_tokens="
                      f"{j.max_new_tokens} (the judge's prompt needs room)")
    # The engine starts inside the first reward call, within reward.timeout_s.
    if rw.timeout_s is not None and float(rw.timeout_s) < 300:
        errors.append(f"reward.timeout_s={rw.timeout_s} is too short for llm_judge: its engine starts inside the "
                      "first reward call (~30-60 s for vLLM on a CPU) and then grades a whole batch; set "
                      "reward.timeout_s=900 (conf/reward/llm_judge.yaml) or null")


# Not run in the reward worker: the judge's engine calls carry their own limit
# (reward.judge.generate_timeout_s, the vLLM engine in its own processes), and a replaced worker
# would load the judge model again.
@REWARDS.register("llm_judge", check=check_llm_judge, may_hang=False)
def llm_judge(completions: list[str], *, prompt: list[str], answer: list[str], judge: Mapping[str, Any],
              **_: Any) -> RewardValues:
    """Judge score in [0, 1] per completion (NaN where unparseable), with the judge's text as
    ``info["feedback"]`` (module docstring)."""
    from grpo_lab.prompts import encode_prompt

    engine, tok = start_judge(judge)
    prefix = str(judge["response_prefix"])
    prefix_ids = tok.encode(prefix, add_special_tokens=False) if prefix else []
    max_chars = judge["max_completion_chars"]
    ids = [encode_prompt(tok, render_judge_prompt(str(judge["template"]), prompt=p,
                                                  completion=c, answer=a, max_chars=max_chars)) + prefix_ids
           for c, p, a in zip(completions, prompt, answer)]
    out = engine.generate(ids, n=1, temperature=0.0, top_p=1.0, max_new_tokens=int(judge["max_new_tokens"]),
                          seed=0, logprobs=False)
    texts = [prefix + t for t in out.texts]
    scores = [parse_score(t, float(judge["score_max"])) for t in texts]
    return RewardValues([math.nan if s is None else s for s in scores], info={"feedback": texts})


__all__ = ["DEFAULT_TEMPLATE", "check_llm_judge", "close_judges", "judge_model_dir", "llm_judge", "parse_score",
           "render_judge_prompt", "start_judge"]
