"""A user's multi-turn environment, named by import path in tests (interaction.environment=interaction_plugins:Hint)."""

from grpo_lab.interaction import ENVIRONMENTS, EnvReply


class Hint:
    """Always answers "hint: retry"; counts the training steps it was shown (its checkpointed state)."""

    alphabet = ENVIRONMENTS.fact("verifier_feedback", "alphabet")   # the same tiny model as verifier_feedback runs

    def __init__(self, cfg=None, *, tokenizer=None, task=None):
        self.steps = 0

    def reply(self, items, conversations, *, seed, greedy):
        return [EnvReply(message="hint: retry", verdict=None, info={"seen": len(c)}) for c in conversations]

    def after_step(self, step, record):
        self.steps += 1
        return {"hint/steps": float(self.steps), "hint/answers": float(sum(map(len, record.answers)))}

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state.get("steps", 0)

    def close(self):
        pass


class Recorder:
    """A user's tool, named by import path (interaction.tool.name=interaction_plugins:recording_tool): answers
    "ran <code>" without running anything, or "error: <code>" for code starting with "!"; records its calls."""

    tag, fences, function = "calc", ("calc",), "calc"

    def __init__(self, max_output_chars):
        self.max_output_chars, self.calls = max_output_chars, []

    def run(self, code):
        from grpo_lab.interaction.sandbox import ToolResult

        self.calls.append(code)
        if code.startswith("!"):
            return ToolResult("error", f"error: {code}"[: self.max_output_chars], error=f"error: {code}")
        return ToolResult("ok", f"ran {code}\n"[: self.max_output_chars], stdout=f"ran {code}\n")

    def close(self):
        pass


def recording_tool(max_output_chars=200):
    return Recorder(max_output_chars)


recording_tool.tag, recording_tool.fences, recording_tool.function = Recorder.tag, Recorder.fences, Recorder.function
