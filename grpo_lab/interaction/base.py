"""What a multi-turn environment is: the contract between the rollout loop and anything that answers
the actor between its turns (the task's verifier, a critic LLM, a tool, a user's plug-in).

A conversation for one sequence is a list of turns, alternating actor and environment::

    [actor answer 1, environment message 1, actor answer 2, ...]

and the rollout loop asks the environment, for a batch of conversations at once (a critic LLM wants
one batched generate call, not N), what comes next (`Environment.reply`). Each reply is an
`EnvReply`: a message for the actor (`message`, the text of the next user turn) or `done=True`,
optionally a `verdict` (the environment's own judgement of the last answer: True = correct), and
optional extras for samples.jsonl / metrics.

After each training step the loop hands the environment what happened (`Environment.after_step`) so
an environment that learns (a critic LLM trained alongside the actor) can update on its own rhythm;
an environment with state saves it in the run's checkpoints (`state_dict` / `load_state_dict`).

Environments are registered in `ENVIRONMENTS` (grpo_lab/interaction/__init__.py) by name; a user's
environment is named by import path (`interaction.environment=my_lab.envs:Hints`), as rewards and
tasks are. The registry's facts say what the rest of the lab must know about an entry
(`learns`: it trains during the run and has optimizer state to checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class EnvReply:
    """The environment's answer to one conversation after an actor turn."""

    message: str | None = None        # text of the next user turn; None when done
    done: bool = False                # True: the conversation ends after this actor turn
    verdict: bool | None = None       # the environment's judgement of the last answer (True = correct)
    info: dict[str, Any] = field(default_factory=dict)   # extras for samples.jsonl (e.g. the critic's raw text)
    role: str = "user"                # the chat role the message is written in (a tool's output: "tool")


@dataclass
class StepRecord:
    """One training step's conversations, handed to `Environment.after_step`: per sequence, the task
    item, every actor answer and every environment message, and the task reward of every actor turn."""

    items: list                       # [N] TaskItem of each sequence
    group_ids: list[int]              # [N]
    answers: list[list[str]]          # [N][turns] actor texts
    messages: list[list[str]]         # [N][turns - 1] environment texts between them
    turn_rewards: list[list[float]]   # [N][turns] task reward of each actor answer (clean, before noise)
    verdicts: list[list[bool | None]]  # [N][turns - 1] the environment's verdict on each answer it replied to
    infos: list[list[dict]] = field(default_factory=list)   # [N][turns - 1] each reply's EnvReply.info


class Environment(Protocol):
    """Constructed once per run as `cls(cfg, *, tokenizer, task)`; see the module docstring."""

    def reply(self, items: list, conversations: list[list[str]], *, seed: int, greedy: bool) -> list[EnvReply]:
        """One reply per conversation (items[i]'s conversation so far, ending with an actor answer)."""
        ...

    def after_step(self, step: int, record: StepRecord) -> dict[str, float]:
        """Learn from a training step (or nothing); returns metrics (e.g. critic/loss)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...
