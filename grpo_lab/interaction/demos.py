"""Revision and tool-use demonstrations for the warm-up SFT: examples that teach a model the multi-turn
format before RL (interaction.warmup_revision_frac, interaction.warmup_tool_frac).

One demonstration of a train item: the prompt, a wrong answer to it (`verifier.wrong_answer`), the
environment's message to that answer (its `demo_message`), and then, as the supervised target, the
item's worked solution:

    prompt ids + wrong answer ids (+ <eos>) + environment_turn_ids(message)  ->  solution ids + <eos>

so the model sees exactly the token layout of a multi-turn rollout's second turn and learns that a
message after its answer asks for a new one. The tiny character model needs this (it never saw a
second turn); warm-starting the revising turn with supervised demonstrations is also how SCoRe's
baselines and Self-Correct start (Welleck et al. 2022, arXiv 2211.00053: a corrector trained on (wrong,
better) pairs). interaction.warmup_demos_from writes them in the words of several environments in turn:
one warm-up for rows that run different environments, or none, so that their differences pair by seed.

A tool-use demonstration (`tool_demos`, for an environment with a `tool_demo`: python_tool) is two
supervised examples of one train item, the call and the answer after the tool's reply:

    prompt ids                                                    ->  call ids + <eos>
    prompt ids + call ids (+ <eos>) + environment_turn_ids(reply) ->  solution ids + <eos>

the reply being the item's reference answer (what the call prints: the warm-up runs no code). Toolformer
(Schick et al. 2023, arXiv 2302.04761) and ReAct (arXiv 2210.03629) likewise start from demonstrated calls;
without them a from-scratch character model has never seen the call format, and RL can only reward calls it
samples (the tools table's tool_rl_only row tests whether it finds them anyway).
"""

from __future__ import annotations

import random
from typing import Any

from grpo_lab.interaction import ENVIRONMENTS, demo_environments
from grpo_lab.interaction.verifier import wrong_answer
from grpo_lab.learner.batch import encode_prompt, encode_target
from grpo_lab.prompts import environment_turn_ids

# Wrong answers lie within this distance of the reference (or are its negation): near misses, which the
# environments' messages ("too high", "too low") can say something useful about.
MAX_OFFSET = 10


def demo_count(n_items: int, frac: float) -> int:
    """Demonstrations to add to `n_items` plain examples so that they are `frac` of all examples."""
    return round(n_items * frac / (1.0 - frac)) if frac > 0 else 0


def has_demo_message(name: str | None) -> bool:
    """Whether the environment can say what it answers to a given answer (a `demo_message` method)."""
    return name is not None and callable(getattr(ENVIRONMENTS.get(name), "demo_message", None))


def has_tool_demo(name: str | None) -> bool:
    """Whether the environment can demonstrate a tool call for an item (a `tool_demo` method)."""
    return name is not None and callable(getattr(ENVIRONMENTS.get(name), "tool_demo", None))


def tool_demos(cfg: Any, items: list, tokenizer: Any, *, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of the run's tool-use demonstrations (module docstring): none when
    interaction.warmup_tool_frac is 0; otherwise demo_count(len(items), frac) examples (two per
    demonstrated item), items drawn with replacement from a generator seeded by `seed` among those the
    environment can demonstrate. Raises ValueError when it can demonstrate none of them."""
    n = demo_count(len(items), float(cfg.interaction.warmup_tool_frac))
    name = cfg.interaction.environment
    if not n or not has_tool_demo(name):
        return []
    demo = ENVIRONMENTS.get(name).tool_demo
    shown = [(it, d) for it in items for d in [demo(cfg, it, tokenizer)] if d is not None]
    if not shown:
        raise ValueError(f"interaction.warmup_tool_frac={cfg.interaction.warmup_tool_frac}: environment {name} "
                         "can demonstrate no train item of this task (python_tool needs arithmetic items that carry "
                         "their expression, e.g. reasoning-gym products or chain_sum); set interaction.warmup_tool_frac=0")
    rng, eos = random.Random(seed), tokenizer.eos_token_id
    demos = []
    for _ in range((n + 1) // 2):
        item, (call, reply, role) = rng.choice(shown)
        prompt = encode_prompt(tokenizer, item.prompt)
        call_ids = tokenizer.encode(call, add_special_tokens=False) + [eos]
        turn = environment_turn_ids(tokenizer, reply, answer_ids=call_ids, role=role)
        demos += [(prompt, call_ids), (prompt + call_ids + turn, encode_target(tokenizer, item.solution))]
    return demos


def revision_demos(cfg: Any, items: list, tokenizer: Any, *, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of the run's revision demonstrations (module docstring): none when
    interaction.warmup_revision_frac is 0 or there is no environment to write them in; otherwise
    demo_count(len(items), frac) of them, items drawn with replacement from a generator seeded by `seed`,
    the k-th in the words of the k-th environment of `demo_environments` (cycling), so that rows naming the
    same interaction.warmup_demos_from get the same demonstrations whatever environment they run."""
    n = demo_count(len(items), float(cfg.interaction.warmup_revision_frac))
    names = demo_environments(cfg.interaction)
    if not n or not names:   # single-turn without named environments: nothing to demonstrate
        return []
    messages_of = [ENVIRONMENTS.get(name).demo_message for name in names]
    rng, eos = random.Random(seed), tokenizer.eos_token_id
    demos = []
    for k in range(n):
        item = rng.choice(items)
        wrong = wrong_answer(item, rng, max_offset=MAX_OFFSET, others=items)
        answer_ids = tokenizer.encode(wrong, add_special_tokens=False) + [eos]
        message = messages_of[k % len(messages_of)](cfg, item, wrong)
        turn = environment_turn_ids(tokenizer, message, answer_ids=answer_ids)
        demos.append((encode_prompt(tokenizer, item.prompt) + answer_ids + turn, encode_target(tokenizer, item.solution)))
    return demos
