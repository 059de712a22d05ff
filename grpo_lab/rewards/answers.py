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
boxed      ``...steps...\\n\\boxed{288}``           inside the LAST ``\\boxed{...}`` (braces
                                                   balanced; MATH / Minerva style)
boxed_or_  ``-28`` or ``...\\n\\boxed{288}``         what an instruct model writes, first rule that
last                                               applies: the last ``\\boxed{}``; else after the
                                                   last ``####``; else the last ``<answer>``
                                                   element; else the first number after the last
                                                   "answer is" / "answer:" (the rest of that line if
                                                   it holds no number); else the first number after
                                                   the last ``=`` (the result of the last equation
                                                   written); else the LAST number of the completion;
                                                   else the whole completion (so a bare non-numeric
                                                   answer still reads as itself)
=========  =====================================  ==============================================

``boxed_or_last`` reads "The answer is -28.", "15 - 43 = -28", "\\boxed{-28}", "**-28**" and "-28."
all as ``-28`` (markdown ``*``/``$``, a trailing full stop and thousands separators are dropped),
"280" as ``280``, and "4 + 1 = 5, which is the sum of 4 and 1." as ``5`` (SmolLM2-135M-Instruct
writes such trailing explanations; the last number alone would read them as ``1``). It is the answer
format chosen for question-form prompts when the model answers through a chat template
(grpo_lab.prompts.adapt_answer_format).

``extract_answer`` returns ``None`` when the format's marker is missing or the answer is empty.
``answer_marked`` is stricter for ``boxed_or_last``: it needs an explicit marker (boxed, ``####``,
tags, or "the answer is"), not merely a number; the ``format`` reward is 1.0 exactly when it holds.
"""

from __future__ import annotations

import re

ANSWER_FORMATS = ("plain", "hash", "tags", "boxed", "boxed_or_last")
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# "the answer is", "final answer:", "answer =" ... (case-insensitive); the answer follows.
_PHRASE = re.compile(r"answer\s*(?:is|:|=)\s*(?:equal to|:)?", re.IGNORECASE)
# A number: optional sign (a "-" right after a digit, letter or ")" is subtraction, not a sign, so
# "15-43" reads as 15 and 43), digits with optional thousands commas, decimals, or a fraction.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
        j += 1
    return None  # unclosed: no answer


def _clean(ans: str) -> str:
    """Strip what instruct models wrap answers in: markdown bold/italics, $...$, a trailing full stop."""
    ans = ans.strip().strip("*_`$ ").strip()
    ans = ans.rstrip(".").rstrip()
    if _NUMBER.fullmatch(ans):
        ans = ans.replace(",", "")
    return ans


def _marked(completion: str) -> str | None:
    """boxed_or_last's explicit markers, in order (module table); None when there is none."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    tags = _TAGS.findall(completion)
    if tags:
        return tags[-1]
    phrases = list(_PHRASE.finditer(completion))
    if phrases:
        rest = completion[phrases[-1].end():].strip()
        line = rest.splitlines()[0] if rest else ""
        inner = _last_boxed(line)
        if inner is not None:
            return inner
        num = _NUMBER.search(line)
        return num.group(0) if num else re.split(r"(?<=[^\d])\.\s", line)[0]
    return None


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
    elif fmt == "tags":
        found = _TAGS.findall(completion)
        if not found:
            return None
        ans = found[-1].strip()
    elif fmt == "boxed":
        boxed = _last_boxed(completion)
        ans = _clean(boxed) if boxed is not None else ""
    else:  # boxed_or_last
        marked = _marked(completion)
        after_equals = _NUMBER.search(completion.rsplit("=", 1)[1]) if "=" in completion else None
        if marked is not None:
            ans = _clean(marked)
        elif after_equals is not None:
            ans = _clean(after_equals.group(0))
        else:
            numbers = _NUMBER.findall(completion)
            ans = _clean(numbers[-1]) if numbers else _clean(completion)
    return ans or None


def answer_marked(completion: str, fmt: str = "plain") -> bool:
    """True when ``completion`` states its answer in the format's explicit form (the ``format``
    reward): for ``boxed_or_last`` a ``\\boxed{}``, ``####``, ``<answer>`` or "the answer is"
    holding a non-empty answer, not merely a number somewhere; for the others, an answer
    :func:`extract_answer` can read."""
    if fmt != "boxed_or_last":
        return extract_answer(completion, fmt) is not None
    marked = _marked(completion or "")
    return marked is not None and bool(_clean(marked))


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
    if fmt == "boxed_or_last" and not worked:
        return answer  # a bare answer reads as itself (warm-up targets of question-form tasks)
    if fmt in ("boxed", "boxed_or_last"):
        # A worked solution's own final marker (GSM8K "#### 72", a MATH \\boxed{}) is replaced.
        if "####" in worked:
            worked = worked.rsplit("####", 1)[0].rstrip()
        marked = f"The answer is \\boxed{{{answer}}}."
    elif fmt == "hash":
        if "####" in worked:
            worked = worked.rsplit("####", 1)[0].rstrip()
        marked = f"#### {answer}"
    else:
        last = list(_TAGS.finditer(worked))
        if last:
            worked = (worked[: last[-1].start()] + worked[last[-1].end() :]).rstrip()
        marked = f"<answer>{answer}</answer>"
    return f"{worked}\n{marked}" if worked else marked
