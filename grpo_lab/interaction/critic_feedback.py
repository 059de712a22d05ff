"""What the critic LLM reads and writes, what the task's verifier would have said, and which examples it
learns from: pure functions and data, no model (the environment is grpo_lab/interaction/critic.py).

Feedback kinds: ``correct``, ``too_high``, ``too_low`` (a number on the wrong side of the reference) and
``wrong`` (anything else: no number, a format the reward does not read, or the bare verdict a scalar
reward supports). Each `FeedbackFormat` writes a kind as text (`FeedbackFormat.target`), reads a verdict
back, and says which part of its text the actor is shown (`FeedbackFormat.message`):

=============  ========================================  ==============================================
format         prompt (what the critic reads)            feedback (what it writes, + <eos>)
=============  ========================================  ==============================================
solve_compact  ``<bos>`` question answer ``|``           its own answer, then one letter: ``-28H``;
               e.g. ``<bos>15-43=-27|``                  ``C`` correct, ``H`` too high, ``L`` too low,
                                                         ``W`` wrong; verdict = the last letter; the
                                                         actor is shown the letter only
compact        the same                                  the letter alone (``H``)
chat           the chat template around "Question: q\n   a sentence starting "Correct" or "Wrong"
               Answer: a\nIs the answer correct? If      (e.g. "Wrong: the answer is too high."),
               not, say what is wrong in one short       shown whole; verdict from the first word
               sentence."
=============  ========================================  ==============================================

The compact formats are for the character-level tiny model (its alphabet must hold ``|CHLW``, which
`COMPACT_CHARS` names; the actor's, ``CHLW``); a tokenizer with a chat template gets the chat format.
``solve_compact`` is the default for the tiny model because a bare letter asks it to compute and
compare within one token: a tiny_llama of the default actor's size did not learn that for chain_sum
within a few actor warm-ups' worth of steps, and did learn to judge once it first writes its own answer
(a scratchpad: Nye et al. 2021, arXiv 2112.00114; solve-then-verify: generative verifiers, Zhang et
al. 2024, arXiv 2408.15240). Its answer is hidden from the actor, which revises from the verdict alone
and cannot copy the critic's answer. Supervised targets put the item's reference answer in that place
(the task's solution, which the actor's own warm-up trains on too).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_lab.interaction.verifier import wrong_answer
from grpo_lab.rewards import extract_answer, format_solution, is_correct
from grpo_lab.tasks import Task, TaskItem

KINDS = ("correct", "too_high", "too_low", "wrong")
COMPACT_SEPARATOR = "|"
_COMPACT_LETTERS = {"correct": "C", "too_high": "H", "too_low": "L", "wrong": "W"}
COMPACT_CHARS = COMPACT_SEPARATOR + "".join(_COMPACT_LETTERS.values())
_CHAT_QUESTION = "Is the answer correct? If not, say what is wrong in one short sentence."
_CHAT_TEXTS = {"correct": "Correct.", "too_high": "Wrong: the answer is too high.",
               "too_low": "Wrong: the answer is too low.", "wrong": "Wrong."}


@dataclass(frozen=True)
class FeedbackFormat:
    """How a (question, answer) pair becomes the critic's prompt text, how a feedback kind is written for an
    item whose reference answer is given (`target`), how a verdict is read from what the critic wrote
    (None: neither correct nor wrong), and what part of it the actor is shown (`message`)."""

    name: str
    prompt: Callable[[str, str], str]
    texts: dict[str, str]
    parse: Callable[[str], bool | None]
    solves: bool = False        # the feedback starts with the critic's own answer (hidden from the actor)

    def target(self, kind: str, reference: str) -> str:
        return (str(reference).strip() if self.solves else "") + self.texts[kind]

    def message(self, text: str) -> str:
        return text.strip()[-1:] if self.solves else text.strip()


def _verdict_letter(letter: str) -> bool | None:
    return True if letter == "C" else False if letter and letter in "HLW" else None


def _parse_chat(text: str) -> bool | None:
    low = text.strip().lower()
    if low.startswith("correct"):
        return True
    return False if low.startswith(("wrong", "incorrect")) else None


def _compact_prompt(question: str, answer: str) -> str:
    return f"{question}{answer.strip()}{COMPACT_SEPARATOR}"


FEEDBACK_FORMATS = {
    "solve_compact": FeedbackFormat("solve_compact", _compact_prompt, _COMPACT_LETTERS,
                                    lambda text: _verdict_letter(text.strip()[-1:]), solves=True),
    "compact": FeedbackFormat("compact", _compact_prompt, _COMPACT_LETTERS,
                              lambda text: _verdict_letter(text.strip()[:1])),
    "chat": FeedbackFormat("chat", lambda q, a: f"Question: {q}\nAnswer: {a.strip()}\n{_CHAT_QUESTION}",
                           _CHAT_TEXTS, _parse_chat),
}


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def verifier_kind(item: TaskItem, answer: str) -> str:
    """What the task's verifier says of `answer`: ``correct`` when the correctness reward is 1.0, else
    the side of the reference a numeric answer lies on, else ``wrong``."""
    if is_correct(answer, item):
        return "correct"
    got = _number(extract_answer(answer, item.fields.get("answer_format", "plain")))
    ref = _number(str(item.answer).strip())
    if got is None or ref is None or got == ref:
        return "wrong"
    return "too_high" if got > ref else "too_low"


def candidate_answer(item: TaskItem, rng: random.Random, *, max_offset: int, others: list[TaskItem]) -> str:
    """A candidate actor answer for `item`, written in its answer format: half the time the reference,
    else a wrong one (`verifier.wrong_answer`: the reference ± 1..max_offset or its sign flipped; a
    non-numeric reference replaced by another item's answer)."""
    if rng.random() < 0.5:
        return format_solution(str(item.answer).strip(), item.fields.get("answer_format", "plain"))
    return wrong_answer(item, rng, max_offset=max_offset, others=others)


def synthetic_items(items: list[TaskItem], fmt: FeedbackFormat, *, seed: int, max_offset: int,
                    per_item: int = 1, limit: int | None = None) -> list[TaskItem]:
    """`per_item` supervised critic examples per task item (the first `limit` examples): prompt = the
    critic's prompt for (question, candidate answer), solution = answer = what the verifier would say,
    written in `fmt`."""
    rng = random.Random(seed)
    out = []
    for item in [it for it in items for _ in range(per_item)][:limit]:
        answer = candidate_answer(item, rng, max_offset=max_offset, others=items)
        target = fmt.target(verifier_kind(item, answer), item.answer)
        out.append(TaskItem(fmt.prompt(item.prompt, answer), target, target, {"answer_format": "plain"}))
    return out


def synthetic_task(task: Task, fmt: FeedbackFormat, *, seed: int, max_offset: int, per_item: int,
                   dev_size: int) -> Task:
    """The critic's warm-up data: synthetic pairs from the task's train split (train) and from its dev
    split (dev, held out: the warm-up's stopping rule and accuracy are measured there)."""
    splits = {"train": synthetic_items(task.splits["train"], fmt, seed=seed, max_offset=max_offset, per_item=per_item),
              "dev": synthetic_items(task.splits["dev"], fmt, seed=seed + 1, max_offset=max_offset, limit=dev_size),
              "test": []}
    return Task(f"{task.name}_critic_{fmt.name}", splits)


def items_digest(task: Task) -> str:
    """A hash of every split's (prompt, solution) pairs: the warm-up cache key's data part."""
    rows = [[name, it.prompt, it.solution] for name, split in task.splits.items() for it in split]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def top_bottom(rewards: list[float], top_frac: float, bottom_frac: float,
               generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Indices of the top `top_frac` and bottom `bottom_frac` of `rewards` (floor(frac·N) each).

    Ties at a boundary are broken uniformly at random (a random permutation from `generator` orders
    equal rewards), so exactly floor(frac·N) are taken and a tie is never resolved by batch position
    (the batch is ordered by prompt group, which would take them all from the first groups). An answer
    with the batch's lowest reward is never a positive and one with its highest never a negative: a
    step whose rewards all agree says nothing about which answers are better, and gives no examples."""
    n = len(rewards)
    r = torch.tensor(rewards, dtype=torch.float64)
    order = torch.randperm(n, generator=generator)                        # random rank among equals
    by_desc = order[torch.sort(-r[order], stable=True).indices]
    by_asc = order[torch.sort(r[order], stable=True).indices]
    lo, hi = (float(r.min()), float(r.max())) if n else (0.0, 0.0)
    top = [int(i) for i in by_desc if rewards[i] > lo][: int(top_frac * n)]
    bottom = [int(i) for i in by_asc if rewards[i] < hi][: int(bottom_frac * n)]
    return sorted(top), sorted(bottom)


def revision_reward(first_correct: bool, second_correct: bool | None, agrees: bool, agreement_coef: float) -> float:
    """The critic's reward for one feedback: +1 when the revision it led to turned a wrong answer right,
    −1 when it turned a right one wrong, 0 otherwise (no revision: `second_correct` None), plus
    `agreement_coef` when its verdict agreed with the verifier. See the critic module's docstring."""
    change = 0.0 if second_correct is None else float(second_correct) - float(first_correct)
    return change + (agreement_coef if agrees else 0.0)
