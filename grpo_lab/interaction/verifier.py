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

from fractions import Fraction
from typing import Any

from grpo_lab.interaction import ENVIRONMENTS
from grpo_lab.interaction.base import EnvReply, StepRecord
from grpo_lab.rewards import extract_answer, is_correct

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


class VerifierFeedback:
    """Environment (grpo_lab.interaction.base.Environment) replying with `verifier_message`."""

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
