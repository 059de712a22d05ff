"""The one shared piece of every second model: a model with its own optimizer and the train steps a
second model takes, each through code the policy already uses.

    SecondModel(model, *, lr, grad_clip, prefix)        (SecondModel.causal_lm(model_dir, ...) for an LM)
        .sft_update(tokenizer, items, *, batch_size, steps, seed)    -> loss   (grpo_lab.warmup.sft_loop)
        .rl_update(examples, algo, *, batch_size, steps, seed, ...) -> loss   (the policy-gradient objective)
        .ranking_update(micro_batches, *, loss)                     -> (loss, metrics)   (RANKING_LOSSES)
        .state_dict() / .load_state_dict(state)                                (weights and optimizer)
        .metrics(values) -> {prefix + name: value}

The gradient step itself is `grpo_lab.learner.trainable.TrainableModel`'s, as for the policy; the RL
step hands its batch to the registered ``policy_gradient`` objective (grpo_lab/objectives), so the
reward sits on each completion's last real token, the advantage comes from the registered estimator and
the loss from the registered policy loss with its clipping: exactly the code that trains the actor. The
ranking step is a reward model's: scores of ranked completions under a registered ranking loss
(grpo_lab/algos/ranking.py: Bradley–Terry pairs, Plackett–Luce lists).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from grpo_lab.algos import RANKING_LOSSES, adjacent_pair_mask
from grpo_lab.learner.batch import collate, completion_stats
from grpo_lab.learner.trainable import TrainableModel
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.tasks import TaskItem
from grpo_lab.warmup import sft_loop


class SecondModel:
    """A model other than the policy, trained alongside it or before it (module docstring). `prefix` names
    its metrics (e.g. ``critic_llm/``, ``reward_model/``), so they never mix with the policy's ``actor/``
    or PPO's ``critic/``."""

    def __init__(self, model: nn.Module, *, lr: float, grad_clip: float, prefix: str, weight_decay: float = 0.01,
                 dtype: str = "fp32"):
        self.model = model
        # torch's AdamW default weight decay (0.01) unless told otherwise, as the critic LLM has always trained.
        self.trainable = TrainableModel(self.model, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                                        dtype=dtype)
        self.prefix = prefix

    @classmethod
    def causal_lm(cls, model_dir: str | Path, **kwargs) -> "SecondModel":
        """A causal LM from a Hugging Face directory (fp32, CPU), e.g. the critic LLM."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), **kwargs)

    def metrics(self, values: dict[str, float]) -> dict[str, float]:
        return {self.prefix + k: v for k, v in values.items()}

    def sft_update(self, tokenizer, examples: list[dict], *, batch_size: int, steps: int, seed: int) -> float:
        """`steps` SFT steps on batches drawn from `examples` ({"prompt", "target"} texts); the last loss."""
        items = [TaskItem(e["prompt"], e["target"], e["target"]) for e in examples]
        return sft_loop(self.trainable, tokenizer, items, batch_size=batch_size, seed=seed,
                        device=torch.device("cpu"), max_steps=steps).loss

    def rl_update(self, examples: list[dict], algo, *, pad_id: int, batch_size: int, steps: int, seed: int,
                  temperature: float) -> float:
        """`steps` policy-gradient steps on random minibatches of `batch_size` of `examples` (each
        {"prompt_ids", "completion_ids", "logprobs" (the sampler's), "reward"}), the whole batch one group
        (a batch-mean baseline with group_mean: REINFORCE with baseline). `algo` is an algorithm section
        (advantage, policy_loss, clip_low/high, aggregation) read by the ``policy_gradient`` objective;
        the sampler's logprobs are π_old, so a clipped surrogate makes several steps safe."""
        objective = OBJECTIVES.get("policy_gradient")
        batch = collate([e["prompt_ids"] for e in examples], [e["completion_ids"] for e in examples], pad_id,
                        sampler_logprobs=[e["logprobs"] for e in examples])
        n = len(batch)
        batch["rewards"] = torch.tensor([float(e["reward"]) for e in examples])
        batch["group_ids"] = torch.zeros(n, dtype=torch.long)
        batch["truncated"] = torch.zeros(n, dtype=torch.bool)
        batch["old_logprobs"] = batch["sampler_logprobs"]
        batch, _ = objective.prepare(batch, algo, normalizer=lambda r: r, step=0)
        generator, loss = torch.Generator().manual_seed(seed), float("nan")
        self.model.train()
        for _ in range(steps):
            mb = batch.index(torch.randperm(n, generator=generator)[:batch_size])
            mask = mb["loss_mask"]
            norm = {"num_tokens": mask.sum().clamp(min=1).item(), "num_seqs": (mask.sum(-1) > 0).sum().clamp(min=1).item(),
                    "max_len": mask.shape[1]}

            def policy_loss(mb=mb, norm=norm):
                logprobs, entropy = completion_stats(self.model, mb, temperature, entropy=True)   # [m, T] x2
                return objective.loss(mb, logprobs=logprobs, entropy=entropy, norm=norm, algo=algo)
            loss = self.trainable.train_step(policy_loss)[0]
        return loss

    def ranking_update(self, micro_batches, *, loss: str = "bradley_terry") -> tuple[float, dict[str, float]]:
        """One step of the registered ranking loss over a batch split into micro-batches, each
        (scores_fn, mask, margin): `scores_fn()` -> scores [n, k] of each row's completions in the labeller's
        order, best first (real entries in `mask`). Each micro-batch's loss is weighted by its share of what
        the loss averages over (the entry's fact `averages_over`: adjacent pairs or rows) and its gradient
        accumulated, so the step equals the whole batch's. Returns (loss, metrics: accuracy, margin,
        grad_norm); accuracy and margin are means over adjacent pairs (grpo_lab/algos/ranking.py), weighted so."""
        def pairs(mask: torch.Tensor) -> float:
            return float(adjacent_pair_mask(mask).sum())

        by_rows = RANKING_LOSSES.fact(loss, "averages_over") == "rows"
        loss_total = sum(len(m) if by_rows else pairs(m) for _, m, _ in micro_batches) or 1.0
        pair_total = sum(pairs(m) for _, m, _ in micro_batches) or 1.0
        t, value, sums = self.trainable, 0.0, {}
        t.zero_grad()
        for scores_fn, mask, margin in micro_batches:
            with t.autocast():
                part, metrics = RANKING_LOSSES.call(loss, scores_fn(), mask, margin=margin)
            share = (len(mask) if by_rows else pairs(mask)) / loss_total
            (part * share).backward()
            value += part.item() * share
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * pairs(mask) / pair_total
        return value, {**sums, "grad_norm": t.clip_and_step()}

    def state_dict(self) -> dict:
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.trainable.optimizer.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self.model.load_state_dict(state["model"])
        self.trainable.optimizer.load_state_dict(state["optimizer"])
