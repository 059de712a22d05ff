"""The preference objective: a registered preference loss (DPO, arXiv 2305.18290; IPO, arXiv
2310.12036) on (chosen, rejected) pairs, formed by a registered pairing from the policy's own
scored groups (best vs worst, or every ordered pair = "group DPO"), from a pool of the starting
policy's groups scored once (offline group preferences, e.g. labelled by a learned reward model), or
read from a local JSONL file (offline DPO, as in the paper).

    algorithm.preference.loss     dpo | ipo                 (algos.PREFERENCE_LOSSES)
    algorithm.preference.pairing  best_worst | all_pairs    (algos.PAIRINGS)
    algorithm.preference.pairs    policy | start_policy | <path.jsonl>     (where pairs come from)
    algorithm.preference.pool_prompts     prompts in the start_policy pool
    algorithm.preference.label_flip_prob   preference-label noise (rewards.noise.flip_pairs)
    algorithm.preference.label_smoothing   its remedy: cDPO (loss=dpo) or rDPO (loss=rdpo)

The reference π_ref is the starting policy, frozen; DPO's β is the KL strength, so
algorithm.kl.coef is not read.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from grpo_lab.algos import PAIRINGS, PREFERENCE_LOSSES, sequence_logps
from grpo_lab.learner.batch import encode_prompt, encode_target, pair_batch
from grpo_lab.registry import check_registered
from grpo_lab.objectives.base import OBJECTIVES, Objective, settings_of
from grpo_lab.sampling import GroupSampler, PromptStream, ScoredRollout
from grpo_lab.rewards.noise import flip_pairs
from grpo_lab.rollout import Rollout
from grpo_lab.tasks.local_dataset import read_jsonl

PAIR_FIELDS = ("prompt", "chosen", "rejected")
# Keeps the label-noise stream apart from others seeded by the same run seed and step.
_LABEL_NOISE_OFFSET = 104_729


def label_noise_generator(seed: int, step: int) -> torch.Generator:
    """The generator of a step's preference-label flips: a function of (seed, step) alone, so a
    resumed run flips exactly the pairs an uninterrupted one does."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + _LABEL_NOISE_OFFSET)


def read_pairs_file(path: str) -> list[dict]:
    """Rows of a JSONL file of preference pairs; every problem is an error naming the file (and line)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"algorithm.preference.pairs={path!r} is not a file; give a JSONL file with "
                                "prompt/chosen/rejected fields, or pairs=policy to pair the policy's own samples")
    rows = read_jsonl(file, PAIR_FIELDS, key="algorithm.preference.pairs",
                      fix="give every line string prompt, chosen and rejected fields")
    for n, row in enumerate(rows, start=1):
        bad = [k for k in PAIR_FIELDS if not isinstance(row[k], str)]
        if bad:
            raise ValueError(f"{path}: pair {n}: field(s) {bad} are not strings; algorithm.preference.pairs needs "
                             "text in prompt, chosen and rejected")
    return rows


class PairFileSampler(GroupSampler):
    """Offline preference pairs from a local JSONL file ({"prompt", "chosen", "rejected"} per line):
    each pair becomes a group of two sequences with rewards 1 (chosen) and 0 (rejected), so the same
    preparation and learner serve offline DPO and DPO on the policy's own groups."""

    def __init__(self, path: str, tokenizer, *, seed: int, label_flip_prob: float = 0.0):
        rows = read_pairs_file(path)
        # Label noise on a data set is fixed: each row is flipped (or not) once, at load, as a noisy
        # labeller would have written it.
        idx = torch.arange(len(rows))
        _, _, self.flipped = flip_pairs(idx, idx, generator=label_noise_generator(seed, -1),
                                        flip_prob=label_flip_prob)
        rows = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} if f else r
                for r, f in zip(rows, self.flipped.tolist())]
        self.pairs = [(encode_prompt(tokenizer, r["prompt"]), encode_target(tokenizer, r["chosen"]),
                       encode_target(tokenizer, r["rejected"]), r) for r in rows]
        self.stream = PromptStream(list(range(len(self.pairs))), seed)
        self.tokenizer, self.calls = tokenizer, 0
        self.reset(group_size=2)

    def __call__(self, k: int) -> ScoredRollout:
        t0 = time.time()
        out, items = Rollout([], [], [], [], [], [], meta={"offline": True}), []
        taken = self.stream.take(k)
        self.reward_metrics = {"reward/label_flipped_frac": float(self.flipped[taken].float().mean()) if taken else 0.0}
        for g, i in enumerate(taken):
            prompt, chosen, rejected, row = self.pairs[i]
            for ids, text in ((chosen, row["chosen"]), (rejected, row["rejected"])):
                out.prompt_ids.append(prompt)
                out.completion_ids.append(ids)
                out.sampler_logprobs.append([0.0] * len(ids))    # not sampled: no sampler logprobs
                out.texts.append(text)
                out.group_ids.append(g)
                out.truncated.append(False)
                items.append(row)
        self.timings["rollout"] += time.time() - t0
        n = len(out)
        return ScoredRollout(out, items, torch.tensor([1.0, 0.0] * (n // 2)), torch.tensor([1.0, 0.0] * (n // 2)))


class StartPolicyPool:
    """Offline group preferences (algorithm.preference.pairs=start_policy): at the first step, the groups of
    `pool_prompts` training prompts are sampled from the policy as the run starts and scored by the run's
    reward (a learned reward model's labels under reward=reward_model), once; every step then draws its
    groups from this fixed pool, in a seeded order reshuffled on each pass, as offline DPO draws pairs from
    a file. The policy's later samples are never used: this is the offline counterpart of pairing the
    policy's own groups at every step (pairs=policy) against the same reward. The pool is part of the
    sampler's state, so a resumed run trains on the same pool (its engine then holds a later policy, which
    must not resample it)."""

    def __init__(self, online: GroupSampler, pool_prompts: int, seed: int):
        self.online, self.pool_prompts = online, pool_prompts
        self.pool: ScoredRollout | None = None
        self.stream = PromptStream(list(range(pool_prompts)), seed)
        self.reset(group_size=online.group_size)

    def reset(self, group_size: int | None = None) -> None:
        self.online.reset(group_size)
        self.group_size, self.timings, self.reward_metrics = self.online.group_size, self.online.timings, {}

    def __call__(self, k: int) -> ScoredRollout:
        if self.pool is None:
            self.pool = self.online(self.pool_prompts)   # the only sampling and scoring of the run
            self.reward_metrics = {**self.online.reward_metrics, "rollout/pool_groups": float(self.pool_prompts)}
        rows = {}
        for i, g in enumerate(self.pool.rollout.group_ids):
            rows.setdefault(g, []).append(i)
        taken = self.stream.take(k)
        out = self.pool.select([i for g in taken for i in rows[g]])
        # Groups numbered 0..k-1 in the order drawn; sampled by an earlier policy, so no importance
        # correction or mismatch metric treats the engine's logprobs as this step's behaviour policy.
        out.rollout.group_ids = [n for n, g in enumerate(taken) for _ in rows[g]]
        out.rollout.meta["offline"] = True
        return out

    def state_dict(self) -> dict:
        return {"pool": self.pool, "stream": self.stream.state_dict(), "online": self.online.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.pool = state["pool"]
        self.stream.load_state_dict(state["stream"])
        self.online.load_state_dict(state["online"])


class Preference(Objective):
    views = ("chosen", "rejected")   # each pair's two completions, one forward each
    only_reads = ("algorithm.preference",)

    def needs_reference(self, algo) -> bool:
        return True  # the implicit reward is β log(π / π_ref)

    def min_group_size(self, algo) -> int:
        return 1 if _is_pairs_file(algo.preference.pairs) else 2

    def check(self, cfg, errors: list[str]) -> None:
        pref = cfg.algorithm.preference
        if not check_registered(PREFERENCE_LOSSES, pref.loss, "algorithm.preference.loss", errors) \
                and str(pref.loss).lower() == "cdpo":
            # cDPO is DPO's loss on smoothed labels, not a loss of its own: say how to ask for it.
            errors[-1] += ("; cDPO is loss=dpo with label smoothing: set algorithm.preference.loss=dpo "
                           "algorithm.preference.label_smoothing=<ε> (the assumed flip rate, e.g. 0.1)")
        check_registered(PAIRINGS, pref.pairing, "algorithm.preference.pairing", errors)
        if cfg.algorithm.rollout_correction.level is not None:
            errors.append(f"algorithm.rollout_correction.level={cfg.algorithm.rollout_correction.level}: the preference "
                          "loss reads no importance weights (it compares whole answers under the policy and the "
                          "reference, not the engine's log-probs); set algorithm.rollout_correction.level=null")
        if not pref.beta > 0:
            errors.append(f"algorithm.preference.beta={pref.beta} must be > 0 (DPO uses 0.1)")
        if not 0.0 <= pref.label_flip_prob <= 1.0:
            errors.append(f"algorithm.preference.label_flip_prob={pref.label_flip_prob} must lie in [0, 1] (0 = off)")
        if not 0.0 <= pref.label_smoothing < 0.5:
            errors.append(f"algorithm.preference.label_smoothing={pref.label_smoothing} must lie in [0, 0.5): the "
                          "assumed flip rate of cDPO / rDPO (0 = off)")
        if not _is_pairs_file(pref.pairs):
            if cfg.rollout.group_size < 2:
                errors.append(f"rollout.group_size={cfg.rollout.group_size}: preference pairs from the policy's "
                              "own groups need at least 2 samples per prompt; raise rollout.group_size")
            if pref.pairs == "start_policy" and pref.pool_prompts < cfg.trainer.prompts_per_step:
                errors.append(f"algorithm.preference.pool_prompts={pref.pool_prompts} is smaller than one step's "
                              f"trainer.prompts_per_step={cfg.trainer.prompts_per_step}; raise it (the pool is "
                              "sampled once and drawn from at every step)")
        elif not Path(pref.pairs).is_file():
            errors.append(f"algorithm.preference.pairs={pref.pairs!r} is not a file; give a local JSONL file "
                          "with prompt/chosen/rejected fields, pairs=policy to pair the policy's own samples, or "
                          "pairs=start_policy for a fixed pool of the starting policy's scored groups")

    def make_sampler(self, cfg, engine, tokenizer, train_items: list, environment=None):
        pref = cfg.algorithm.preference
        if _is_pairs_file(pref.pairs):
            return PairFileSampler(pref.pairs, tokenizer, seed=cfg.seed, label_flip_prob=pref.label_flip_prob)
        online = super().make_sampler(cfg, engine, tokenizer, train_items, environment)
        return StartPolicyPool(online, pref.pool_prompts, cfg.seed) if pref.pairs == "start_policy" else online

    def prepare(self, batch, algo, *, normalizer, step: int, seed: int = 0):
        """(chosen, rejected) pairs from each scored group by the registered pairing, each swapped
        with probability preference.label_flip_prob (pairs from a file were flipped at load). A step in
        which every group's rewards agree has no pair: it yields an empty batch (the learner skips it)."""
        pref = algo.preference
        chosen, rejected, weights = PAIRINGS.call(pref.pairing, batch["rewards"], batch["group_ids"],
                                                  **settings_of(pref))
        metrics = {"rollout/preference_pairs": float(len(chosen))}
        flip_prob = pref.label_flip_prob
        if flip_prob > 0 and not _is_pairs_file(pref.pairs):
            chosen, rejected, flipped = flip_pairs(chosen, rejected, generator=label_noise_generator(seed, step),
                                                   flip_prob=flip_prob)
            metrics["reward/label_flipped_frac"] = float(flipped.float().mean()) if len(flipped) else 0.0
        return pair_batch(batch, chosen, rejected, weights), metrics

    def minibatch_norms(self, minibatch) -> dict:
        return {"pair_weight_total": minibatch["pair_weight"].sum().clamp(min=1e-12).item()}

    def loss(self, micro, *, logprobs, entropy=None, ref_logprobs=None, norm: dict, algo):
        """Registered preference loss on rows that are (chosen, rejected) pairs: logprobs and
        ref_logprobs are {"chosen": [n, T], "rejected": [n, T]} (the reference's computed by
        ``Learner.score`` before pairing). Scaled by this micro-batch's share of the pair weights, so
        the accumulated gradient equals the full minibatch's weighted mean."""
        logps = {}
        for side in self.views:
            mask = micro[f"{side}/response_mask"]
            logps[side] = sequence_logps(logprobs[side], mask)
            logps[f"ref_{side}"] = sequence_logps(ref_logprobs[side], mask)
        pref = algo.preference
        loss, m = PREFERENCE_LOSSES.call(pref.loss, logps["chosen"], logps["rejected"], logps["ref_chosen"],
                                         logps["ref_rejected"], weights=micro["pair_weight"], **settings_of(pref))
        share = micro["pair_weight"].sum().item() / norm["pair_weight_total"]
        return loss * share, {f"{pref.loss}_{k}": float(v) for k, v in m.items()}

    def run_name_knobs(self, algo) -> str:
        # Preference losses have no ratio to clip; β is the KL strength that matters.
        return f"beta{algo.preference.beta:g}"


def _is_pairs_file(pairs: str) -> bool:
    """algorithm.preference.pairs names a JSONL file (anything but the two sampled sources)."""
    return pairs not in ("policy", "start_policy")


OBJECTIVES.register("preference")(Preference())
