"""The reward of a multi-turn conversation, from the task reward of each of its actor answers.

Every actor answer is scored as a single-turn completion is (the weighted `reward.weights`, failures
contained: grpo_lab.rewards.compute_rewards); `interaction.reward` names how a conversation's turn
rewards r_1 … r_K become its one scalar (registry TURN_REWARDS, pure functions on tensors):

    final        r_K                          only where the conversation ends counts
    each_turn    (r_1 + … + r_K) / K          every answer counts, the first as much as the revision
    improvement  r_K + α·(r_K − r_1)          SCoRe's reward-shaping bonus (Kumar et al., arXiv 2409.12917):
                                              wrong → right earns extra, right → wrong is penalised
                                              beyond a plain wrong answer (α = interaction.improvement_coef)

`reward.noise` then applies to that scalar (training only) and the clean correctness of metrics is the
last answer's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_lab.interaction.base import StepRecord
from grpo_lab.registry import Registry
from grpo_lab.rewards import compute_rewards, contained_settings, is_correct

# fn(turn_rewards [N, K] (0 past a conversation's last turn), n_turns LongTensor [N] (>= 1), *, settings) -> [N]
TURN_REWARDS = Registry("multi-turn reward")


def _last(turn_rewards: Tensor, n_turns: Tensor) -> Tensor:
    return turn_rewards.gather(1, (n_turns - 1).clamp(min=0)[:, None]).squeeze(1)


@TURN_REWARDS.register("final")
def final(turn_rewards: Tensor, n_turns: Tensor) -> Tensor:
    """r_K: the last answer's reward."""
    return _last(turn_rewards, n_turns)


@TURN_REWARDS.register("each_turn")
def each_turn(turn_rewards: Tensor, n_turns: Tensor) -> Tensor:
    """Mean reward over the conversation's K actor turns."""
    real = torch.arange(turn_rewards.shape[1])[None, :] < n_turns[:, None]
    return (turn_rewards * real).sum(1) / n_turns.clamp(min=1).to(turn_rewards.dtype)


@TURN_REWARDS.register("improvement")
def improvement(turn_rewards: Tensor, n_turns: Tensor, *, improvement_coef: float = 1.0) -> Tensor:
    """r_K + α·(r_K − r_1) (SCoRe, arXiv 2409.12917); a one-turn conversation gets r_1."""
    last = _last(turn_rewards, n_turns)
    return last + improvement_coef * (last - turn_rewards[:, 0])


def padded_turns(per_sequence: list[list[float]]) -> tuple[Tensor, Tensor]:
    """Ragged turn rewards -> ([N, K] float32 padded with 0, n_turns [N])."""
    k = max((len(r) for r in per_sequence), default=1)
    out = torch.zeros(len(per_sequence), max(k, 1))
    for i, r in enumerate(per_sequence):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out, torch.tensor([len(r) for r in per_sequence], dtype=torch.long)


def actor_answers(rollout) -> list[list[str]]:
    """Per sequence, its actor answers (turns 0, 2, 4, ... of Rollout.turns)."""
    return [list(t[0::2]) for t in rollout.turns]


def score_turns(rollout, seq_items: list, reward_cfg: Any,
                interaction_cfg: Any) -> tuple[Tensor, Tensor, dict, dict[str, list], dict]:
    """(reward [N] by interaction.reward, clean correctness of the last answer [N], per-sample info, each
    reward function's values of the last answers, the failure counts over every answer scored). info
    holds turn_rewards and turn_correct (per sequence, per actor turn) and the reward functions' extras
    of each last answer."""
    answers = actor_answers(rollout)
    owner = [k for k, a in enumerate(answers) for _ in a]
    texts = [t for a in answers for t in a]
    result = compute_rewards(texts, [seq_items[k] for k in owner], list(reward_cfg.weights.items()),
                             **contained_settings(reward_cfg))
    total, per_fn = result
    ends = torch.tensor([len(a) for a in answers]).cumsum(0)
    starts, lasts = (ends - torch.tensor([len(a) for a in answers])).tolist(), (ends - 1).tolist()
    turn_rewards = [list(map(float, total[s:e])) for s, e in zip(starts, ends.tolist())]
    turn_correct = [[bool(is_correct(t, seq_items[k])) for t in a] for k, a in enumerate(answers)]
    padded, n_turns = padded_turns(turn_rewards)
    rewards = TURN_REWARDS.call(interaction_cfg.reward, padded, n_turns,
                                improvement_coef=float(interaction_cfg.improvement_coef)).float()
    correct = torch.tensor([float(c[-1]) for c in turn_correct])
    info = {key: [values[i] for i in lasts] for key, values in result.info.items()}
    info.update(turn_rewards=turn_rewards, turn_correct=turn_correct)
    last_per_fn = {name: [values[i] for i in lasts] for name, values in per_fn.items()}
    return rewards, correct, info, last_per_fn, result.metrics


def step_record(scored) -> StepRecord:
    """What Environment.after_step receives about a step's scored conversations."""
    r = scored.rollout
    return StepRecord(items=list(scored.items), group_ids=list(r.group_ids), answers=actor_answers(r),
                      messages=[list(t[1::2]) for t in r.turns], turn_rewards=list(scored.info["turn_rewards"]),
                      verdicts=[list(v) for v in r.verdicts], infos=[list(i) for i in (r.env_info or [])])


def conversation_metrics(turn_correct: list[list[bool]], loss_masks: list[list[int]] | None = None,
                         prefix: str = "interaction/") -> dict[str, float]:
    """first_acc, final_acc, wrong_to_right, right_to_wrong (fractions of sequences), revision_gain
    (final_acc − first_acc = wrong_to_right − right_to_wrong), turns_mean (actor
    turns) and, with loss masks, env_tokens_mean (environment tokens per sequence)."""
    n = max(len(turn_correct), 1)
    first = [c[0] for c in turn_correct]
    last = [c[-1] for c in turn_correct]
    out = {"first_acc": sum(first) / n, "final_acc": sum(last) / n,
           "wrong_to_right": sum((not f) and l for f, l in zip(first, last)) / n,
           "right_to_wrong": sum(f and not l for f, l in zip(first, last)) / n,
           "revision_gain": (sum(last) - sum(first)) / n,
           "turns_mean": sum(len(c) for c in turn_correct) / n}
    if loss_masks is not None:
        out["env_tokens_mean"] = sum(len(m) - sum(m) for m in loss_masks) / n
    return {prefix + k: float(v) for k, v in out.items()}


def turn_metrics(scored) -> dict[str, float]:
    """interaction/ metrics of a step's scored conversations, and context_full (the fraction ended early
    because the next turn would not fit rollout.max_model_len); {} for a single-turn rollout."""
    r = scored.rollout
    if r.turns is None:
        return {}
    full = [any(info.get("context_full") for info in conv) for conv in (r.env_info or [])]
    return {**conversation_metrics(scored.info["turn_correct"], r.loss_masks),
            "interaction/context_full": sum(full) / max(len(full), 1)}
