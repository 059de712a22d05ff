"""`python_tool`: the actor may run code between its turns; the tool's output is the next turn.

A conversation (interaction.max_turns actor turns at most)::

    prompt                 123*456=
    actor turn 1           <py>123*456</py>              a call: its code runs in the sandbox
    environment            56088                         stdout, or the error's last line (cut to
                                                         interaction.tool.max_output_chars)
    actor turn 2           56088                         no call: this is the answer, the conversation ends

Any actor turn without a complete call block is the answer (EnvReply.done). The environment is not asked
after the last allowed turn, so a call written then is scored as the answer (wrong). The answer is scored
by the task's verifier like any completion; interaction.reward=final rewards the last turn only.

Call formats (every one is read, whichever `interaction.tool.call_format` names; the first complete block
of a turn is the call; demonstrations and the system prompt use the configured one):

    tags        <py>CODE</py>                                the tiny character model (no chat template)
    fence       ```python\\nCODE\\n```  (or ```py)           chat models without a tool-call convention
                                                             (SmolLM2's template has none)
    tool_call   <tool_call>{"name": "python", "arguments": {"code": "CODE"}}</tool_call>
                                                             templates with the Hermes/Qwen convention;
                                                             the output is then written in the "tool" role

auto picks tags without a chat template, tool_call where the template mentions <tool_call>, else fence.
The code's last line, when it is an expression, is printed as the interactive interpreter prints it
(``123*456`` shows ``56088``), so the tiny model's call is the prompt's expression copied.

Tools are a registry (TOOLS): `python` is the sandboxed interpreter (grpo_lab/interaction/sandbox.py); a
plug-in is named by import path (interaction.tool.name=my_lab.tools:calculator), a factory taking the
interaction.tool settings its signature names and returning an object with run(code) -> ToolResult and
close(). Its facts (or attributes): `tag` (tags format), `fences` (fence labels), `function` (tool_call name).

Per reply the info (samples.jsonl) holds the code, the output shown and the call's status, or, for the
answer, the answer. Metrics (after_step; at evaluation as eval/tool/...): tool/calls_mean (calls per
conversation), tool/call_rate (conversations with a call), tool/success_rate (calls that ran to their end)
and tool/error_rate (the rest), tool/errors, tool/timeouts, tool/killed (counts), tool/time_s (wall seconds the step's replies spent in the
tool), tool/output_tokens_mean (tokens of a tool reply).

Departure: identical code within one reply batch runs once (interaction.tool.dedupe, the default): the G
conversations of a prompt often write the same call, and the sandbox's process start dominates its cost.
Code whose output is not a function of its text (random numbers, the clock) then shows one draw to all.
"""

from __future__ import annotations

import json
import re
import string
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from grpo_lab.interaction import ENVIRONMENTS
from grpo_lab.interaction.base import EnvReply, StepRecord
from grpo_lab.interaction.sandbox import ISOLATIONS, STATUSES, Limits, Sandbox, ToolResult, limits_errors
from grpo_lab.prompts import uses_chat_template
from grpo_lab.registry import Registry

# fn(**interaction.tool settings its signature names) -> object with run(code) -> ToolResult and close().
# Facts: `tag` (tags format: <tag>CODE</tag>), `fences` (labels of a ``` fence), `function` (tool_call name).
TOOLS = Registry("tool", defaults={"tag": "tool", "fences": ("tool",), "function": "tool"})
CALL_FORMATS = ("auto", "tags", "fence", "tool_call")
# Characters of code, outputs and error lines: printable ASCII without the rarer whitespace.
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
NO_OUTPUT = "(no output)"


@TOOLS.register("python", tag="py", fences=("python", "py"), function="python")
def python_sandbox(*, isolation: str, wall_s: float, cpu_s: int, memory_mb: int, max_processes: int,
                   file_size_mb: int, disk_mb: int, max_output_chars: int, workers: int,
                   hide_paths: list[str]) -> Sandbox:
    """The sandboxed Python interpreter with the given limits (interaction.tool.*, whose schema holds the
    defaults)."""
    limits = Limits.of(SimpleNamespace(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=max_processes,
                                       file_size_mb=file_size_mb, disk_mb=disk_mb, max_output_chars=max_output_chars))
    return Sandbox(limits, isolation=isolation, hide_paths=list(hide_paths), workers=workers)


def tool_fact(name: str, key: str) -> Any:
    """A tool's fact: its registration's value, or the plug-in factory's attribute of that name."""
    own = getattr(TOOLS.get(name), key, None)
    return own if own is not None else TOOLS.fact(name, key)


def resolve_call_format(setting: str, tokenizer: Any) -> str:
    """`interaction.tool.call_format` for this tokenizer (module docstring: auto)."""
    if setting != "auto":
        return setting
    if tokenizer is None or not uses_chat_template(tokenizer):
        return "tags"
    return "tool_call" if "<tool_call>" in str(getattr(tokenizer, "chat_template", "") or "") else "fence"


def _tool_call_code(body: str, function: str) -> str | None:
    try:
        call = json.loads(body)
        args = call.get("arguments", call.get("parameters", {}))
        args = json.loads(args) if isinstance(args, str) else args
    except (ValueError, AttributeError):
        return None
    if not isinstance(call, dict) or call.get("name") != function or not isinstance(args, dict):
        return None
    code = args.get("code")
    return code if isinstance(code, str) else None


def extract_call(text: str, *, tag: str = "py", fences: tuple[str, ...] = ("python", "py"),
                 function: str = "python") -> str | None:
    """The code of the first complete call block of `text` in any format (module docstring), or None
    (the turn is an answer). A block must be closed: a turn cut off inside one is an answer."""
    found = []
    m = re.search(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.S)
    if m:
        found.append((m.start(), m.group(1)))
    labels = "|".join(re.escape(f) for f in fences)
    m = re.search(rf"```[ \t]*(?:{labels})[ \t]*\n(.*?)```", text, re.S)
    if m:
        found.append((m.start(), m.group(1)))
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        code = _tool_call_code(m.group(1), function)
        if code is not None:
            found.append((m.start(), code))
            break
    return min(found, key=lambda f: f[0])[1] if found else None


def write_call(code: str, fmt: str, *, tag: str = "py", fences: tuple[str, ...] = ("python", "py"),
               function: str = "python") -> str:
    """The text of a call of `code` in format `fmt` (tags, fence or tool_call): what demonstrations write."""
    if fmt == "tags":
        return f"<{tag}>{code}</{tag}>"
    if fmt == "fence":
        return f"```{fences[0]}\n{code}\n```"
    return "<tool_call>\n" + json.dumps({"name": function, "arguments": {"code": code}}) + "\n</tool_call>"


def tool_message(result: ToolResult, max_chars: int) -> str:
    """What the actor is shown: the output without its trailing whitespace (NO_OUTPUT when empty), or the
    error's last line, or the timeout/killed note, cut to `max_chars` characters."""
    text = result.output.rstrip() if result.ok else result.output.strip()
    return (text or NO_OUTPUT)[:max_chars]


def demo_code(item: Any, fmt: str) -> str | None:
    """Code that computes `item`'s answer, for a tool-use demonstration: the expression of a reasoning-gym
    arithmetic item (metadata["expression"]), written as the prompt writes it (compact prompts drop the
    spaces), inside print() except in the tags format, whose last-expression display shows it; None when
    the item has no expression."""
    entry = item.fields.get("rg_entry")
    expression = ((entry or {}).get("metadata") or {}).get("expression") if isinstance(entry, dict) else None
    if not expression:
        return None
    compact = str(expression).replace(" ", "")
    code = compact if compact in item.prompt else str(expression)
    return code if fmt == "tags" else f"print({code})"


def info_metrics(infos: list[list[dict]], prefix: str = "tool/") -> dict[str, float]:
    """Tool metrics of conversations from their replies' infos (module docstring); rates over no calls
    are left out rather than reported as 0."""
    n = max(len(infos), 1)
    calls = [i for conv in infos for i in conv if "code" in i]
    status = {s: sum(i.get("status") == s for i in calls) for s in STATUSES}
    out = {"calls_mean": len(calls) / n,
           "call_rate": sum(any("code" in i for i in conv) for conv in infos) / n,
           "errors": float(status["error"]), "timeouts": float(status["timeout"]), "killed": float(status["killed"]),
           "time_s": float(sum(i.get("tool_time_share_s", 0.0) for conv in infos for i in conv))}
    if calls:
        out["success_rate"] = status["ok"] / len(calls)
        out["error_rate"] = 1.0 - out["success_rate"]     # errors, timeouts and kills together
        out["output_tokens_mean"] = sum(i.get("output_tokens", 0) for i in calls) / len(calls)
    return {prefix + k: float(v) for k, v in out.items()}


class PythonTool:
    """Environment (grpo_lab.interaction.base.Environment) running the actor's calls (module docstring)."""

    alphabet = ALPHABET

    @staticmethod
    def config_errors(cfg: Any, machine: bool = True) -> list[str]:
        """What is wrong with the run's interaction.tool section (checked with the config); with `machine`,
        also whether a named isolation mode (namespaces, userns) works on this machine: one trial call, so a
        run asking for a boundary this machine cannot give fails before its warm-up, not at its first call."""
        from grpo_lab.registry import check_registered

        t, errors = cfg.interaction.tool, []
        check_registered(TOOLS, t.name, "interaction.tool.name", errors)
        if t.isolation not in ISOLATIONS:
            errors.append(f"interaction.tool.isolation={t.isolation!r}; valid: {', '.join(ISOLATIONS)}")
        if t.call_format not in CALL_FORMATS:
            errors.append(f"interaction.tool.call_format={t.call_format!r}; valid: {', '.join(CALL_FORMATS)}")
        errors += limits_errors(Limits.of(t))
        if not (isinstance(t.workers, int) and t.workers >= 1):
            errors.append(f"interaction.tool.workers={t.workers!r} must be an integer >= 1 (calls run at once)")
        if machine and not errors and t.isolation in ("namespaces", "userns"):
            try:
                Sandbox(Limits.of(t), isolation=t.isolation).close()
            except RuntimeError as e:
                errors.append(str(e))
        return errors

    @staticmethod
    def tool_demo(cfg: Any, item: Any, tokenizer: Any) -> tuple[str, str, str] | None:
        """(the actor's call, the tool's reply, its chat role) demonstrating a call for `item`, or None
        (grpo_lab.interaction.demos.tool_demos). The reply is the item's reference answer, which is what the
        expression prints: the warm-up runs no code."""
        t = cfg.interaction.tool
        fmt = resolve_call_format(t.call_format, tokenizer)
        code = demo_code(item, fmt)
        if code is None:
            return None
        call = write_call(code, fmt, **_syntax(t.name))
        return call, str(item.answer).strip()[: int(t.max_output_chars)], "tool" if fmt == "tool_call" else "user"

    def __init__(self, cfg: Any, *, tokenizer: Any = None, task: Any = None):
        del task
        t = cfg.interaction.tool
        errors = self.config_errors(cfg)
        if errors:
            from grpo_lab.schema import ConfigError

            raise ConfigError("interaction.tool:\n  " + "\n  ".join(errors))
        self.tokenizer = tokenizer
        self.max_chars = int(t.max_output_chars)
        self.dedupe = bool(t.dedupe)
        self.syntax = _syntax(t.name)
        self.format = resolve_call_format(t.call_format, tokenizer)
        self.role = "tool" if self.format == "tool_call" else "user"
        settings = {k: getattr(t, k) for k in ("isolation", "wall_s", "cpu_s", "memory_mb", "max_processes",
                                               "file_size_mb", "disk_mb", "max_output_chars", "workers")}
        self.tool = TOOLS.call(t.name, **settings, hide_paths=list(t.hide_paths))
        mode = getattr(self.tool, "mode", None)
        if mode == "rlimits" and t.isolation == "auto":
            print("warning: interaction.tool.isolation=auto found no namespaces on this machine: tool calls run "
                  "with resource limits and a Python audit hook only (grpo_lab/interaction/sandbox.py)", flush=True)
        self.pool = ThreadPoolExecutor(max_workers=int(t.workers), thread_name_prefix="tool")

    def _tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def reply(self, items: list, conversations: list[list[str]], *, seed: int, greedy: bool) -> list[EnvReply]:
        """Run every conversation's call (at most `workers` at once; identical code once with dedupe);
        a conversation whose last turn holds no call ends (done)."""
        del items, seed, greedy   # the tool reads only the code
        started = time.monotonic()
        codes = [extract_call(conv[-1], **self.syntax) for conv in conversations]
        todo = [c for c in codes if c is not None]
        if self.dedupe:
            todo = list(dict.fromkeys(todo))
        results = list(self.pool.map(self.tool.run, todo))
        by_code = dict(zip(todo, results)) if self.dedupe else None
        share = (time.monotonic() - started) / max(len(conversations), 1)
        replies, k = [], 0
        for conv, code in zip(conversations, codes):
            if code is None:
                replies.append(EnvReply(done=True, info={"answer": conv[-1], "tool_time_share_s": share}))
                continue
            result = by_code[code] if by_code is not None else results[k]
            k += 1
            message = tool_message(result, self.max_chars)
            replies.append(EnvReply(message=message, role=self.role, info={
                "code": code, "output": message, "status": result.status, "call_time_s": round(result.time_s, 4),
                "output_tokens": self._tokens(message), "tool_time_share_s": share}))
        return replies

    def info_metrics(self, infos: list[list[dict]]) -> dict[str, float]:
        return info_metrics(infos)

    def after_step(self, step: int, record: StepRecord) -> dict[str, float]:
        return info_metrics(record.infos)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        getattr(self.tool, "close", lambda: None)()


def _syntax(name: str) -> dict:
    return {"tag": tool_fact(name, "tag"), "fences": tuple(tool_fact(name, "fences")),
            "function": tool_fact(name, "function")}


ENVIRONMENTS.register("python_tool", learns=False, needs_reference=False, alphabet=ALPHABET,
                       reads=("tool", "warmup_tool_frac"))(PythonTool)
