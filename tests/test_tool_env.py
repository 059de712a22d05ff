"""The python_tool environment (grpo_lab/interaction/tool_env.py): reading calls in each format, what the actor is
shown (output, the error's last line, truncation), a turn without a call ending the conversation, metrics by hand,
a plug-in tool by import path, the tool-use demonstrations' token layout, the tool role of a chat template,
validation, and a 2-step run of experiment=tool_tiny."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import REPO, read_metrics, train_in_process
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.interaction import ENVIRONMENTS, message_alphabet, multi_turn_rollout
from grpo_lab.interaction.demos import tool_demos
from grpo_lab.interaction.sandbox import ToolResult
from grpo_lab.interaction.tool_env import (ALPHABET, NO_OUTPUT, demo_code, extract_call, info_metrics,
                                           resolve_call_format, tool_message, write_call)
from grpo_lab.models import build_char_tokenizer
from grpo_lab.prompts import configure_tokenizer, encode_prompt, environment_turn_ids
from grpo_lab.schema import Config, ConfigError
from grpo_lab.tasks import TaskItem
from test_interaction import CHATML, ScriptedEngine

CONF = REPO / "conf"


def make(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def run_config(**tool):
    """A whole run config (the schema's defaults) with interaction=python_tool and these interaction.tool values."""
    return OmegaConf.merge(OmegaConf.structured(Config),
                           {"interaction": {"environment": "python_tool", "max_turns": 3, "tool": tool}})


def product(a: int, b: int) -> TaskItem:
    """A products item as reasoning-gym's compact form writes it."""
    return TaskItem(prompt=f"{a}*{b}=", answer=str(a * b), solution=str(a * b),
                    fields={"answer_format": "plain", "rg_entry": {"metadata": {"expression": f"{a} * {b}"}}})


# The tiny model's characters with python_tool on: the task's, and the environment's (which hold the raw
# message format's "?" and newline too).
CHARS = "0123456789*=" + message_alphabet(OmegaConf.structured(Config).interaction.copy()) + ALPHABET


# ------------------------------------------------------------------ reading calls


@pytest.mark.parametrize("text,code", [
    ("<py>123*456</py>", "123*456"),
    ("first <py>1+1</py> then <py>2+2</py>", "1+1"),                      # the first block is the call
    ("```python\nprint(2 ** 10)\n```", "print(2 ** 10)\n"),
    ("Let me compute.\n```py\nx = 3\nx * 4\n```\n", "x = 3\nx * 4\n"),
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(7)"}}\n</tool_call>', "print(7)"),
    ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"6*7\\"}"}</tool_call>', "6*7"),   # arguments as a string
    ("```python\nprint(1)\n``` and <py>2</py>", "print(1)\n"),           # formats mix: the earliest wins
])
def test_a_call_is_read_in_every_format(text, code):
    assert extract_call(text) == code


@pytest.mark.parametrize("text", [
    "56088",                                        # an answer
    "<py>123*456",                                  # cut off inside the block: an answer
    "```\nprint(1)\n```",                           # a fence without a language is not a call
    "```js\nconsole.log(1)\n```",
    '<tool_call>{"name": "search", "arguments": {"code": "1"}}</tool_call>',   # another tool's call
    "<tool_call>not json</tool_call>",
])
def test_a_turn_without_a_complete_call_is_an_answer(text):
    assert extract_call(text) is None


@pytest.mark.parametrize("fmt", ["tags", "fence", "tool_call"])
def test_written_calls_read_back(fmt):
    code = "x = 6\nprint(x * 7)"
    assert extract_call(write_call(code, fmt)).rstrip("\n") == code


def test_the_call_format_follows_the_tokenizer():
    tok = build_char_tokenizer(CHARS)
    assert resolve_call_format("auto", tok) == "tags"              # no chat template: the tiny model
    chat = build_char_tokenizer(CHARS)
    chat.chat_template = CHATML                                     # SmolLM2's: no tool-call convention
    assert resolve_call_format("auto", chat) == "fence"
    chat.chat_template = CHATML.replace("{% endfor %}", "{% endfor %}{# <tool_call> #}")
    assert resolve_call_format("auto", chat) == "tool_call"
    assert resolve_call_format("fence", tok) == "fence"            # a named format is kept


# ------------------------------------------------------------------ what the actor is shown


def test_the_message_is_the_output_or_the_errors_last_line_cut_to_max_chars():
    assert tool_message(ToolResult("ok", "56088\n"), 32) == "56088"
    assert tool_message(ToolResult("ok", ""), 32) == NO_OUTPUT
    assert tool_message(ToolResult("error", "ZeroDivisionError: division by zero"), 32) == \
        "ZeroDivisionError: division by z"                          # 32 characters
    assert tool_message(ToolResult("ok", "x" * 100), 10) == "x" * 10


def recording_env(**tool):
    cfg = run_config(name="interaction_plugins:recording_tool", max_output_chars=12, **tool)
    return ENVIRONMENTS.get("python_tool")(cfg, tokenizer=build_char_tokenizer(CHARS), task=None)


def test_reply_runs_calls_ends_on_answers_and_records_info():
    env = recording_env()
    convs = [["<calc>1+2</calc>"], ["3"], ["<calc>1+2</calc>"], ["<calc>!boom</calc>"], ["<py>9</py>"]]
    replies = env.reply([None] * len(convs), convs, seed=0, greedy=False)
    assert env.tool.calls == ["1+2", "!boom"]                      # the plug-in's own tag; identical code runs once
    assert [r.done for r in replies] == [False, True, False, False, True]   # <py> is not this tool's tag: an answer
    assert replies[0].message == "ran 1+2" and replies[3].message == "error: !boom"
    assert replies[1].info["answer"] == "3" and replies[1].message is None
    info = replies[0].info
    assert (info["code"], info["output"], info["status"], info["output_tokens"]) == ("1+2", "ran 1+2", "ok", 7)
    assert replies[3].info["status"] == "error"
    assert all(r.role == "user" and r.verdict is None for r in replies)   # the tool judges nothing
    env.close()


def test_without_dedupe_every_call_runs():
    env = recording_env(dedupe=False)
    env.reply([None] * 2, [["<calc>1</calc>"], ["<calc>1</calc>"]], seed=0, greedy=True)
    assert env.tool.calls == ["1", "1"]
    env.close()


def test_the_sandboxed_python_answers_outputs_errors_and_truncates():
    cfg = run_config(max_output_chars=17, workers=2)
    env = ENVIRONMENTS.get("python_tool")(cfg, tokenizer=build_char_tokenizer(CHARS), task=None)
    convs = [["<py>123*456</py>"], ["<py>1/0</py>"], ["<py>print('z' * 50)</py>"], ["<py>import time\nx = 1</py>"]]
    replies = env.reply([None] * 4, convs, seed=0, greedy=False)
    assert [r.message for r in replies] == ["56088", "ZeroDivisionError", "z" * 17, NO_OUTPUT]
    assert [r.info["status"] for r in replies] == ["ok", "error", "ok", "ok"]
    env.close()


def test_a_conversation_calls_then_answers_and_the_tool_tokens_are_masked():
    tok = build_char_tokenizer(CHARS)
    env = recording_env()
    engine = ScriptedEngine(tok, [["<calc>4*5</calc>", "20"], ["20"]])
    sampling = OmegaConf.create({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24, "max_model_len": 256})
    out = multi_turn_rollout(engine, tok, [product(4, 5)], env, group_size=2, max_turns=3, rollout_cfg=sampling, seed=0)
    call = tok.encode("<calc>4*5</calc>", add_special_tokens=False) + [tok.eos_token_id]
    shown = tok.encode("?ran 4*5\n", add_special_tokens=False)
    answer = tok.encode("20", add_special_tokens=False) + [tok.eos_token_id]
    assert out.turns == [["<calc>4*5</calc>", "ran 4*5", "20"], ["20"]]
    assert out.completion_ids[0] == call + shown + answer
    assert out.loss_masks[0] == [1] * len(call) + [0] * len(shown) + [1] * len(answer)
    assert out.env_info[0][0]["code"] == "4*5" and out.env_info[0][1]["answer"] == "20"
    assert out.env_info[1] == [{"answer": "20", "tool_time_share_s": out.env_info[1][0]["tool_time_share_s"]}]
    env.close()


def test_metrics_by_hand():
    infos = [[{"code": "a", "status": "ok", "output_tokens": 5, "tool_time_share_s": 0.1},
              {"answer": "1", "tool_time_share_s": 0.1}],
             [{"answer": "2", "tool_time_share_s": 0.1}],
             [{"code": "b", "status": "error", "output_tokens": 3, "tool_time_share_s": 0.1},
              {"code": "c", "status": "timeout", "output_tokens": 7, "tool_time_share_s": 0.1}]]
    m = info_metrics(infos)
    # 3 calls over 3 conversations; 2 of 3 conversations call; 1 of 3 calls ran to its end; (5 + 3 + 7) / 3 tokens.
    assert m == pytest.approx({"tool/calls_mean": 1.0, "tool/call_rate": 2 / 3, "tool/success_rate": 1 / 3,
                               "tool/error_rate": 2 / 3,
                               "tool/errors": 1.0, "tool/timeouts": 1.0, "tool/killed": 0.0, "tool/time_s": 0.5,
                               "tool/output_tokens_mean": 5.0})
    assert "tool/success_rate" not in info_metrics([[{"answer": "1"}]])   # no call: no rate to report


# ------------------------------------------------------------------ demonstrations and chat roles


def test_tool_demonstrations_have_the_token_layout_of_a_call_and_its_answer():
    tok = build_char_tokenizer(CHARS)
    cfg = run_config(max_output_chars=32)
    cfg.interaction.warmup_tool_frac = 0.5
    items = [product(123, 456), product(7, 8)]
    demos = tool_demos(cfg, items, tok, seed=0)
    assert len(demos) == 2                                      # frac 0.5 of 2 + demos examples: 2, one demonstration
    (p1, t1), (p2, t2) = demos
    it = items[0] if p1 == encode_prompt(tok, "123*456=") else items[1]
    a, b = it.prompt[:-1].split("*")
    call = tok.encode(f"<py>{a}*{b}</py>", add_special_tokens=False) + [tok.eos_token_id]
    assert (p1, t1) == (encode_prompt(tok, it.prompt), call)
    assert p2 == encode_prompt(tok, it.prompt) + call + tok.encode(f"?{it.answer}\n", add_special_tokens=False)
    assert t2 == tok.encode(it.answer, add_special_tokens=False) + [tok.eos_token_id]
    assert tok.unk_token_id not in p2 + t1
    assert demo_code(product(12, 34), "fence") == "print(12*34)"
    assert demo_code(TaskItem("x", "1", "1", {}), "tags") is None


def test_a_tool_role_is_written_where_the_template_has_one():
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
                "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = build_char_tokenizer(CHARS)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    configure_tokenizer(tok)
    answer = tok.encode("<tool_call>x</tool_call>", add_special_tokens=False) + [tok.eos_token_id]
    ids = environment_turn_ids(tok, "42", answer_ids=answer, role="tool")
    assert tok.decode(ids) == "\n<tool_response>42</tool_response><|im_start|>assistant\n"


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("overrides,key", [
    (["interaction.tool.isolation=chroot"], "interaction.tool.isolation"),
    (["interaction.tool.call_format=xml"], "interaction.tool.call_format"),
    (["interaction.tool.memory_mb=16"], "interaction.tool.memory_mb"),
    (["interaction.tool.wall_s=0"], "interaction.tool.wall_s"),
    (["interaction.tool.workers=0"], "interaction.tool.workers"),
    (["interaction.tool.name=nope"], "interaction.tool.name"),
    (["interaction.warmup_tool_frac=1.0"], "interaction.warmup_tool_frac=1.0"),
    (["interaction.warmup_tool_frac=0.5", "warmup.max_steps=0"], "warmup.max_steps=0"),
])
def test_bad_tool_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(make(["interaction=python_tool", *overrides]), machine=False)


def test_tool_demonstrations_need_the_tool_environment():
    with pytest.raises(ConfigError, match="has none"):
        validate(make(["interaction.warmup_tool_frac=0.5"]), machine=False)
    with pytest.raises(ConfigError, match="no tool_demo"):
        validate(make(["interaction=verifier_feedback", "interaction.warmup_tool_frac=0.5"]), machine=False)
    validate(make(["experiment=tool_tiny"]), machine=False)
    validate(make(["experiment=tool_smollm2"]), machine=False)


# ------------------------------------------------------------------ a run


def test_two_steps_of_experiment_tool_tiny(tmp_path, monkeypatch):
    """The recipe end to end, shortened: a brief warm-up with tool demonstrations, 2 RL steps; the tool's metrics
    are logged for training and evaluation, and samples.jsonl holds the code, its output and the answer."""
    run_dir = tmp_path / "run"
    code = train_in_process(["experiment=tool_tiny", "logger=none", "trainer.total_steps=2", "trainer.prompts_per_step=8",
                             "rollout.group_size=4", "task.train_size=2000", "task.dev_size=20", "task.test_size=20",
                             "warmup.max_steps=60", "warmup.eval_every=60", "warmup.batch_size=64", "trainer.eval_every=0",
                             "learner.num_threads=1",
                             "trainer.log_samples_every=1", f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}"],
                            monkeypatch)
    assert code == 0, (run_dir / "summary.json").read_text() if (run_dir / "summary.json").exists() else code
    lines = read_metrics(run_dir)
    keys = {"tool/calls_mean", "tool/call_rate", "tool/errors", "tool/timeouts", "tool/killed", "tool/time_s"}
    for m in lines[1:3]:
        assert keys <= set(m), sorted(keys - set(m))
        assert 0.0 <= m["tool/call_rate"] <= 1.0 and m["tool/time_s"] >= 0.0
    assert {"eval/tool/calls_mean", "eval/tool/call_rate"} <= set(lines[0]) & set(lines[-1])
    assert lines[0]["eval/tool/calls_mean"] > 0          # the demonstrations taught the warmed-up model to call
    rows = [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines() if s.strip()]
    calls = [i for r in rows for i in r.get("env_info", []) if "code" in i]
    assert calls and all({"code", "output", "status"} <= set(i) for i in calls)
    assert any("answer" in i for r in rows for i in r.get("env_info", []))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"

