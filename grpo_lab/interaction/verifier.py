"""`verifier_feedback`: the task's own verifier, answering in words. The oracle upper bound for feedback:
it knows the reference answer, so what a critic LLM's feedback achieves is bounded by what this does.

Replies (the item's answer format reads the answer: grpo_lab.rewards.answers.extract_answer):

    "correct"                 the answer is right (is_correct, the clean correctness of metrics); done
    "wrong: no answer found"  nothing could be read as an answer
    "wrong: off by a sign"    numeric, and the answer is −reference (reference ≠ 0)
    "wrong: too high"         numeric, and the answer is above the reference
    "wrong: too low"          numeric, and below
    "wrong"                   otherwise (a non-numeric reference or answer)

verdict = the answer is correct. It learns nothing and has no state.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

from grpo_lab.interaction import ENVIRONMENTS
from grpo_lab.interaction.base import EnvReply, StepRecord
from grpo_lab.rewards import extract_answer, format_solution, is_correct

CORRECT = "correct"
FEEDBACK = ("wrong: no answer found", "wrong: off by a sign", "wrong: too high", "wrong: too low", "wrong")


def _number(text: str | None) -> Fraction | None:
    """`text` as an exact number ("-28", "3.5", "7/2"), else None."""
    try:
        return Fraction(str(text).strip().replace(",", "")) if text is not None else None
    except (ValueError, ZeroDivisionError):
        return None


def verifier_message(answer_text: str, item: Any) -> str:
    """The verifier's words for one actor answer to `item` (module docstring)."""
    if is_correct(answer_text, item):
        return CORRECT
    extracted = extract_answer(answer_text, item.fields.get("answer_format") or "plain")
    if extracted is None:
        return "wrong: no answer found"
    got, want = _number(extracted), _number(item.answer)
    if got is None or want is None:
        return "wrong"
    if want != 0 and got == -want:
        return "wrong: off by a sign"
    return "wrong: too high" if got > want else "wrong: too low" if got < want else "wrong"


def wrong_answer(item: Any, rng: random.Random, *, max_offset: int, others: list) -> str:
    """A wrong answer to `item`, written in its answer format: the reference ± 1..max_offset, or (one time
    in five) its sign flipped; a non-numeric reference is replaced by another item's answer. For synthetic
    examples of what the verifier says to wrong answers (revision demonstrations, a critic's warm-up)."""
    fmt = item.fields.get("answer_format") or "plain"
    ref = str(item.answer).strip()
    if not ref.lstrip("-").isdigit():
        wrong = [str(o.answer).strip() for o in others if str(o.answer).strip() != ref] or [ref + "0"]
        return format_solution(rng.choice(wrong), fmt)
    value = int(ref)
    flip = value != 0 and rng.random() < 0.2
    return format_solution(str(-value if flip else value + rng.choice([-1, 1]) * rng.randint(1, max_offset)), fmt)


class VerifierFeedback:
    """Environment (grpo_lab.interaction.base.Environment) replying with `verifier_message`."""

    @staticmethod
    def demo_message(cfg: Any, item: Any, answer: str) -> str:
        """What this environment says to `answer` (for revision demonstrations in the warm-up)."""
        return verifier_message(answer, item)

    def __init__(self, cfg: Any = None, *, tokenizer: Any = None, task: Any = None):
        del cfg, tokenizer, task   # the items carry everything the verifier reads

    def reply(self, items: list, conversations: list[list[str]], *, seed: int, greedy: bool) -> list[EnvReply]:
        out = []
        for item, conversation in zip(items, conversations):
            message = verifier_message(conversation[-1], item)
            ok = message == CORRECT
            out.append(EnvReply(message=None if ok else message, done=ok, verdict=ok))
        return out

    def after_step(self, step: int, record: StepRecord) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


ENVIRONMENTS.register("verifier_feedback", learns=False, needs_reference=True, alphabet="".join(sorted({*CORRECT, *"".join(FEEDBACK)})))(
    VerifierFeedback)
