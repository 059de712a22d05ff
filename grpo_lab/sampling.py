"""The sampling pipeline of one RL step: prompts -> rollout -> rewards -> dynamic sampling -> the
learner's batch. The train loop takes each step's scored rollouts from here and does the rest:

    PromptStream ─▶ rollout_phase ─▶ reward_phase      (GroupSampler: one round of k prompts × G)
                 ─▶ collect_phase (DAPO dynamic sampling: rounds until enough informative groups)
                 ─▶ to_learner_batch
    RolloutPipeline runs sample_step for the loop, synchronously or one step ahead (max_staleness=1);
    RewardNormalizer and rollout_metrics are the loop's reward EMA and rollout/ metrics. What follows
    (Learner.score ─▶ objective.prepare ─▶ Learner.update ─▶ sync) is grpo_lab/train.py's; held-out
    evaluation is grpo_lab/evaluation.py.

No formula lives here: the math is in grpo_lab/algos, reached through its registries; what an
objective does with a scored batch is in grpo_lab/objectives.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import dataclass, field

import torch

from grpo_lab.algos import ema_reward_normalize, group_stats, informative_group_mask, soft_overlong_penalty
from grpo_lab.interaction import multi_turn_rollout, score_turns, turn_metrics
from grpo_lab.learner.batch import TensorBatch, collate, encode_prompt
from grpo_lab.rewards import RewardScorer, is_correct, stop_reward_worker
from grpo_lab.rewards.noise import REWARD_NOISE, noise_metrics
from grpo_lab.rollout import Rollout
from grpo_lab.schema import as_dict


class PromptStream:
    """Endless stream of training items: shuffled passes over the train split (seeded)."""

    def __init__(self, items: list, seed: int):
        self.items, self.rng, self.order = items, random.Random(seed), []

    def take(self, k: int) -> list:
        out = []
        while len(out) < k:
            if not self.order:
                self.order = list(range(len(self.items)))
                self.rng.shuffle(self.order)
            out.append(self.items[self.order.pop()])
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])


@dataclass
class ScoredRollout:
    """A rollout with, per sequence, its task item and its (shaped) scalar reward."""

    rollout: Rollout
    items: list
    rewards: torch.Tensor                     # [N] reward used for learning (after shaping)
    correct: torch.Tensor                     # [N] 1.0 where the task's scorer says correct
    # Per-sample extras the reward functions returned, e.g. {"llm_judge/feedback": [N texts]}.
    info: dict = field(default_factory=dict)

    def select(self, keep: list[int]) -> "ScoredRollout":
        return ScoredRollout(self.rollout.select(keep), [self.items[i] for i in keep],
                             self.rewards[keep], self.correct[keep],
                             {k: [v[i] for i in keep] for k, v in self.info.items()})

    def sample_rows(self, limit: int) -> list[dict]:
        """The first `limit` samples as readable rows (prompt, completion, reward, answer, correct, group,
        and the reward functions' extras), for samples.jsonl and the wandb samples table."""
        r = self.rollout
        return [{"group": r.group_ids[i], "prompt": self.items[i].prompt, "completion": r.texts[i],
                 "reward": float(self.rewards[i]), "answer": self.items[i].answer, "correct": bool(self.correct[i]),
                 **({"turns": r.turns[i]} if r.turns is not None else {}),
                 **({"env_info": r.env_info[i]} if r.env_info is not None else {}),
                 **{k: v[i] for k, v in self.info.items()}} for i in range(min(limit, len(r)))]

    @staticmethod
    def concat(parts: list["ScoredRollout"]) -> "ScoredRollout":
        offset, shifted = 0, []
        for p in parts:  # keep group ids unique across sampling rounds
            r = p.rollout.select(list(range(len(p.rollout))))
            r.group_ids = [g + offset for g in r.group_ids]
            offset = max(r.group_ids, default=offset - 1) + 1
            shifted.append(r)
        keys = set().union(*(p.info for p in parts))
        info = {k: [x for p in parts for x in p.info.get(k, [None] * len(p.rollout))] for k in keys}
        return ScoredRollout(Rollout.concat(shifted), [i for p in parts for i in p.items],
                             torch.cat([p.rewards for p in parts]), torch.cat([p.correct for p in parts]), info)


def rollout_phase(engine, tokenizer, items: list, rollout_cfg, *, group_size: int, seed: int,
                  environment=None, max_turns: int = 1) -> Rollout:
    """Sample `group_size` completions for each item's prompt; with an `environment`, `group_size`
    conversations of up to `max_turns` actor answers each (grpo_lab.interaction.multi_turn_rollout)."""
    if environment is not None:
        return multi_turn_rollout(engine, tokenizer, items, environment, group_size=group_size, max_turns=max_turns,
                                  rollout_cfg=rollout_cfg, seed=seed)
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items]
    return engine.generate(prompts, n=group_size, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                           max_new_tokens=rollout_cfg.max_new_tokens, seed=seed)


def reward_phase(rollout: Rollout, items: list, reward_cfg, algo_cfg, *, max_new_tokens: int, seed: int,
                 interaction_cfg=None, judge_seed: int = 0, scorer: RewardScorer | None = None
                 ) -> tuple[ScoredRollout, dict]:
    """Weighted sum of the registered reward functions (each sample contained: a function that raises,
    returns NaN or times out scores `reward.on_error` and is counted), then `reward.noise` (its draws
    seeded by the rollout's `seed`, the judge's fixed per-prompt bias by the run's `judge_seed`), plus
    DAPO's soft overlong punishment. A multi-turn rollout scores every
    actor answer and combines them by `interaction.reward` (grpo_lab.interaction.score_turns). `scorer`: the
    run's reward functions, looked up once (GroupSampler's); None looks them up for this call."""
    seq_items = [items[g] for g in rollout.group_ids]
    if rollout.turns is not None:
        rewards, correct, info, per_fn, failures = score_turns(rollout, seq_items, reward_cfg, interaction_cfg)
    else:
        result = (scorer or RewardScorer(reward_cfg))(rollout.texts, seq_items)
        total, per_fn = result
        rewards = torch.tensor(total, dtype=torch.float32)
        correct = torch.tensor([float(is_correct(t, it)) for t, it in zip(rollout.texts, seq_items)])
        info, failures = result.info, result.metrics
    metrics = {f"reward/{name}": float(sum(v) / max(len(v), 1)) for name, v in per_fn.items()}
    metrics.update(failures)
    if reward_cfg.noise.kind != "none":
        info = {**info, "clean_reward": [float(r) for r in rewards]}   # next to the noisy one in samples
        rewards, realised = noisy_rewards(rewards, rollout, seq_items, reward_cfg.noise, seed=seed,
                                          judge_seed=judge_seed, max_new_tokens=max_new_tokens)
        metrics.update(realised)
    if algo_cfg.overlong.soft_buffer > 0:
        lengths = torch.tensor([len(c) for c in rollout.completion_ids])
        penalty = soft_overlong_penalty(lengths, max_len=max_new_tokens, buffer_len=algo_cfg.overlong.soft_buffer,
                                        penalty=algo_cfg.overlong.soft_penalty)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    return ScoredRollout(rollout, seq_items, rewards, correct, info), metrics


def noisy_rewards(clean: torch.Tensor, rollout: Rollout, seq_items: list, noise_cfg, *, seed: int,
                  max_new_tokens: int, judge_seed: int = 0) -> tuple[torch.Tensor, dict]:
    """`reward.noise` on a rollout's rewards [N], with its realised-noise metrics under reward/. The
    per-sample draws come from a generator seeded by the rollout's own seed, so a resumed run draws the
    same noise; what the noise model holds fixed for the whole run (judge_like's bias per prompt text)
    is seeded by `judge_seed` (the run's seed), so a prompt met again in a later step keeps its bias."""
    generator = torch.Generator().manual_seed(seed + _NOISE_SEED_OFFSET)
    noisy, metrics = REWARD_NOISE.call(
        noise_cfg.kind, clean, generator=generator, seed=judge_seed, max_new_tokens=max_new_tokens,
        prompt_keys=torch.tensor([zlib.crc32(repr(it.prompt).encode()) for it in seq_items]),
        lengths=torch.tensor([len(c) for c in rollout.completion_ids]),
        **as_dict(noise_cfg))
    metrics = {**metrics, **noise_metrics(clean, noisy)}
    return noisy, {f"reward/{k}": v for k, v in metrics.items()}


# Keeps the noise stream apart from the sampler's, which is seeded with the same rollout seed.
_NOISE_SEED_OFFSET = 7_919


def group_size_at(step: int, rollout_cfg) -> int:
    """G for this step: `rollout.group_size`, or the last `group_size_schedule` entry whose start step
    has been reached (e.g. {1: 4, 50: 8, 100: 16} grows G as the policy gets better and groups agree more)."""
    schedule = rollout_cfg.group_size_schedule or {}
    started = [int(s) for s in schedule if int(s) <= step]
    return int(schedule[max(started)]) if started else int(rollout_cfg.group_size)


class GroupSampler:
    """`sampler(k)`: k fresh training prompts -> rollout -> rewards, timing both phases.

    Each call draws a new seed, so rounds of dynamic sampling and steps never repeat samples.
    """

    def __init__(self, engine, tokenizer, stream: PromptStream, cfg, *, seed: int, environment=None):
        self.engine, self.tokenizer, self.stream, self.cfg = engine, tokenizer, stream, cfg
        self.calls, self.seed, self.environment = 0, seed, environment
        self.scorer = RewardScorer(cfg.reward)   # reward.weights, looked up once
        self.reset(group_size=cfg.rollout.group_size)

    def reset(self, group_size: int | None = None) -> None:
        """Start a step: zero the timers; optionally change G (group-size schedules)."""
        self.timings = {"rollout": 0.0, "reward": 0.0}
        self.reward_metrics: dict = {}
        if group_size is not None:
            self.group_size = group_size

    def state_dict(self) -> dict:
        """Position in the prompt stream and the call counter that seeds each rollout."""
        return {"stream": self.stream.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.calls = state["calls"]

    def __call__(self, k: int) -> ScoredRollout:
        items = self.stream.take(k)
        self.calls += 1
        t0 = time.time()
        seed = self.seed * 1_000_003 + self.calls * 10_007
        interaction = self.cfg.interaction
        rollout = rollout_phase(self.engine, self.tokenizer, items, self.cfg.rollout, group_size=self.group_size,
                                seed=seed, environment=self.environment, max_turns=interaction.max_turns)
        t1 = time.time()
        scored, metrics = reward_phase(rollout, items, self.cfg.reward, self.cfg.algorithm, scorer=self.scorer,
                                       max_new_tokens=self.cfg.rollout.max_new_tokens, seed=seed,
                                       interaction_cfg=interaction, judge_seed=self.seed)
        for key in ("reward/errors", "reward/timeouts"):  # counts add up over dynamic-sampling rounds
            metrics[key] = metrics.get(key, 0.0) + self.reward_metrics.get(key, 0.0)
        self.reward_metrics = metrics
        self.timings["rollout"] += t1 - t0
        self.timings["reward"] += time.time() - t1
        return scored


def collect_phase(sample, prompts_per_step: int, *, dynamic: bool, max_rounds: int) -> tuple[ScoredRollout, dict]:
    """One step's batch. With DAPO dynamic sampling (arXiv 2503.14476 §3.2), groups whose rewards all
    agree (zero advantage, zero gradient) are dropped and new prompts sampled until
    `prompts_per_step` informative groups are collected. The paper samples until the batch is full; here
    sampling stops after `max_rounds` rounds and the step trains on the informative groups found
    (`rollout/informative_groups` says how many), since a policy that has learned most prompts finds
    them slowly and a long run should not die over one short batch. No informative group at all is an
    error: the policy solves every prompt or none, and no step can learn.

    `sample(k)` -> ScoredRollout for k fresh prompts.
    """
    first = sample(prompts_per_step)
    stats = group_stats(first.rewards, torch.tensor(first.rollout.group_ids))
    metrics = {"rollout/zero_adv_group_frac": float(stats["zero_adv_group_frac"]),
               "rollout/group_reward_std": float(stats["group_reward_std"]), "rollout/sampling_rounds": 1.0}
    if not dynamic:
        return first, metrics
    kept, groups, rounds, generated = [], 0, 0, 0
    batch = first
    while True:
        rounds += 1
        generated += len(batch.rollout)
        keep = informative_group_mask(batch.rewards, torch.tensor(batch.rollout.group_ids))
        idx = torch.nonzero(keep).flatten().tolist()
        if idx:
            part = batch.select(idx)
            kept.append(part)
            groups += len(set(part.rollout.group_ids))
        if groups >= prompts_per_step or (rounds >= max_rounds and groups > 0):
            break
        if rounds >= max_rounds:
            raise RuntimeError(
                f"dynamic sampling found 0 of {prompts_per_step} informative groups in {rounds} rounds "
                f"(algorithm.dynamic_sampling.max_rounds): every group's rewards agree, so the task is too "
                f"easy or too hard for this policy. Raise algorithm.dynamic_sampling.max_rounds or "
                f"rollout.group_size, or turn it off with algorithm.dynamic_sampling.enabled=false")
        batch = sample(prompts_per_step)
    merged = ScoredRollout.concat(kept)
    # Trim to at most prompts_per_step groups (DAPO keeps the batch size fixed).
    wanted = set(sorted(set(merged.rollout.group_ids))[:prompts_per_step])
    merged = merged.select([i for i, g in enumerate(merged.rollout.group_ids) if g in wanted])
    metrics.update({"rollout/sampling_rounds": float(rounds), "rollout/generated_samples": float(generated),
                    "rollout/informative_groups": float(len(wanted))})
    return merged, metrics


def sample_step(sampler: GroupSampler, cfg, step: int) -> tuple[ScoredRollout, dict]:
    """One step's batch (rollout, rewards, DAPO dynamic sampling) with its own rollout/reward metrics and
    timings, so a batch sampled in the background carries its numbers with it."""
    sampler.reset(group_size=group_size_at(step, cfg.rollout))
    a = cfg.algorithm
    scored, metrics = collect_phase(sampler, cfg.trainer.prompts_per_step, dynamic=a.dynamic_sampling.enabled,
                                    max_rounds=a.dynamic_sampling.max_rounds)
    metrics.update(sampler.reward_metrics)
    metrics.update({"perf/rollout_s": sampler.timings["rollout"], "perf/reward_s": sampler.timings["reward"],
                    "rollout/group_size": float(sampler.group_size)})
    return scored, metrics


class RolloutPipeline:
    """Where each step's batch comes from, and how far the sampler may run ahead of the learner.

    ``max_staleness=0``: the batch of step k is sampled when step k starts, from the weights after
    update k-1 (the synchronous loop; the default, and what the paper tables use).
    ``max_staleness=1``: while the learner trains on step k, a background thread samples step k+1 from
    the weights after update k-1, so the engine (its own process for vLLM) and the learner work at
    the same time. Every batch is thus at most one update old; the loss already treats the sampler's
    logprobs as the behaviour policy (the clipped ratio π_θ / π_sampler, optionally TIS-corrected,
    arXiv 2503.14476-style off-policy correction as in verl/AReaL async training), and
    ``rollout/staleness`` logs the gap. The engine's weights change only while it is idle
    (:meth:`wait_idle` before every push and every evaluation).
    """

    def __init__(self, sampler: GroupSampler, cfg, *, max_staleness: int):
        if max_staleness not in (0, 1):
            raise ValueError(f"trainer.max_staleness={max_staleness}: 0 (synchronous) or 1 (one step ahead)")
        self.sampler, self.cfg, self.ahead = sampler, cfg, max_staleness
        self.pending = None   # (step, future or finished (scored, metrics), weights version it was sampled with)
        self.version = 0      # updates applied to the engine's weights
        self._pool = None
        if max_staleness:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")

    def take(self, step: int) -> tuple[ScoredRollout, dict]:
        """Step `step`'s batch: the one sampled ahead, or sampled now."""
        if self.pending is not None and self.pending[0] == step:
            _, job, version = self.pending
            self.pending = None
            scored, metrics = job.result() if hasattr(job, "result") else job
        else:
            scored, metrics, version = *sample_step(self.sampler, self.cfg, step), self.version
        metrics["rollout/staleness"] = float(self.version - version)
        return scored, metrics

    def prefetch(self, step: int) -> None:
        """Start sampling `step` in the background from the engine's current weights (staleness 1)."""
        if self._pool is not None:
            self.pending = (step, self._pool.submit(sample_step, self.sampler, self.cfg, step), self.version)

    def wait_idle(self) -> None:
        """Block until no sampling is in flight (the engine may then be given new weights or evaluate)."""
        if self.pending is not None and hasattr(self.pending[1], "result"):
            step, job, version = self.pending
            self.pending = (step, job.result(), version)

    def pushed(self) -> None:
        self.version += 1

    def state_dict(self) -> dict:
        """The sampler's position and, when a batch was sampled ahead, that batch (so a resumed run trains
        on exactly what the uninterrupted one would have)."""
        self.wait_idle()
        return {"sampler": self.sampler.state_dict(), "pending": self.pending, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.pending, self.version = state.get("pending"), state.get("version", 0)

    def close(self) -> None:
        # First the reward worker: a sampling thread waiting on a hung reward then ends (SIGTERM, an error).
        stop_reward_worker()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def to_learner_batch(scored: ScoredRollout, tokenizer) -> TensorBatch:
    r = scored.rollout
    batch = collate(r.prompt_ids, r.completion_ids, tokenizer.pad_token_id, r.sampler_logprobs, r.loss_masks)
    batch["group_ids"] = torch.tensor(r.group_ids, dtype=torch.long)
    batch["rewards"] = scored.rewards
    batch["truncated"] = torch.tensor(r.truncated, dtype=torch.bool)
    batch.extras["offline"] = bool(r.meta.get("offline"))
    return batch


class RewardNormalizer:
    """Running (EMA) reward normalisation state; the update itself is the pure function in algos."""

    def __init__(self, decay: float | None):
        self.decay, self.mean, self.var, self.count = decay, 0.0, 1.0, 0

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.decay is None:
            return rewards
        out, self.mean, self.var, self.count = ema_reward_normalize(rewards, self.mean, self.var, self.count,
                                                                    decay=self.decay)
        return out

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def rollout_metrics(scored: ScoredRollout) -> dict:
    """Lengths, correctness and truncation of the sampled completions."""
    lengths = torch.tensor([len(c) for c in scored.rollout.completion_ids], dtype=torch.float32)
    wrong = scored.correct < 0.5
    return {
        "reward/mean": float(scored.rewards.mean()),
        "reward/correct_frac": float(scored.correct.mean()),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/wrong_len_mean": float(lengths[wrong].mean()) if wrong.any() else 0.0,
        "rollout/truncated_frac": float(torch.tensor(scored.rollout.truncated, dtype=torch.float32).mean()),
        "rollout/samples": float(len(scored.rollout)),
        **turn_metrics(scored),   # interaction/: first and final accuracy, wrong → right, ... (multi-turn only)
    }
