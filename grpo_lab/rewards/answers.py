"""Where the final answer sits in a completion: one rule per answer format.

Every ``TaskItem`` carries ``fields["answer_format"]`` (the task chooses it; absent means
``"plain"``). The same rule is used to write SFT targets (:func:`format_solution`) and to read
completions (:func:`extract_answer`), so warm-up and reward agree.

=========  =====================================  ==============================================
format     solution looks like                     extracted answer
=========  =====================================  ==============================================
plain      ``-28``                                 the whole completion, stripped
hash       ``...worked steps...\\n#### 288``        first line after the LAST ``####``, stripped
                                                   (GSM8K / gsm_symbolic ``answer_cot`` style)
tags       ``...steps...\\n<answer>288</answer>``   inside the LAST ``<answer>...</answer>``,
                                                   stripped
=========  =====================================  ==============================================

``extract_answer`` returns ``None`` when the format's marker is missing or the answer is empty;
the ``format`` reward is 1.0 exactly when it is not ``None``.
"""

from __future__ import annotations

import re

ANSWER_FORMATS = ("plain", "hash", "tags")
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def check_answer_format(fmt: str) -> str:
    if fmt not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer_format {fmt!r}; valid choices: {', '.join(ANSWER_FORMATS)}")
    return fmt


def extract_answer(completion: str, fmt: str = "plain") -> str | None:
    """The final answer in ``completion`` under answer format ``fmt`` (table above), or None."""
    check_answer_format(fmt)
    if completion is None:
        return None
    if fmt == "plain":
        ans = completion.strip()
    elif fmt == "hash":
        if "####" not in completion:
            return None
        tail = completion.rsplit("####", 1)[1].strip()
        ans = tail.splitlines()[0].strip() if tail else ""
    else:  # tags
        found = _TAGS.findall(completion)
        if not found:
            return None
        ans = found[-1].strip()
    return ans or None


def format_solution(answer: str, fmt: str = "plain", worked: str | None = None) -> str:
    """The SFT target for ``answer``: ``worked`` steps (if any) followed by the answer in ``fmt``.

    If ``worked`` already ends in an answer marker of this format (gsm_symbolic's ``answer_cot``
    ends in ``#### 288``) that last marker is replaced by one holding ``answer``, so the target
    always ends in the reference answer exactly (``answer_cot`` sometimes says ``#### 8.0`` where
    the reference answer is ``8``).
    """
    check_answer_format(fmt)
    worked = (worked or "").rstrip()
    if fmt == "plain":
        if worked:
            raise ValueError(
                "answer_format 'plain' reads the whole completion as the answer, so it cannot carry "
                "worked steps; use answer_format 'hash' or 'tags' for worked solutions"
            )
        return answer
    if fmt == "hash":
        if "####" in worked:
            worked = worked.rsplit("####", 1)[0].rstrip()
        marked = f"#### {answer}"
    else:
        last = list(_TAGS.finditer(worked))
        if last:
            worked = (worked[: last[-1].start()] + worked[last[-1].end() :]).rstrip()
        marked = f"<answer>{answer}</answer>"
    return f"{worked}\n{marked}" if worked else marked
