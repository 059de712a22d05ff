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

    def __len__(self) -> int:
        return len(self.completion_ids)

    def select(self, keep: list[int]) -> "Rollout":
        """The sub-rollout of the sequences at indices `keep` (e.g. DAPO's informative groups)."""
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return Rollout(pick(self.prompt_ids), pick(self.completion_ids), pick(self.sampler_logprobs),
                       pick(self.texts), pick(self.group_ids), pick(self.truncated), dict(self.meta))

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
        return out


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
