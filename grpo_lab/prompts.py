"""How a task's prompt text becomes the token ids a model reads: raw (``<bos>`` + text) or through
the model's chat template.

Public API::

    CHAT_TEMPLATE_CHOICES = ("auto", "none")   # or a path to a Jinja template file
    configure_tokenizer(tokenizer, *, chat_template="auto", system_prompt=None) -> tokenizer
    uses_chat_template(tokenizer) -> bool
    render_prompt(tokenizer, text) -> str          # the text the model reads (for logs and samples)
    chat_messages(tokenizer, text) -> list[dict]   # the conversation behind it (chat-template tokenizers)
    encode_prompt(tokenizer, text) -> list[int]    # what grpo_lab.learner.batch.encode_prompt returns
    environment_turn_ids(tokenizer, message, *, answer_ids) -> list[int]   # between two actor turns
    prepare_for_model(task, tokenizer, task_cfg) -> tokenizer   # the one call after loading a tokenizer

Instruct models are trained on prompts wrapped in their chat template; given the bare text they
answer tersely or ramble (SmolLM2-135M-Instruct given bos + raw text answers tersely; through its
template it writes "The answer is 67."). So with ``task.chat_template=auto``
(the default) a prompt reaches a tokenizer that has a template exactly as

    tokenizer.apply_chat_template([{"role": "system", "content": system_prompt},   # only if set
                                   {"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)

renders it (the template writes its own special tokens, BOS included where the model wants one;
transformers tokenizes the rendered text with ``add_special_tokens=False``, so BOS is not doubled:
``PreTrainedTokenizerBase.apply_chat_template``). A tokenizer without a template (the tiny
character-level model) keeps ``<bos>`` + text, so its runs are unchanged. ``none`` forces the raw
form; a path loads that Jinja file as the template.

The setting travels on the tokenizer object (``configure_tokenizer`` stores it as an attribute),
because every call site (rollouts, evaluation, warm-up SFT, preference pairs) already holds the
tokenizer and calls ``encode_prompt(tokenizer, text)``; none of them has to pass task config.
An unconfigured tokenizer behaves as ``chat_template=auto`` without a system prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHAT_TEMPLATE_CHOICES = ("auto", "none")
# Attribute under which configure_tokenizer stores the PromptStyle on a tokenizer object.
_STYLE_ATTR = "_grpo_lab_prompt_style"


@dataclass(frozen=True)
class PromptStyle:
    # "auto" (the tokenizer's template if it has one), "none" (raw), or the path of a Jinja file
    # (already loaded into tokenizer.chat_template by configure_tokenizer).
    chat_template: str = "auto"
    # System message placed before the user's prompt (None: the template's own default, if any).
    system_prompt: str | None = None


def check_chat_template(value: Any) -> str | None:
    """None when ``value`` is a valid ``task.chat_template``, else what is wrong with it."""
    if value in CHAT_TEMPLATE_CHOICES:
        return None
    p = Path(str(value)).expanduser()
    if not p.is_file():
        return (f"task.chat_template={value!r} is neither one of {', '.join(CHAT_TEMPLATE_CHOICES)} nor an "
                "existing Jinja template file: set task.chat_template=auto (the model's own template), none "
                "(<bos> + raw text) or a path to a .jinja file")
    return None


def configure_tokenizer(tokenizer: Any, *, chat_template: str = "auto", system_prompt: str | None = None) -> Any:
    """Record how prompts are rendered for ``tokenizer`` (and load a template file into it); returns it.

    A template file replaces ``tokenizer.chat_template``, so a tokenizer saved with a checkpoint
    renders prompts the same way when the checkpoint is reloaded.
    """
    problem = check_chat_template(chat_template)
    if problem:
        raise ValueError(problem)
    if chat_template not in CHAT_TEMPLATE_CHOICES:
        tokenizer.chat_template = Path(str(chat_template)).expanduser().read_text(encoding="utf-8")
    setattr(tokenizer, _STYLE_ATTR, PromptStyle(str(chat_template), system_prompt))
    return tokenizer


def prompt_style(tokenizer: Any) -> PromptStyle:
    return getattr(tokenizer, _STYLE_ATTR, None) or PromptStyle()


def uses_chat_template(tokenizer: Any) -> bool:
    """True when prompts for ``tokenizer`` go through a chat template."""
    return prompt_style(tokenizer).chat_template != "none" and bool(getattr(tokenizer, "chat_template", None))


def _messages(style: PromptStyle, text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": style.system_prompt}] if style.system_prompt is not None else []
    return [*system, {"role": "user", "content": text}]


def _check_raw(style: PromptStyle) -> None:
    if style.system_prompt is not None:
        raise ValueError("task.system_prompt needs a chat template, and this tokenizer has none (or "
                         "task.chat_template=none): unset task.system_prompt or give task.chat_template=<file>")


def chat_messages(tokenizer: Any, text: str) -> list[dict[str, str]]:
    """The conversation a chat-template tokenizer renders for ``text`` (system message first if set):
    what another trainer (TRL's conversational prompts) must be given to see the same prompt ids."""
    if not uses_chat_template(tokenizer):
        raise ValueError("this tokenizer renders prompts without a chat template (<bos> + text)")
    return _messages(prompt_style(tokenizer), text)


def render_prompt(tokenizer: Any, text: str) -> str:
    """The prompt as the model reads it, as text (chat template applied when in use)."""
    style = prompt_style(tokenizer)
    if not uses_chat_template(tokenizer):
        _check_raw(style)
        return (getattr(tokenizer, "bos_token", None) or "") + text
    return tokenizer.apply_chat_template(_messages(style, text), add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt ids: through the chat template (see module docstring), else ``<bos>`` + the text's tokens
    (the tiny model's tokenizer never adds specials itself)."""
    style = prompt_style(tokenizer)
    if not uses_chat_template(tokenizer):
        _check_raw(style)
        # Duck-typed tokenizers (tests' scripted ones) need only encode() and bos_token_id here.
        ids = tokenizer.encode(text, add_special_tokens=False)
        bos = getattr(tokenizer, "bos_token_id", None)
        return ([bos] if bos is not None else []) + ids
    out = tokenizer.apply_chat_template(_messages(style, text), add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (return_dict defaults to True); 4.x a list of ids.
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    bos = tokenizer.bos_token_id
    # A template that writes BOS itself plus a tokenizer that adds one would double it; keep one.
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


# Multi-turn conversations without a chat template (the tiny character model): after the actor's answer
# (which ends in <eos> unless it was cut at max_new_tokens; then an <eos> is added) the environment's
# message is written as RAW_MESSAGE_OPEN + message + RAW_MESSAGE_CLOSE, and the actor's next answer
# follows: "<bos>15-43=-38<eos>?wrong: too low\n-28<eos>". The characters below join the tiny model's
# alphabet only when an interaction is on (grpo_lab.interaction.message_alphabet).
RAW_MESSAGE_OPEN, RAW_MESSAGE_CLOSE = "?", "\n"
# Stands for the actor's answer when the chat template is rendered around it; no template alters it.
_ANSWER_SENTINEL = "\u2063ANSWER\u2063"


def environment_turn_ids(tokenizer: Any, message: str, *, answer_ids: list[int], role: str = "user") -> list[int]:
    """The token ids between an actor answer (`answer_ids`, as sampled) and the actor's next answer
    when the environment says `message`.

    With a chat template: exactly what the template writes there (the assistant turn closed, a turn of
    `role` holding the message: a user turn, or a tool's output where the template has a tool role; the
    next assistant turn opened), read off the template rendered around a sentinel answer, so any
    template works. The end-of-turn token is not written twice: an answer that
    already ended with it (the sampler stopped on EOS) keeps its own. Without a template: the compact
    raw format above. The answer's ids are never re-tokenized (they are the sampled ones)."""
    style = prompt_style(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    ended = bool(answer_ids) and eos is not None and answer_ids[-1] == eos
    if not uses_chat_template(tokenizer):
        _check_raw(style)
        ids = tokenizer.encode(RAW_MESSAGE_OPEN + message + RAW_MESSAGE_CLOSE, add_special_tokens=False)
        return ids if ended or eos is None else [eos, *ids]
    conversation = [*_messages(style, "?"), {"role": "assistant", "content": _ANSWER_SENTINEL},
                    {"role": role, "content": message}]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    if text.count(_ANSWER_SENTINEL) != 1:
        raise ValueError("this chat template does not write an assistant turn's content as given; multi-turn "
                         "rollouts cannot place the environment's message after it")
    ids = tokenizer.encode(text.split(_ANSWER_SENTINEL, 1)[1], add_special_tokens=False)
    return ids[1:] if ended and ids and ids[0] == eos else ids


# Answer format used for question-form prompts when the model answers through a chat template and the
# task did not set one: instruct models write "The answer is -28." or "\boxed{-28}", which "plain"
# (the whole completion is the answer) scores wrong. See grpo_lab.rewards.answers.
CHAT_ANSWER_FORMAT = "boxed_or_last"


def adapt_answer_format(task: Any, tokenizer: Any) -> bool:
    """Switch a task whose answer format was *defaulted* to ``plain`` (and whose prompts are not
    compact) to :data:`CHAT_ANSWER_FORMAT` when ``tokenizer`` renders prompts through a chat
    template. Returns whether it switched. An explicit ``task.answer_format`` is never changed.

    Safe for warm-up targets: a bare answer (``-28``) reads as itself under ``boxed_or_last``.
    """
    info = task.info
    if not info.get("answer_format_defaulted") or not uses_chat_template(tokenizer):
        return False
    for items in task.splits.values():
        for it in items:
            if it.fields.get("answer_format", "plain") == "plain":
                it.fields["answer_format"] = CHAT_ANSWER_FORMAT
    log.info("task %s: the model answers through a chat template; answers are read with answer_format=%s "
             "(set task.answer_format to choose another)", task.name, CHAT_ANSWER_FORMAT)
    info["answer_format"] = CHAT_ANSWER_FORMAT
    info["answer_format_defaulted"] = False
    info["answer_format_reason"] = "chat template"
    return True


def prepare_for_model(task: Any, tokenizer: Any, task_cfg: Any) -> Any:
    """The one call a run makes after loading the policy's tokenizer (and before the first prompt is
    encoded): apply ``task.chat_template`` / ``task.system_prompt`` to the tokenizer and pick the
    chat answer format when the task left it to the source (:func:`adapt_answer_format`)."""
    configure_tokenizer(tokenizer, chat_template=task_cfg.chat_template, system_prompt=task_cfg.system_prompt)
    adapt_answer_format(task, tokenizer)
    return tokenizer


__all__ = ["CHAT_ANSWER_FORMAT", "CHAT_TEMPLATE_CHOICES", "PromptStyle", "RAW_MESSAGE_CLOSE", "RAW_MESSAGE_OPEN",
           "adapt_answer_format", "chat_messages", "check_chat_template", "configure_tokenizer", "encode_prompt",
           "environment_turn_ids", "prepare_for_model", "prompt_style",
           "render_prompt", "uses_chat_template"]
