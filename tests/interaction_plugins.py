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
