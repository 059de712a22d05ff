"""The multi-turn rollout: G conversations per prompt, each up to `max_turns` actor answers with the
environment's message between two of them.

Turn 1 is the usual grouped sample (`engine.generate(prompts, n=G)`). After each turn the environment
replies to every conversation not yet done, in one batched call; each conversation it did not end
continues from its own token history, never re-tokenized:

    next prompt = prompt ids + every earlier turn's ids (answers as sampled, messages as formatted by
                  grpo_lab.prompts.environment_turn_ids) ,   sampled with n=1, seeded per turn

The environment is not asked after the last allowed turn (nothing would follow its message). A
conversation whose next turn would not fit the engine's context (prompt + history + message +
max_new_tokens > rollout.max_model_len) ends where it is, as verl's multi-turn rollout ends one at its
length budget, instead of failing the whole batch in the engine; its last reply's info says
`context_full` (the step's interaction/context_full metric counts them). The result keeps the
single-turn Rollout's grouped shape (see grpo_lab.rollout.base.Rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_lab.prompts import encode_prompt, environment_turn_ids
from grpo_lab.rollout import Rollout

# Turn t (>= 2) samples with seed + t · TURN_SEED_STRIDE: a stream of its own, the same on a resume.
TURN_SEED_STRIDE = 7_727


@dataclass
class _Conversation:
    """One sequence's growing state."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    info: list[dict] = field(default_factory=list)
    truncated: bool = False
    done: bool = False

    def add_answer(self, ids: list[int], logprobs: list[float], text: str, truncated: bool) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs) if logprobs else [0.0] * len(ids)
        self.turns.append(text)
        self.truncated = truncated

    def add_message(self, ids: list[int], text: str) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns.append(text)


def multi_turn_rollout(engine, tokenizer, items: list, env, *, group_size: int, max_turns: int, rollout_cfg: Any,
                       seed: int, logprobs: bool = True, greedy: bool = False) -> Rollout:
    """G conversations for each of `items` with environment `env` (module docstring) -> Rollout with
    loss_masks, turns, verdicts and env_info. `rollout_cfg` gives temperature, top_p and max_new_tokens
    (per actor turn); `greedy` tells the environment it serves a greedy evaluation."""
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items]
    sample = dict(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                  max_new_tokens=rollout_cfg.max_new_tokens, logprobs=logprobs)
    first = engine.generate(prompts, n=group_size, seed=seed, **sample)
    convs = [_Conversation() for _ in range(len(first))]
    for k, conv in enumerate(convs):
        conv.add_answer(first.completion_ids[k], first.sampler_logprobs[k], first.texts[k], first.truncated[k])
    group_ids = list(first.group_ids)
    for turn in range(2, max_turns + 1):
        active = [k for k, c in enumerate(convs) if not c.done]
        if not active:
            break
        replies = env.reply([items[group_ids[k]] for k in active], [list(convs[k].turns) for k in active],
                            seed=seed + turn * TURN_SEED_STRIDE, greedy=greedy)
        if len(replies) != len(active):
            raise ValueError(f"environment {type(env).__name__}.reply returned {len(replies)} replies for "
                             f"{len(active)} conversations; it must return one per conversation")
        going = []
        for k, reply in zip(active, replies):
            conv = convs[k]
            conv.verdicts.append(reply.verdict)
            conv.info.append(dict(reply.info))
            if reply.done or reply.message is None:
                conv.done = True
                continue
            message_ids = environment_turn_ids(tokenizer, reply.message, answer_ids=conv.ids,
                                               role=getattr(reply, "role", "user"))
            context = len(prompts[group_ids[k]]) + len(conv.ids) + len(message_ids) + rollout_cfg.max_new_tokens
            if context > rollout_cfg.max_model_len:
                conv.info[-1]["context_full"] = True
                conv.done = True
                continue
            conv.add_message(message_ids, reply.message)
            going.append(k)
        if not going:
            break
        out = engine.generate([prompts[group_ids[k]] + convs[k].ids for k in going], n=1,
                              seed=seed + turn * TURN_SEED_STRIDE, **sample)
        for j, k in enumerate(going):
            convs[k].add_answer(out.completion_ids[j], out.sampler_logprobs[j], out.texts[j], out.truncated[j])
    return Rollout([list(prompts[g]) for g in group_ids], [c.ids for c in convs], [c.logprobs for c in convs],
                   [c.turns[-1] for c in convs], group_ids, [c.truncated for c in convs], dict(first.meta),
                   loss_masks=[c.mask for c in convs], turns=[c.turns for c in convs],
                   verdicts=[c.verdicts for c in convs], env_info=[c.info for c in convs])
