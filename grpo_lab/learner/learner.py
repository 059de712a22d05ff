"""The learner: owns the trainable policy, the frozen reference (only when needed), the optional
critic, their optimizers, minibatching and gradient accumulation.

It never sees the rollout engine: it receives padded tensors (`TensorBatch`) and hands back named
weights for the engine to load. All formulas live in `grpo_lab/algos`; this module only decides
which tensors go into them and when to step the optimizer.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from grpo_lab.algos import (KL_ESTIMATORS, POLICY_LOSSES, aggregate, clipped_value_loss, dpo_loss,
                            entropy_from_logits, logprob_mismatch_metrics, sequence_logps, truncated_is_weights)
from grpo_lab.registry import Registry
from grpo_lab.learner.batch import TensorBatch, completion_logits, token_logprobs


def set_cpu_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads (null: half the cores, leaving the rest to the rollout engine)."""
    n = num_threads or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(n)
    return n


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ValueModel(nn.Module):
    """PPO critic: a copy of the policy's trunk with a scalar head (value of the state before each token)."""

    def __init__(self, model_dir: str | Path):
        super().__init__()
        self.trunk = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)
        self.head = nn.Linear(self.trunk.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: TensorBatch) -> torch.Tensor:
        hidden = self.trunk(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"], use_cache=False).last_hidden_state
        P, T = batch.prompt_width, batch["completion_ids"].shape[1]
        return self.head(hidden[:, P - 1:P - 1 + T]).squeeze(-1)         # [N, T]


class MetricMean:
    """Weighted running means of scalar metrics across micro-batches."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict, weight: float = 1.0) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v) * weight
            self.weights[k] += weight

    def result(self, prefix: str = "") -> dict[str, float]:
        return {prefix + k: self.sums[k] / max(self.weights[k], 1e-12) for k in self.sums}


# An objective turns one micro-batch into the loss whose gradient is accumulated, given the
# minibatch-wide normalisers (so micro-batch splitting never changes the gradient).
OBJECTIVES = Registry("training objective")


def micro_batches(batch: TensorBatch, size: int):
    n = len(batch)
    for start in range(0, n, size):
        yield batch.index(torch.arange(start, min(start + size, n)))


class Learner:
    def __init__(self, model_dir: str | Path, *, learner_cfg, algo_cfg, temperature: float, seed: int,
                 max_completion_len: int):
        torch.manual_seed(seed)
        self.cfg, self.algo, self.temperature = learner_cfg, algo_cfg, temperature
        # Dr.GRPO's constant normaliser is the generation budget, not the batch's longest completion.
        self.max_completion_len = max_completion_len
        self.device = resolve_device(learner_cfg.device)
        self.policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(self.device)
        self.policy.train()
        # The reference is only loaded when something reads it (KL > 0, or DPO's implicit reward).
        self.needs_ref = algo_cfg.kl.coef > 0 or algo_cfg.objective == "preference"
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False) if self.needs_ref else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=learner_cfg.lr,
                                           weight_decay=learner_cfg.weight_decay)
        self.critic = self.critic_optimizer = None
        if algo_cfg.critic.enabled:
            self.critic = ValueModel(algo_cfg.critic.model_path or model_dir).to(self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=algo_cfg.critic.lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    # ------------------------------------------------------------------ scoring (no gradients)
    @torch.no_grad()
    def score(self, batch: TensorBatch) -> dict[str, float]:
        """Add the learner's own π_old logprobs, the reference logprobs and critic values to `batch`.

        Also decides what the policy loss uses as π_old: the sampler's logprobs (the issue's
        contract: the engine's distribution is what was sampled), or with TIS the learner's own,
        reweighted by min(π_learner / π_sampler, cap) (Yao et al. 2025).
        """
        size = self.cfg.micro_batch_size
        parts = defaultdict(list)
        for micro in micro_batches(batch, size):
            micro = micro.to(self.device)
            parts["learner_logprobs"].append(self._logprobs(self.policy, micro)[0].cpu())
            if self.ref is not None:
                parts["ref_logprobs"].append(self._logprobs(self.ref, micro)[0].cpu())
            if self.critic is not None:
                parts["old_values"].append(self.critic(micro).float().cpu())
        for k, v in parts.items():
            batch[k] = torch.cat(v)
        mask = batch["response_mask"]
        if batch.extras.get("offline"):  # pairs from a file: nothing was sampled, nothing to correct
            batch["old_logprobs"] = batch["learner_logprobs"]
            return {}
        metrics = {f"rollout/{k}": float(v) for k, v in
                   logprob_mismatch_metrics(batch["learner_logprobs"], batch["sampler_logprobs"], mask).items()}
        if self.algo.tis_cap is not None:
            batch["is_weights"] = truncated_is_weights(batch["learner_logprobs"], batch["sampler_logprobs"],
                                                       mask, self.algo.tis_cap)
            batch["old_logprobs"] = batch["learner_logprobs"]
        else:
            batch["old_logprobs"] = batch["sampler_logprobs"]
        return metrics

    def _logprobs(self, model, micro: TensorBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = completion_logits(model, micro, self.temperature)         # [n, T, V]
        return token_logprobs(logits, micro["completion_ids"]), logits

    # ------------------------------------------------------------------ updates
    def update(self, batch: TensorBatch, *, anchor_coef: float = 0.0) -> dict[str, float]:
        """μ epochs × minibatches of optimizer steps on one rollout batch; returns actor/ and critic/ metrics.

        `batch` must hold what the objective reads: for the policy gradient `loss_mask`,
        `advantages`, `old_logprobs` (from `score`), plus `returns` for the critic.
        """
        objective: Callable = OBJECTIVES.get(self.algo.objective)
        actor, critic = MetricMean(), MetricMean()
        n = len(batch)
        for _epoch in range(self.algo.epochs):
            order = torch.randperm(n, generator=self.generator)
            for mb_idx in order.chunk(self.algo.minibatches):
                minibatch = batch.index(mb_idx)
                mask = minibatch["loss_mask"]
                # Minibatch-wide normalisers: summing micro-batch losses then equals the full-batch loss.
                norm = dict(num_tokens=mask.sum().clamp(min=1).item(),
                            num_seqs=(mask.sum(-1) > 0).sum().clamp(min=1).item(),
                            max_len=max(self.max_completion_len, mask.shape[1]))
                if "pair_weight" in minibatch:
                    norm["pair_weight_total"] = minibatch["pair_weight"].sum().clamp(min=1e-12).item()
                if anchor_coef > 0 and "anchor_weight" in minibatch:
                    anchor_tokens = (minibatch["response_mask"] * minibatch["anchor_weight"][:, None]).sum()
                    norm["anchor"] = (anchor_coef, anchor_tokens.clamp(min=1).item())
                self.optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(minibatch, self.cfg.micro_batch_size):
                    loss, metrics = objective(self, micro.to(self.device), norm)
                    loss.backward()
                    actor.add(metrics, weight=len(micro))
                actor.add({"grad_norm": self._clip_and_step(self.policy, self.optimizer)})
                if self.critic is not None:
                    critic.add(self._critic_step(minibatch))
        self.step += 1
        return {**actor.result("actor/"), **critic.result("critic/"), "actor/lr": self.optimizer.param_groups[0]["lr"]}

    def _clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        optimizer.step()
        return float(norm)

    def _critic_step(self, minibatch: TensorBatch) -> dict[str, float]:
        """One step of the clipped value loss (PPO), token-mean over the minibatch."""
        num_tokens = minibatch["response_mask"].sum().clamp(min=1).item()
        clip_frac, value_loss = MetricMean(), 0.0
        self.critic_optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches(minibatch, self.cfg.micro_batch_size):
            micro = micro.to(self.device)
            loss_mat, m = clipped_value_loss(self.critic(micro), micro["old_values"], micro["returns"],
                                             micro["response_mask"], clip=self.algo.critic.value_clip)
            loss = self.algo.critic.coef * aggregate(loss_mat, micro["response_mask"], "token_mean",
                                                     num_tokens=num_tokens)
            loss.backward()
            value_loss += loss.item()
            clip_frac.add(m, weight=len(micro))
        grad_norm = self._clip_and_step(self.critic, self.critic_optimizer)
        return {"value_loss": value_loss, "grad_norm": grad_norm, **clip_frac.result()}

    # ------------------------------------------------------------------ weights
    def weights_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """Named policy tensors for the rollout engine; a tied lm_head is the embedding, so it is left out
        (vLLM's tied lm_head has no weight loader of its own)."""
        tied = getattr(self.policy.config, "tie_word_embeddings", False)
        return [(name, p.detach()) for name, p in self.policy.named_parameters()
                if not (tied and name == "lm_head.weight")]

    def save(self, path: str | Path, tokenizer=None) -> None:
        self.policy.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))


@OBJECTIVES.register("policy_gradient")
def policy_gradient_loss(learner: Learner, micro: TensorBatch, norm: dict) -> tuple[torch.Tensor, dict]:
    """Policy loss (registered, e.g. clipped surrogate or GSPO) + β·KL (if in the loss) − c·entropy
    + λ·NLL of the best completion per group (if the supervised anchor is on), aggregated with the
    configured mode over the minibatch-wide normalisers."""
    a = learner.algo
    logp, logits = learner._logprobs(learner.policy, micro)                # [n, T], [n, T, V]
    mask = micro["loss_mask"]
    loss_mat, m = POLICY_LOSSES.get(a.policy_loss)(
        logp, micro["old_logprobs"], micro["advantages"], mask, clip_low=a.clip_low, clip_high=a.clip_high,
        dual_clip=a.dual_clip, is_weights=micro["is_weights"] if "is_weights" in micro else None)
    entropy = entropy_from_logits(logits)                                  # [n, T]
    total = loss_mat
    metrics = {k: float(v) for k, v in m.items()}
    if learner.ref is not None and a.kl.coef > 0:
        kl = KL_ESTIMATORS.get(a.kl.estimator)(logp, micro["ref_logprobs"])  # [n, T]
        metrics["kl"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        if a.kl.placement == "loss":
            total = total + a.kl.coef * kl
    if a.entropy_coef > 0:
        total = total - a.entropy_coef * entropy
    loss = aggregate(total, mask, a.aggregation, num_tokens=norm["num_tokens"],
                     num_seqs=norm["num_seqs"], max_len=norm["max_len"])
    metrics["pg_loss"] = float(aggregate(loss_mat.detach(), mask, a.aggregation)) if mask.any() else 0.0
    metrics["entropy"] = float((entropy.detach() * micro["response_mask"]).sum()
                               / micro["response_mask"].sum().clamp(min=1))
    if "anchor" in norm:
        # Best-of-group supervised anchor: NLL of each group's best completion, token-mean over them.
        coef, anchor_tokens = norm["anchor"]
        anchor_mask = micro["response_mask"] * micro["anchor_weight"][:, None]
        loss = loss + coef * aggregate(-logp, anchor_mask, "token_mean", num_tokens=anchor_tokens)
    return loss, metrics


@OBJECTIVES.register("preference")
def preference_loss(learner: Learner, micro: TensorBatch, norm: dict) -> tuple[torch.Tensor, dict]:
    """DPO (arXiv 2305.18290) on rows that are (chosen, rejected) pairs; the reference logprobs were
    computed by `score` before pairing. Scaled by this micro-batch's share of the pair weights, so
    the accumulated gradient equals the full minibatch's weighted mean."""
    logps = {}
    for side in ("chosen", "rejected"):
        rows = micro.view(f"{side}/")
        logps[side] = sequence_logps(learner._logprobs(learner.policy, rows)[0], rows["response_mask"])
        logps[f"ref_{side}"] = sequence_logps(rows["ref_logprobs"], rows["response_mask"])
    pref = learner.algo.preference
    loss, m = dpo_loss(logps["chosen"], logps["rejected"], logps["ref_chosen"], logps["ref_rejected"],
                       beta=pref.beta, weights=micro["pair_weight"])
    share = micro["pair_weight"].sum().item() / norm["pair_weight_total"]
    return loss * share, {f"dpo_{k}": float(v) for k, v in m.items()}
