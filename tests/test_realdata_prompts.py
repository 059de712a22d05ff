"""Prompts through the model's chat template (grpo_lab/prompts.py), and the answer format a chat
model's question-form task gets. Uses SmolLM2-135M-Instruct's real tokenizer (built once, cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lab.learner.batch import encode_prompt
from grpo_lab.prompts import (adapt_answer_format, chat_messages, configure_tokenizer, prepare_for_model,
                              render_prompt, uses_chat_template)

# Under the repo's git-ignored .cache, so the slow conversion (0.5 GB) happens once per checkout.
SMOLLM2_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "grpo_lab" / "models" / "smollm2_135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    pytest.importorskip("gguf")
    from grpo_lab.models import MODEL_BUILDERS

    return Path(MODEL_BUILDERS.call("smollm2_135m", SMOLLM2_CACHE))


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _reference_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


QUESTION = "State the final answer to the following arithmetic problem: 15 - 43 ="


def test_smollm2_prompt_ids_equal_apply_chat_template(smollm2_dir):
    tok = _tok(smollm2_dir)
    assert uses_chat_template(tok)  # auto, unconfigured
    ids = encode_prompt(tok, QUESTION)
    assert ids == _reference_ids(tok, [{"role": "user", "content": QUESTION}])
    # SmolLM2's BOS is <|im_start|>, which the template writes itself: exactly one at the start.
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_system_prompt_and_none(smollm2_dir):
    tok = configure_tokenizer(_tok(smollm2_dir), system_prompt="Answer with a number.")
    ids = encode_prompt(tok, QUESTION)
    assert ids == _reference_ids(tok, [{"role": "system", "content": "Answer with a number."},
                                       {"role": "user", "content": QUESTION}])
    assert "Answer with a number." in render_prompt(tok, QUESTION)
    raw = configure_tokenizer(_tok(smollm2_dir), chat_template="none")
    assert not uses_chat_template(raw)
    assert encode_prompt(raw, QUESTION) == [raw.bos_token_id] + raw.encode(QUESTION, add_special_tokens=False)


def test_chat_messages_render_the_lab_prompt_ids(smollm2_dir):
    # What another trainer (TRL's conversational prompts, scripts/bench.py) is handed: the same
    # conversation the lab renders, system message included when set.
    tok = configure_tokenizer(_tok(smollm2_dir), system_prompt="Answer with a number.")
    msgs = chat_messages(tok, QUESTION)
    assert msgs == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": QUESTION}]
    assert _reference_ids(tok, msgs) == encode_prompt(tok, QUESTION)
    with pytest.raises(ValueError, match="without a chat template"):
        chat_messages(configure_tokenizer(_tok(smollm2_dir), chat_template="none"), QUESTION)


def test_template_file(tmp_path, smollm2_dir):
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    tok = configure_tokenizer(_tok(smollm2_dir), chat_template=str(f))
    ids = encode_prompt(tok, "2+2")
    assert tok.decode(ids) == "<|im_start|>Q: 2+2\nA:"
    assert ids.count(tok.bos_token_id) == 1
    with pytest.raises(ValueError, match="task.chat_template='/nope.jinja' is neither"):
        configure_tokenizer(tok, chat_template="/nope.jinja")


def test_tiny_char_model_unchanged():
    from grpo_lab.models import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+-=")
    assert not uses_chat_template(tok)
    assert encode_prompt(tok, "15-43=") == [tok.bos_token_id] + tok.encode("15-43=", add_special_tokens=False)
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        encode_prompt(configure_tokenizer(tok, system_prompt="hi"), "1+1=")


def _chain_sum(prompt_format, answer_format=None):
    from grpo_lab.tasks import TASKS

    return TASKS.get("reasoning_gym")(name="chain_sum", dataset_kwargs=dict(min_terms=2, max_terms=2, min_digits=2,
                                                                             max_digits=2),
                                      prompt_format=prompt_format, answer_format=answer_format, train_size=3,
                                      dev_size=1, test_size=1)


def test_chat_model_reads_question_form_answers_in_prose(smollm2_dir):
    from grpo_lab.rewards import is_correct
    from omegaconf import OmegaConf

    task = _chain_sum("question")
    item = task.splits["train"][0]
    assert item.answer == "-28" and item.fields["answer_format"] == "plain"
    assert not is_correct("The answer is -28.", item)  # the old default, plain, scores prose wrong
    prepare_for_model(task, _tok(smollm2_dir), OmegaConf.create({"chat_template": "auto", "system_prompt": None}))
    assert item.fields["answer_format"] == "boxed_or_last" and task.info["answer_format"] == "boxed_or_last"
    for text in ("The answer is -28.", "15 - 43 = -28", "\\boxed{-28}", "**-28**", "-28.", item.solution):
        assert is_correct(text, item), text
    assert not is_correct("280", item)


def test_compact_explicit_and_chatless_tasks_are_not_switched(smollm2_dir):
    from grpo_lab.models import build_char_tokenizer

    compact = _chain_sum("compact")
    assert not adapt_answer_format(compact, _tok(smollm2_dir))
    explicit = _chain_sum("question", answer_format="plain")
    assert not adapt_answer_format(explicit, _tok(smollm2_dir))
    question = _chain_sum("question")
    assert not adapt_answer_format(question, build_char_tokenizer(question.alphabet()))
    assert question.splits["test"][0].fields["answer_format"] == "plain"
