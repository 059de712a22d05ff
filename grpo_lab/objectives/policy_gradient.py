"""The policy-gradient objective: GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++, PPO, CISPO, GMPO, SAPO
and DPPO are all this objective with different registered parts: an algorithm is a composition.

    batch:  r_i on the last real token of i; with algorithm.kl.placement=reward, r_t -= β KL_t
            (PPO, REINFORCE++); then the registered advantage estimator -> A [N, T]
    loss:   registered policy loss (clip, GSPO ratio, ...) + β KL_t (placement=loss, GRPO)
            − c · entropy_t, aggregated by the registered mode; + λ NLL of each group's best
            sample when the best-of-group anchor is on.

Both KL placements live here, so one file says where the KL term goes. Settings reach the pure
functions through their registries (each function takes only the ``algorithm.*`` fields it names),
bound once per run (``PolicyGradient.for_run``) rather than looked up at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lab.algos import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES,
                            ROLLOUT_CORRECTION_LEVELS, ROLLOUT_CORRECTION_MODES, best_of_group_mask, linear_warmup,
                            log_ratio_stats, token_mean)
from grpo_lab.registry import check_registered, known_kwargs
from grpo_lab.objectives.base import OBJECTIVES, MinibatchPlan, Objective, settings_of

# Where the KL(π || π_ref) penalty acts (algorithm.kl.placement).
KL_PLACEMENTS = ("loss", "reward")


def check_rollout_correction(rc, errors: list[str]) -> None:
    """algorithm.rollout_correction: a registered level (or null = off) and mode, and bounds that leave a
    perfect engine/learner match (weight 1) untouched: lower <= 1 <= upper."""
    key = "algorithm.rollout_correction"
    if rc.level is not None and not check_registered(ROLLOUT_CORRECTION_LEVELS, rc.level, f"{key}.level", errors):
        errors[-1] += "; or null for no correction"
    check_registered(ROLLOUT_CORRECTION_MODES, rc.mode, f"{key}.mode", errors)
    if not rc.upper >= 1.0:
        errors.append(f"{key}.upper={rc.upper} must be >= 1, so that a token the engine and the learner agree on "
                      "(weight 1) keeps its weight (Yao et al.'s TIS uses 2)")
    if rc.lower is not None and not 0.0 < rc.lower <= 1.0:
        errors.append(f"{key}.lower={rc.lower} must lie in (0, 1], or be null for no lower bound (verl's Seq-MIS "
                      "uses 0.5)")


@dataclass(frozen=True)
class RegisteredParts:
    """The registered functions an ``algorithm`` section names, with its settings bound (``Registry.bind``)."""

    algo: Any                      # the section they were bound from
    advantage: Callable            # ADVANTAGE_ESTIMATORS entry: (token_rewards, mask, group_ids[, values=])
    takes_values: bool             # ... whether it reads the value model's values (GAE)
    policy_loss: Callable          # POLICY_LOSSES entry: (logprobs, old_logprobs, advantages, mask, is_weights=)
    zero_at_zero_advantage: bool   # the policy loss's fact: 0 (and no gradient) where A = 0
    kl: Callable                   # KL_ESTIMATORS entry: (logprobs, ref_logprobs) -> [N, T]
    aggregation: Callable          # AGGREGATIONS entry: (loss_mat, mask, *, num_tokens, num_seqs, max_len)

    @classmethod
    def of(cls, algo) -> RegisteredParts:
        settings = settings_of(algo)
        advantage = ADVANTAGE_ESTIMATORS.bind(algo.advantage, **settings)
        return cls(algo, advantage, "values" in known_kwargs(advantage.func, {"values": None}),
                   POLICY_LOSSES.bind(algo.policy_loss, **settings),
                   POLICY_LOSSES.fact(algo.policy_loss, "zero_at_zero_advantage"), KL_ESTIMATORS.get(algo.kl.estimator),
                   AGGREGATIONS.get(algo.aggregation))


class PolicyGradient(Objective):
    views = None            # the policy's logprobs of the micro-batch's own rows
    logs_entropy = True     # the token entropy is always logged
    # Advantages, the ratio's clip, KL, entropy bonus, overlong filter, importance-sampling cap, the value
    # model, reward normalisation and the best-of-group anchor: the preference objective reads none.
    only_reads = ("algorithm.advantage", "algorithm.adv_eps", "algorithm.gamma", "algorithm.lam",
                  "algorithm.policy_loss", "algorithm.clip_low", "algorithm.clip_high", "algorithm.dual_clip",
                  "algorithm.aggregation", "algorithm.kl", "algorithm.entropy_coef", "algorithm.overlong.filter",
                  "algorithm.tis_cap", "algorithm.rollout_correction", "algorithm.critic", "algorithm.reward_ema_decay", "algorithm.sft_anchor_coef",
                  "algorithm.sft_anchor_warmup")

    def __init__(self, bound: RegisteredParts | None = None):
        self.bound = bound   # one run's parts (for_run); the registered instance resolves them at each call

    def for_run(self, algo) -> PolicyGradient:
        return PolicyGradient(RegisteredParts.of(algo))

    def parts(self, algo) -> RegisteredParts:
        """What `algo` names: bound once for the run's own section, looked up afresh for any other."""
        return self.bound if self.bound is not None and self.bound.algo is algo else RegisteredParts.of(algo)

    def entropy_in_loss(self, algo) -> bool:
        return algo.entropy_coef > 0

    def min_group_size(self, algo) -> int:
        if algo.advantage not in ADVANTAGE_ESTIMATORS:
            return 1
        return ADVANTAGE_ESTIMATORS.fact(algo.advantage, "min_group_size")

    def check(self, cfg, errors: list[str]) -> None:
        a = cfg.algorithm
        if check_registered(ADVANTAGE_ESTIMATORS, a.advantage, "algorithm.advantage", errors):
            if ADVANTAGE_ESTIMATORS.fact(a.advantage, "needs_critic") and not a.critic.enabled:
                errors.append(f"algorithm.advantage={a.advantage} needs a value model: set "
                              "algorithm.critic.enabled=true (or use algorithm=ppo)")
            need = self.min_group_size(a)
            sizes = [cfg.rollout.group_size, *(cfg.rollout.group_size_schedule or {}).values()]
            if min(sizes) < need:
                alone = [n for n in ADVANTAGE_ESTIMATORS
                         if ADVANTAGE_ESTIMATORS.fact(n, "min_group_size") <= min(sizes)
                         and not ADVANTAGE_ESTIMATORS.fact(n, "needs_critic")]
                # With no estimator that learns from groups this small (G=0), raising G is the only fix.
                instead = (" or set " + " or ".join(f"algorithm.advantage={n}" for n in alone)
                           + " (batch-level baseline)" if alone else
                           f" (no algorithm.advantage learns from groups of {min(sizes)} samples)")
                errors.append(
                    f"rollout.group_size={min(sizes)} gives every group fewer than {need} samples, so "
                    f"algorithm.advantage={a.advantage} is 0 for all of them and nothing is learned; raise "
                    f"rollout.group_size to >= {need}" + instead)
        check_registered(POLICY_LOSSES, a.policy_loss, "algorithm.policy_loss", errors)
        check_registered(AGGREGATIONS, a.aggregation, "algorithm.aggregation", errors)
        check_registered(KL_ESTIMATORS, a.kl.estimator, "algorithm.kl.estimator", errors)
        if a.kl.placement not in KL_PLACEMENTS:
            errors.append(f"algorithm.kl.placement={a.kl.placement!r}; valid choices: {', '.join(KL_PLACEMENTS)}")
        for key in ("clip_low", "clip_high"):
            if not 0.0 < a[key] < 1.0:
                errors.append(f"algorithm.{key}={a[key]} must lie in (0, 1): the ratio is clipped to "
                              "[1 − clip_low, 1 + clip_high] (e.g. 0.2; DAPO uses clip_high=0.28)")
        if a.dual_clip is not None and not a.dual_clip > 1.0:
            errors.append(f"algorithm.dual_clip={a.dual_clip} must be > 1 (the paper uses 3) or null")
        if not a.cispo_clip_high > 0:
            errors.append(f"algorithm.cispo_clip_high={a.cispo_clip_high} must be > 0: CISPO caps its IS weight at "
                          "1 + cispo_clip_high (verl's example 0.2)")
        for key in ("gmpo_log_clip_low", "gmpo_log_clip_high"):
            if not a[key] > 0:
                errors.append(f"algorithm.{key}={a[key]} must be > 0: GMPO clips each token's log-ratio to "
                              "[−gmpo_log_clip_low, gmpo_log_clip_high] (the paper uses 0.4 each)")
        for key in ("sapo_tau_pos", "sapo_tau_neg"):
            if not a[key] > 0:
                errors.append(f"algorithm.{key}={a[key]} must be > 0: the temperature of SAPO's soft gate "
                              "σ(τ(r − 1))·4/τ (the paper uses sapo_tau_pos=1.0, sapo_tau_neg=1.05)")
        for key in ("dppo_delta_low", "dppo_delta_high"):
            if not 0.0 < a[key] <= 1.0:
                errors.append(f"algorithm.{key}={a[key]} must lie in (0, 1]: DPPO's bound on how far a token's "
                              "probability may move, π − π_old (0.15 in the paper's recipe)")
        if a.dppo_ratio_cap is not None and not a.dppo_ratio_cap >= 1.0:
            errors.append(f"algorithm.dppo_ratio_cap={a.dppo_ratio_cap} must be >= 1 (the authors' code uses 10), "
                          "or null for no truncation of DPPO's ratio weight")
        if a.cispo_clip_low is not None and not a.cispo_clip_low >= 0:
            errors.append(f"algorithm.cispo_clip_low={a.cispo_clip_low} must be >= 0, or null for no lower bound "
                          "(MiniMax-M1's choice)")
        check_rollout_correction(a.rollout_correction, errors)
        if a.entropy_coef < 0:
            errors.append(f"algorithm.entropy_coef={a.entropy_coef} must be >= 0 (a bonus; 0 = off)")
        if a.sft_anchor_coef < 0 or a.sft_anchor_warmup < 0:
            errors.append("algorithm.sft_anchor_coef and algorithm.sft_anchor_warmup must be >= 0 (0 = off)")

    # ------------------------------------------------------------------ batch
    def prepare(self, batch, algo, *, normalizer, step: int, seed: int = 0):
        """Token rewards -> registered advantage estimator; sets advantages, returns, loss_mask (and
        the best-of-group anchor's weights)."""
        parts = self.parts(algo)
        mask = batch["response_mask"]
        rewards = normalizer(batch["rewards"])
        # The scalar outcome reward sits on the last real token (outcome-reward convention of verl/OpenRLHF):
        # the last the actor wrote, which in a multi-turn row need not be the mask's sum − 1.
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(-1)   # [N]
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(batch)), last] = rewards * (mask.sum(-1) > 0)
        metrics = {}
        if algo.kl.coef > 0 and algo.kl.placement == "reward":
            # KL inside the reward (PPO / REINFORCE++): r_t -= β · KL_t(π_old || π_ref).
            kl = parts.kl(batch["old_logprobs"], batch["ref_logprobs"]) * mask
            token_rewards = token_rewards - algo.kl.coef * kl
            metrics["reward/kl_penalty"] = float(kl.sum() / mask.sum().clamp(min=1))
        values = {"values": batch["old_values"] if "old_values" in batch else None} if parts.takes_values else {}
        advantages, returns = parts.advantage(token_rewards, mask, batch["group_ids"], **values)
        batch["advantages"], batch["returns"] = advantages, returns
        loss_mask = mask.clone()
        if algo.overlong.filter:
            # DAPO overlong filtering: truncated samples carry no reward signal about the answer.
            loss_mask = loss_mask * (~batch["truncated"]).float()[:, None]
        batch["loss_mask"] = loss_mask
        anchor = linear_warmup(step, algo.sft_anchor_warmup, algo.sft_anchor_coef)
        if anchor > 0:
            batch["anchor_weight"] = best_of_group_mask(batch["rewards"], batch["group_ids"]).float()
            batch.extras["anchor_coef"] = anchor
        real = mask.sum(-1) > 0
        metrics["actor/advantage_abs_mean"] = float(advantages.abs().sum() / mask.sum().clamp(min=1))
        metrics["rollout/overlong_filtered_frac"] = float(1.0 - loss_mask.sum() / mask.sum().clamp(min=1))
        metrics["reward/mean_used"] = float(rewards[real].mean()) if real.any() else 0.0
        return batch, metrics

    def minibatch_plan(self, minibatch, algo) -> MinibatchPlan:
        """Rows without gradient (`rows_without_gradient`) and, with the best-of-group anchor on, its
        coefficient and token count over the minibatch (the anchor's normaliser)."""
        norms = {}
        if "anchor_weight" in minibatch:
            anchor_tokens = (minibatch["response_mask"] * minibatch["anchor_weight"][:, None]).sum()
            norms["anchor"] = (minibatch.extras["anchor_coef"], anchor_tokens.clamp(min=1).item())
        return MinibatchPlan(self.rows_without_gradient(minibatch, algo), norms)

    def rows_without_gradient(self, minibatch, algo):
        """Rows that add exactly nothing to the loss below: no token left in `loss_mask` (every term is
        aggregated over it: DAPO's overlong filter, padding), or, when no term but the policy loss acts
        on a token (no entropy bonus, no KL in the loss), advantages all 0 when the registered policy loss
        is 0 at A = 0 (a group whose rewards agree: GRPO's, RLOO's and Dr.GRPO's baselines give exactly 0),
        or rollout-correction weights all 0 (an answer masked whole: level=sequence|geometric mode=mask). A row the best-of-group anchor trains on is never one of them. The normalisers
        stay minibatch-wide, so the sum over the other rows is the whole minibatch's loss."""
        loss_tokens = minibatch["loss_mask"] > 0                             # [n, T]
        silent = ~loss_tokens.any(-1)
        only_policy_loss = algo.entropy_coef == 0 and not (algo.kl.coef > 0 and algo.kl.placement == "loss")
        if only_policy_loss and self.parts(algo).zero_at_zero_advantage:
            silent |= ~((minibatch["advantages"] != 0) & loss_tokens).any(-1)
        if only_policy_loss and "is_weights" in minibatch:
            # The rollout correction's weights multiply the policy loss only: an answer it masked whole adds nothing.
            silent |= ~((minibatch["is_weights"] != 0) & loss_tokens).any(-1)
        if "anchor_weight" in minibatch:
            silent &= minibatch["anchor_weight"] == 0
        return silent

    # ------------------------------------------------------------------ loss
    def loss(self, micro, *, logprobs, entropy=None, ref_logprobs=None, norm: dict, algo):
        """Policy loss (registered) + β·KL (if in the loss) − c·entropy + λ·NLL of the best completion per
        group (if the supervised anchor is on), aggregated with the configured mode over the
        minibatch-wide normalisers. logprobs, entropy (on the autograd graph only when the bonus uses
        it), ref_logprobs (None without a reference): [n, T]."""
        a, logp, parts = algo, logprobs, self.parts(algo)
        mask = micro["loss_mask"]
        loss_mat, m = parts.policy_loss(logp, micro["old_logprobs"], micro["advantages"], mask,
                                        is_weights=micro.get("is_weights"))
        total = loss_mat
        # The spread of log(π/π_old) over the loss's tokens, the same number whichever loss ran.
        metrics = {k: float(v) for k, v in {**m, **log_ratio_stats(logp, micro["old_logprobs"], mask)}.items()}
        if ref_logprobs is not None and a.kl.coef > 0:
            kl = parts.kl(logp, ref_logprobs)  # [n, T]
            metrics["kl"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
            if a.kl.placement == "loss":
                total = total + a.kl.coef * kl
        if a.entropy_coef > 0:
            total = total - a.entropy_coef * entropy
        loss = parts.aggregation(total, mask, num_tokens=norm["num_tokens"], num_seqs=norm["num_seqs"],
                                 max_len=norm["max_len"])
        metrics["pg_loss"] = float(parts.aggregation(loss_mat.detach(), mask)) if mask.any() else 0.0
        metrics["entropy"] = float((entropy.detach() * micro["response_mask"]).sum()
                                   / micro["response_mask"].sum().clamp(min=1))
        if "anchor" in norm:
            # Best-of-group supervised anchor: NLL of each group's best completion, token-mean over them.
            coef, anchor_tokens = norm["anchor"]
            anchor_mask = micro["response_mask"] * micro["anchor_weight"][:, None]
            loss = loss + coef * token_mean(-logp, anchor_mask, num_tokens=anchor_tokens)
        return loss, metrics

    def run_name_knobs(self, algo) -> str:
        clip = f"{algo.clip_low:g}" if algo.clip_low == algo.clip_high else f"{algo.clip_low:g}-{algo.clip_high:g}"
        kl = f"{algo.kl.coef:g}{'' if algo.kl.coef == 0 else algo.kl.estimator}"
        return f"clip{clip}_kl{kl}"


OBJECTIVES.register("policy_gradient")(PolicyGradient())
