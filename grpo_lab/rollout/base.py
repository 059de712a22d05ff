"""The rollout protocol: what every engine returns and accepts, so the learner never knows which ran.

An engine samples G completions per prompt (token ids in, token ids + the sampler's own logprobs
out) and accepts new weights in memory after each learner update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class Rollout:
    """N = len(prompts) × n sequences, grouped: sequence k belongs to prompt group_ids[k].

    Completion token ids include the EOS token when the sampler stopped on it (the policy must
    learn to stop), and exclude it when the completion was cut at max_new_tokens (`truncated`).
    `sampler_logprobs[k][t]` is the engine's log π(token_t | prefix) of the distribution it sampled
    from (after temperature), which the learner uses as π_old.

    A multi-turn rollout (grpo_lab.interaction) keeps this shape: `prompt_ids` is the original prompt,
    `completion_ids` every turn concatenated (actor answers and the environment's messages between
    them), `loss_masks[k][t]` 1 at the actor's tokens and 0 at the environment's (whose sampler
    logprobs are 0), `turns[k]` the texts [answer 1, message 1, answer 2, ...], `verdicts[k]` the
    environment's verdict on each answer it replied to, `env_info[k]` its extras per reply, and
    `texts[k]` / `truncated[k]` the last answer's. All four are None for single-turn rollouts.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    texts: list[str]
    group_ids: list[int]
    truncated: list[bool]
    # Extra per-sequence data filled by later phases (rewards, advantages) lives elsewhere; this is
    # only what the engine saw and produced.
    meta: dict = field(default_factory=dict)
    loss_masks: list[list[int]] | None = None
    turns: list[list[str]] | None = None
    verdicts: list[list[bool | None]] | None = None
    env_info: list[list[dict]] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def select(self, keep: list[int]) -> "Rollout":
        """The sub-rollout of the sequences at indices `keep` (e.g. DAPO's informative groups)."""
        pick = lambda xs: None if xs is None else [xs[i] for i in keep]  # noqa: E731
        return Rollout(pick(self.prompt_ids), pick(self.completion_ids), pick(self.sampler_logprobs),
                       pick(self.texts), pick(self.group_ids), pick(self.truncated), dict(self.meta),
                       **{k: pick(getattr(self, k)) for k in _TURN_FIELDS})

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        out = Rollout([], [], [], [], [], [], dict(parts[0].meta) if parts else {})
        for p in parts:
            out.prompt_ids += p.prompt_ids
            out.completion_ids += p.completion_ids
            out.sampler_logprobs += p.sampler_logprobs
            out.texts += p.texts
            out.group_ids += p.group_ids
            out.truncated += p.truncated
        if any(p.loss_masks is not None for p in parts):   # a single-turn part: every token the actor's
            out.loss_masks = [m for p in parts for m in (p.loss_masks or [[1] * len(c) for c in p.completion_ids])]
            out.turns = [t for p in parts for t in (p.turns or [[x] for x in p.texts])]
            out.verdicts = [v for p in parts for v in (p.verdicts or [[] for _ in p.texts])]
            out.env_info = [v for p in parts for v in (p.env_info or [[] for _ in p.texts])]
        return out


# The optional per-sequence fields of a multi-turn rollout.
_TURN_FIELDS = ("loss_masks", "turns", "verdicts", "env_info")


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        """Sample `n` completions per prompt; temperature 0 means greedy. group_ids = prompt index."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in memory with the learner's (same names as the HF model)."""
        ...

    def close(self) -> None:
        ...
