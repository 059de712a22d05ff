"""The learner: owns the trainable policy, the frozen reference (only when needed), the optional
critic, their optimizers, minibatching and gradient accumulation.

It never sees the rollout engine: it receives padded tensors (`TensorBatch`) and hands back named
weights for the engine to load. All formulas live in `grpo_lab/algos`; this module only decides
which tensors go into them and when to step the optimizer.
"""

from __future__ import annotations

import copy
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from grpo_lab.algos import aggregate, clipped_value_loss, logprob_mismatch_metrics, truncated_is_weights
from grpo_lab.learner.batch import TensorBatch, completion_logits, token_logprobs
from grpo_lab.objectives import OBJECTIVES


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
        # The objective says what it needs: the reference is only loaded when something reads it
        # (KL > 0, or DPO's implicit reward), the critic only when trained.
        self.objective = OBJECTIVES.get(algo_cfg.objective)
        self.needs_ref = self.objective.needs_reference(algo_cfg)
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False) if self.needs_ref else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=learner_cfg.lr,
                                           weight_decay=learner_cfg.weight_decay)
        self.critic = self.critic_optimizer = None
        if self.objective.needs_critic(algo_cfg):
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
            parts["learner_logprobs"].append(self.policy_logprobs(micro)[0].cpu())
            if self.ref is not None:
                parts["ref_logprobs"].append(self.policy_logprobs(micro, model=self.ref)[0].cpu())
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

    def policy_logprobs(self, micro: TensorBatch, model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token logprobs [n, T], temperature-scaled logits [n, T, V]) of the completions under the
        policy (or `model`, e.g. the reference); objectives build their losses on this."""
        logits = completion_logits(model if model is not None else self.policy, micro, self.temperature)
        return token_logprobs(logits, micro["completion_ids"]), logits

    # ------------------------------------------------------------------ updates
    def update(self, batch: TensorBatch) -> dict[str, float]:
        """μ epochs × minibatches of optimizer steps on one rollout batch; returns actor/ and critic/ metrics.

        `batch` must hold what the objective reads (its `prepare` made it): for the policy gradient
        `loss_mask`, `advantages`, `old_logprobs` (from `score`), plus `returns` for the critic. An
        empty batch (e.g. no preference pair this step) changes nothing and is reported as such.
        """
        actor, critic = MetricMean(), MetricMean()
        n, skipped = len(batch), 0
        if n == 0:
            return {"actor/empty_batch": 1.0, "actor/lr": self.optimizer.param_groups[0]["lr"]}
        for _epoch in range(self.algo.epochs):
            order = torch.randperm(n, generator=self.generator)
            for mb_idx in order.chunk(self.algo.minibatches):
                minibatch = batch.index(mb_idx)
                mask = minibatch["loss_mask"]
                # Minibatch-wide normalisers: summing micro-batch losses then equals the full-batch loss.
                norm = dict(num_tokens=mask.sum().clamp(min=1).item(),
                            num_seqs=(mask.sum(-1) > 0).sum().clamp(min=1).item(),
                            max_len=max(self.max_completion_len, mask.shape[1]),
                            **self.objective.minibatch_norms(minibatch))
                self.optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(minibatch, self.cfg.micro_batch_size):
                    loss, metrics = self.objective.loss(self, micro.to(self.device), norm)
                    loss.backward()
                    actor.add(metrics, weight=len(micro))
                grad_norm = self._clip_and_step(self.policy, self.optimizer)
                actor.add({"grad_norm": grad_norm})
                skipped += not math.isfinite(grad_norm)
                if self.critic is not None:
                    critic.add(self._critic_step(minibatch))
        self.step += 1
        return {**actor.result("actor/"), **critic.result("critic/"), "actor/lr": self.optimizer.param_groups[0]["lr"],
                "actor/nonfinite_updates": float(skipped)}

    def _clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        """Clip and apply the accumulated gradient; a non-finite gradient norm (a NaN/inf loss or reward
        got through) is not applied at all, so one bad batch cannot destroy the weights or Adam's moments."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        if self.cfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in params])))
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def parameters_finite(self) -> bool:
        """One reduction over every weight: NaN or inf anywhere makes the sum non-finite."""
        with torch.no_grad():
            return bool(torch.isfinite(torch.stack([p.float().sum() for p in self.policy.parameters()]).sum()))

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

    def state_dict(self) -> dict:
        """Everything of the learner that changes over a run, except the policy weights (saved as a model
        directory beside it): optimizer moments, critic and its optimizer, minibatch generator, step."""
        state = {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(), "step": self.step}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        return state

    def load_state(self, policy_dir: str | Path, state: dict) -> None:
        """Restore a checkpoint: policy weights from `policy_dir` (the reference stays the starting policy)."""
        from safetensors.torch import load_file

        weights = load_file(str(Path(policy_dir) / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.policy.load_state_dict(weights, strict=False)
        tied = getattr(self.policy.config, "tie_word_embeddings", False)
        if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
            raise RuntimeError(f"checkpoint {policy_dir} does not match the policy: missing {missing}, "
                               f"unexpected {unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = state["step"]
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def save(self, path: str | Path, tokenizer=None) -> None:
        self.policy.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
