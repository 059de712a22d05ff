"""The learner: owns the trainable policy, the frozen reference (only when needed), the optional
critic, their optimizers, minibatching and gradient accumulation.

It never sees the rollout engine: it receives padded tensors (`TensorBatch`) and hands back named
weights for the engine to load. The objective it is handed (grpo_lab/objectives) turns tensors into
a loss; this module runs the forwards that produce those tensors, the backward, and the optimizer.

One update: `update` -> per minibatch `_accumulate_gradient` (per micro-batch: `_loss_inputs`, the
policy's forward -> `objective.loss` -> backward) -> `TrainableModel.clip_and_step`
(grpo_lab/learner/trainable.py: the one optimizer step of the lab, shared with every other model it trains).

At scale, all off by default, which keeps the default numbers bit for bit:

* learner.dtype=bf16: forwards run under `torch.autocast(bfloat16)` over fp32 parameters, so the
  master weights, their gradients and AdamW's moments stay fp32 (mixed precision, arXiv
  1710.03740; autocast keeps one bf16 copy of each weight per forward). bf16 has fp32's exponent
  range, so no loss scaling is needed.
* learner.lora.rank > 0: peft adapters (LoRA, arXiv 2106.09685): W x + (α/r)·B A x with W frozen;
  only A and B are trained and held by AdamW. The reference is the same model with its adapters
  switched off, and the engine receives W + (α/r)·B A merged, under the base model's names, for
  the adapted layers only.
* learner.max_tokens_per_micro_batch: micro-batches of rows sorted by length, rows × padded width
  within the budget; learner.logits_chunk_tokens: the LM head in chunks (batch.completion_stats).
* learner.lr_schedule / warmup_steps / total_steps: LambdaLR over RL steps (learner/schedules.py).

For speed, also off by default: learner.skip_rows_without_gradient leaves out of the update
the rows the objective says add exactly 0 (`Objective.rows_without_gradient`: e.g. a GRPO group
whose rewards all agree has A = 0, so its rows' policy loss and gradient are 0); the minibatch-wide
normalisers still count them, so the update is the same up to float rounding. And
learner.shared_prompt_forward runs each distinct prompt of a micro-batch through the model once, its
rows' completions attending to its cached keys and values (Prefix Grouper, arXiv 2506.05433): the
same logprobs and gradients up to rounding, for P + G·T positions a group instead of G·(P + T).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from grpo_lab.algos import aggregate, clipped_value_loss, logprob_mismatch_metrics, rollout_correction_weights
from grpo_lab.learner import distributed
from grpo_lab.learner.batch import TensorBatch, completion_stats, prompt_groups
from grpo_lab.learner.schedules import lr_factor
from grpo_lab.learner.trainable import TrainableModel, load_causal_lm

# Projections that inference engines fuse into one matrix (vLLM's `packed_modules_mapping` for
# Llama / Qwen2 / Mistral: qkv_proj, gate_up_proj). vLLM reloads a fused layer as a whole, so when
# one member changes, its siblings travel too, or the engine would rebuild the fused matrix from a
# partial load.
PACKED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def set_cpu_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads (null: half the cores, leaving the rest to the rollout engine)."""
    n = num_threads or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(n)
    return n


def release_freed_host_memory() -> None:
    """Hand memory that glibc's allocator holds but nothing uses back to the OS (malloc_trim).

    A CPU learner allocates activations and logits whose sizes change every step (completion lengths
    vary); glibc keeps the freed blocks in its arenas, so without this the trainer's RSS creeps upward
    over a run, far above the memory plan's estimate. Called once per step; a no-op where the C
    library is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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

    def absorb(self, other: "MetricMean") -> None:
        for k in other.sums:
            self.sums[k] += other.sums[k]
            self.weights[k] += other.weights[k]

    def result(self, prefix: str = "") -> dict[str, float]:
        return {prefix + k: self.sums[k] / max(self.weights[k], 1e-12) for k in self.sums}


def micro_batches(batch: TensorBatch, size: int, max_tokens: int | None = None):
    """(row indices [m], micro-batch) pairs covering `batch`: `size` consecutive rows each, full padded
    width; with max_tokens, `_token_budget_micro_batches`. The learner's minibatch-wide normalisers
    make the summed loss independent of this split."""
    if max_tokens is not None:
        yield from _token_budget_micro_batches(batch, max_tokens)
        return
    n = len(batch)
    for start in range(0, n, size):
        idx = torch.arange(start, min(start + size, n))
        yield idx, batch.index(idx)


def _token_budget_micro_batches(batch: TensorBatch, max_tokens: int):
    """`micro_batches` under learner.max_tokens_per_micro_batch: rows sorted longest first and packed
    greedily so that rows × padded width ≤ max_tokens, each micro-batch trimmed to the padding its own
    rows need (a single row wider than the budget goes alone; sequences are never split)."""
    prompt, completion = batch.lengths()                                 # [N], [N]
    order = torch.sort(prompt + completion, descending=True, stable=True).indices.tolist()
    group, wide_p, wide_c = [], 0, 0
    for i in order + [None]:
        if i is not None:
            p, c = max(wide_p, int(prompt[i])), max(wide_c, int(completion[i]))
            if not group or (len(group) + 1) * (max(p, 1) + max(c, 1)) <= max_tokens:
                group, wide_p, wide_c = group + [i], p, c
                continue
        idx = torch.tensor(group)
        yield idx, batch.index(idx).trim(max(wide_p, 1), max(wide_c, 1))
        if i is not None:
            group, wide_p, wide_c = [i], int(prompt[i]), int(completion[i])


def _in_batch_order(pieces: list[tuple[torch.Tensor, torch.Tensor]], n: int, width: int) -> torch.Tensor:
    """Per-micro-batch (row indices [m], values [m, t ≤ width]) back to one [n, width] tensor in batch
    order (trimmed micro-batches are narrower; padding stays 0)."""
    full = torch.zeros(n, width, dtype=pieces[0][1].dtype)
    for idx, v in pieces:
        full[idx, :v.shape[1]] = v
    return full


def mismatch_metrics(batch: TensorBatch) -> dict[str, float]:
    """rollout/logprob_* : how far the engine's logprobs are from the learner's on the sampled tokens."""
    return {f"rollout/{k}": float(v) for k, v in logprob_mismatch_metrics(
        batch["learner_logprobs"], batch["sampler_logprobs"], batch["response_mask"]).items()}


class AdapterDisabledReference:
    """π_ref under LoRA: the policy's own frozen base weights with its adapters switched off (peft's
    `disable_adapter()`), so no second copy of the model exists. It owns no parameters."""

    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model

    def parameters(self):
        return iter(())


class Learner:
    """`objective` is the registered training objective (`OBJECTIVES.get(cfg.algorithm.objective)`):
    its facts say which models to hold and which forwards to run; its `loss` gets their tensors."""

    def __init__(self, model_dir: str | Path, *, objective, learner_cfg, algo_cfg, temperature: float, seed: int,
                 max_completion_len: int):
        torch.manual_seed(seed)
        self.cfg, self.algo, self.temperature = learner_cfg, algo_cfg, temperature
        self.objective = objective.for_run(algo_cfg)   # its registered parts bound once
        # learner.strategy=fsdp2: weights sharded over the torchrun ranks, rows split (learner/distributed.py).
        self.sharded = learner_cfg.strategy == "fsdp2"
        if self.sharded:
            distributed.init()   # before any .to(device): picks this rank's GPU
        # Dr.GRPO's constant normaliser is the generation budget, not the batch's longest completion.
        self.max_completion_len = max_completion_len
        self.device = resolve_device(learner_cfg.device)
        self.token_budget = learner_cfg.max_tokens_per_micro_batch
        self.logits_chunk = learner_cfg.logits_chunk_tokens
        self.shared_prompts = learner_cfg.shared_prompt_forward
        self.lora = learner_cfg.lora.rank > 0
        self.policy = load_causal_lm(model_dir, device=self.device, attn_implementation=learner_cfg.attn_implementation,
                                     gradient_checkpointing=learner_cfg.gradient_checkpointing, lora=learner_cfg.lora)
        # Dropout anywhere makes a train-mode forward differ from the eval-mode scoring forward.
        self.stochastic_forward = getattr(self.policy.config, "attention_dropout", 0.0) > 0 or any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in self.policy.modules())
        # The objective says once what it needs: the reference is only loaded when something reads it
        # (KL > 0, or DPO's implicit reward), the critic only when trained.
        self.needs = self.objective.needs(algo_cfg)
        if not self.needs.reference:
            self.ref = None
        elif self.lora:
            self.ref = AdapterDisabledReference(self.policy)
        else:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if self.sharded:
            if self.lora or self.needs.critic:
                raise ValueError("learner.strategy=fsdp2 supports neither LoRA (learner.lora.rank > 0) nor a "
                                 "critic (algorithm.critic.enabled); use learner.strategy=single for those")
            # The frozen reference is sharded the same way (1/W of its memory per rank).
            for model in (self.policy, self.ref):
                if model is not None:
                    distributed.shard_model(model)
        schedule = learner_cfg.lr_schedule
        self.actor = TrainableModel(
            self.policy, lr=learner_cfg.lr, weight_decay=learner_cfg.weight_decay, grad_clip=learner_cfg.grad_clip,
            dtype=learner_cfg.dtype, sharded=self.sharded,
            lr_lambda=functools.partial(lr_factor, schedule=schedule, warmup_steps=learner_cfg.warmup_steps,
                                        # total_steps interpolates trainer.total_steps: read only where a decay needs it.
                                        total_steps=None if schedule == "constant" else learner_cfg.total_steps))
        self.critic = self.value_model = None
        if self.needs.critic:
            self.critic = ValueModel(algo_cfg.critic.model_path or model_dir).to(self.device)
            # The value model's forward runs in fp32 (no autocast) and is clipped as the policy is.
            self.value_model = TrainableModel(self.critic, lr=algo_cfg.critic.lr, weight_decay=0.01,
                                              grad_clip=learner_cfg.grad_clip)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    # The policy's optimizer and schedule live in its TrainableModel; tests and benchmarks swap them.
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.actor.optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self.actor.optimizer = value

    @property
    def scheduler(self):
        return self.actor.scheduler

    @scheduler.setter
    def scheduler(self, value) -> None:
        self.actor.scheduler = value

    # ------------------------------------------------------------------ scoring (no gradients)
    def learner_logprobs_from_update(self, batch: TensorBatch) -> bool:
        """Whether π_learner can come from the update's own forward instead of a scoring forward.

        Only when that forward runs at the sampling weights and nothing before it reads π_learner:
        one optimizer step per batch (algorithm.epochs = minibatches = 1), no rollout correction (its
        weights enter the loss), sampled rows (not pairs from a file), an objective whose loss runs the policy on the
        batch's own rows (`Objective.views` None), one process (under fsdp2 each rank sees only its rows), and a forward without dropout (the
        scoring forward ran in eval mode). Then π_old is the sampler's logprobs and π_learner feeds only
        the mismatch metrics, which `update` computes from the same numbers up to matmul rounding.
        """
        return (self.algo.epochs == 1 and self.algo.minibatches == 1 and self.algo.rollout_correction.level is None
                and not batch.extras.get("offline") and "sampler_logprobs" in batch and not self.sharded
                and self.needs.views is None and not self.stochastic_forward)

    @torch.no_grad()
    def score(self, batch: TensorBatch) -> dict[str, float]:
        """Add the learner's own π_old logprobs, the reference logprobs and critic values to `batch`.

        Also decides what the policy loss uses as π_old: the sampler's logprobs (the engine's
        distribution is what was sampled), or with algorithm.rollout_correction the learner's own, each
        token's loss reweighted by the correction's weights from π_learner / π_sampler (token, sequence
        or geometric; truncated or masked: grpo_lab/algos/rollout_correction.py). With
        trainer.max_staleness=1 the sampler ran one update behind, so the same weights also correct for
        the staleness (π_learner is scored at the current weights). The policy's own forward is skipped when
        `learner_logprobs_from_update` says the update's forward gives the same numbers (the default
        GRPO step: one forward fewer per step).
        """
        deferred = self.learner_logprobs_from_update(batch)
        batch.extras["learner_logprobs_from_update"] = deferred
        parts = defaultdict(list)
        # Eval mode: π_old must not depend on dropout noise (LoRA dropout); a no-op for dropout-free models.
        self.policy.eval()
        try:
            if not deferred or self.ref is not None or self.critic is not None:
                for idx, micro in micro_batches(batch, self.cfg.micro_batch_size, self.token_budget):
                    micro = micro.to(self.device)
                    if not deferred:
                        parts["learner_logprobs"].append((idx, self.policy_logprobs(micro)[0].cpu()))
                    if self.ref is not None:
                        parts["ref_logprobs"].append((idx, self.policy_logprobs(micro, model=self.ref)[0].cpu()))
                    if self.critic is not None:
                        parts["old_values"].append((idx, self.critic(micro).float().cpu()))
        finally:
            self.policy.train()
        for k, pieces in parts.items():
            batch[k] = _in_batch_order(pieces, len(batch), batch["response_mask"].shape[1])
        if batch.extras.get("offline"):  # pairs from a file: nothing was sampled, nothing to correct
            batch["old_logprobs"] = batch["learner_logprobs"]
            return {}
        if deferred:
            batch["old_logprobs"] = batch["sampler_logprobs"]
            return {}                     # the mismatch metrics come with `update`'s
        rc = self.algo.rollout_correction
        if rc.level is None:
            batch["old_logprobs"] = batch["sampler_logprobs"]
            return mismatch_metrics(batch)
        batch["is_weights"], correction = rollout_correction_weights(
            batch["learner_logprobs"], batch["sampler_logprobs"], batch["response_mask"],
            level=rc.level, mode=rc.mode, upper=rc.upper, lower=rc.lower)
        batch["old_logprobs"] = batch["learner_logprobs"]
        return {**mismatch_metrics(batch), **{f"rollout/{k}": float(v) for k, v in correction.items()}}

    def policy_logprobs(self, micro: TensorBatch, model=None, *, entropy: bool = False,
                        entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token logprobs [n, T], token entropy [n, T] or None) of the completions under the policy
        (or `model`, e.g. `self.ref`), at the sampling temperature. The entropy carries a gradient only with entropy_grad=True (a loss term uses it).
        Full-vocabulary logits stay inside (chunked with learner.logits_chunk_tokens)."""
        if isinstance(model, AdapterDisabledReference):
            with model.peft_model.disable_adapter():
                return self.policy_logprobs(micro, entropy=entropy, entropy_grad=entropy_grad)
        with self.actor.autocast():
            return completion_stats(self.policy if model is None else model, micro, self.temperature,
                                    chunk_tokens=self.logits_chunk, entropy=entropy, entropy_grad=entropy_grad,
                                    shared_prompts=self.shared_prompts)

    # ------------------------------------------------------------------ updates
    def update(self, batch: TensorBatch) -> dict[str, float]:
        """μ epochs × minibatches of optimizer steps on one rollout batch; returns actor/ and critic/ metrics.

        `batch` must hold what the objective reads (its `prepare` made it): for the policy gradient
        `loss_mask`, `advantages`, `old_logprobs` (from `score`), plus `returns` for the critic. An
        empty batch (e.g. no preference pair this step) changes nothing and is reported as such.
        """
        n, lr = len(batch), self.optimizer.param_groups[0]["lr"]   # this step's scheduled rate
        if n == 0:
            self.scheduler.step()                     # the schedule counts RL steps, empty or not
            return {"actor/empty_batch": 1.0, "actor/lr": lr}
        actor, critic = MetricMean(), MetricMean()
        skipped, silent_rows = 0, 0
        from_update = batch.extras.get("learner_logprobs_from_update", False)   # set by `score`
        learner_logprobs = []             # (batch rows, π_learner logprobs) per micro-batch, when from_update
        for _epoch in range(self.algo.epochs):
            order = torch.randperm(n, generator=self.generator)
            for mb_idx in order.chunk(self.algo.minibatches):
                minibatch = batch.index(mb_idx)
                # Rows that add exactly 0 (all-zero advantages, ...) need no forward/backward.
                plan = self.objective.minibatch_plan(minibatch, self.algo)
                silent_rows += int(plan.without_gradient.sum())
                part, logprobs = self._accumulate_gradient(minibatch, plan, keep_logprobs=from_update)
                learner_logprobs += [(mb_idx[rows], lp) for rows, lp in logprobs]
                actor.absorb(part)
                grad_norm = self.actor.clip_and_step()
                actor.add({"grad_norm": grad_norm})
                skipped += not math.isfinite(grad_norm)
                if self.critic is not None:
                    critic.add(self._critic_step(minibatch))
        self.step += 1
        self.scheduler.step()
        behaviour = {}
        if learner_logprobs:
            # π_learner of the rows trained on (a skipped row had no forward; its row stays 0 here).
            batch["learner_logprobs"] = _in_batch_order(learner_logprobs, n, batch["response_mask"].shape[1])
            behaviour = mismatch_metrics(batch.index(torch.cat([rows for rows, _ in learner_logprobs]).sort().values))
        return {**actor.result("actor/"), **critic.result("critic/"), **behaviour, "actor/lr": lr,
                "actor/nonfinite_updates": float(skipped),
                # Skipped or not: what learner.skip_rows_without_gradient saves (or saved) of the learner's work.
                "actor/rows_without_gradient_frac": silent_rows / (n * self.algo.epochs)}

    def _accumulate_gradient(self, minibatch: TensorBatch, plan, *,
                             keep_logprobs: bool) -> tuple[MetricMean, list]:
        """Forward and backward of the micro-batches of `minibatch` this process trains on, so that the
        policy's gradient is the whole minibatch's loss's. `plan` is the objective's MinibatchPlan
        (grpo_lab/objectives/base.py). With learner.skip_rows_without_gradient the
        plan's rows without gradient are left out; the minibatch-wide normalisers still count them, so the gradient is
        the same sum. Returns the metrics (weighted by rows) and, with keep_logprobs (one optimizer step
        per batch: this forward ran at the sampling weights), (minibatch rows, detached token logprobs)
        of every micro-batch."""
        norm = self._minibatch_norms(minibatch, plan)
        skip = self.cfg.skip_rows_without_gradient
        train_idx = (~plan.without_gradient).nonzero().squeeze(-1) if skip else None
        self.actor.zero_grad()
        metrics, logprobs = MetricMean(), []
        for rows, micro, real in self._local_micro_batches(minibatch, train_idx):
            micro = micro.to(self.device)
            inputs = self._loss_inputs(micro)
            loss, micro_metrics = self.objective.loss(micro, **inputs, norm=norm, algo=self.algo)
            (loss if real else loss * 0.0).backward()
            if real:
                metrics.add(micro_metrics, weight=len(micro))
                if keep_logprobs:
                    logprobs.append((rows, inputs["logprobs"].detach().float().cpu()))
        if self.sharded:
            distributed.merge_metric_means(metrics)   # the whole minibatch's metrics on every rank
        return metrics, logprobs

    def _minibatch_norms(self, minibatch: TensorBatch, plan) -> dict:
        """Minibatch-wide normalisers (tokens, sequences, the generation budget, and the objective's
        own): with them, summing the micro-batches' losses gives exactly the full minibatch's loss."""
        mask = minibatch["loss_mask"]
        return dict(num_tokens=mask.sum().clamp(min=1).item(),
                    num_seqs=(mask.sum(-1) > 0).sum().clamp(min=1).item(),
                    max_len=max(self.max_completion_len, mask.shape[1]),
                    **plan.norms)

    def _loss_inputs(self, micro: TensorBatch) -> dict:
        """The tensors `objective.loss` takes besides the micro-batch: the policy's token logprobs, with
        gradient, of the rows the objective names (`Objective.views`), the reference logprobs `score`
        put beside them, and for the micro-batch's own rows the token entropy when the objective logs
        it (on the autograd graph only when its loss uses it): as `self.needs` says."""
        views = self.needs.views
        if views is None:
            logprobs, entropy = self.policy_logprobs(micro, entropy=self.needs.entropy,
                                                     entropy_grad=self.needs.entropy_grad)   # [n, T] ×2
            return {"logprobs": logprobs, "entropy": entropy, "ref_logprobs": micro.get("ref_logprobs")}
        rows = {view: micro.view(f"{view}/") for view in views}
        return {"logprobs": {view: self.policy_logprobs(r)[0] for view, r in rows.items()},
                "ref_logprobs": {view: r.get("ref_logprobs") for view, r in rows.items()}}

    def _local_micro_batches(self, minibatch: TensorBatch, train_idx: torch.Tensor | None = None):
        """(minibatch rows or None, micro-batch, real) triples this process trains on: the minibatch's
        rows `train_idx` (None: all), or under fsdp2 this rank's share of them (rows None), padded with
        zero-weight passes so every rank runs as many (distributed.equalize). With no row to train on,
        one zero-weight pass: AdamW must still step (its moments move the weights at zero gradient too)."""
        filler = functools.partial(minibatch.index, torch.arange(1))   # a zero-weight pass's one row
        if train_idx is not None and not len(train_idx):
            return [(None, filler(), False)]
        if self.shared_prompts:
            # A minibatch is a random draw of rows; put rows of one prompt next to each other so that
            # micro-batches hold whole groups and each prompt's forward is shared by all of them
            # (only the order of the micro-batches' sums changes).
            rows = torch.arange(len(minibatch)) if train_idx is None else train_idx
            train_idx = rows[torch.sort(prompt_groups(minibatch.index(rows))[1], stable=True).indices]
        trained = minibatch
        if train_idx is not None:   # only the padding these rows need
            trained = minibatch.index(train_idx)
            prompt, completion = trained.lengths()
            trained = trained.trim(max(int(prompt.max()), 1), max(int(completion.max()), 1))
        if not self.sharded:
            return [(idx if train_idx is None else train_idx[idx], m, True)
                    for idx, m in micro_batches(trained, self.cfg.micro_batch_size, self.token_budget)]
        mine = trained.index(distributed.local_rows(len(trained)))
        micros = [m for _, m in micro_batches(mine, self.cfg.micro_batch_size, self.token_budget)] if len(mine) else []
        return [(None, m if real else filler(), real) for m, real in distributed.equalize(micros)]

    def parameters_finite(self) -> bool:
        return self.actor.parameters_finite()

    def _critic_step(self, minibatch: TensorBatch) -> dict[str, float]:
        """One step of the clipped value loss (PPO), token-mean over the minibatch."""
        num_tokens = minibatch["response_mask"].sum().clamp(min=1).item()
        clip_frac, value_loss = MetricMean(), 0.0
        self.value_model.zero_grad()
        for _, micro in micro_batches(minibatch, self.cfg.micro_batch_size, self.token_budget):
            micro = micro.to(self.device)
            loss_mat, m = clipped_value_loss(self.critic(micro), micro["old_values"], micro["returns"],
                                             micro["response_mask"], clip=self.algo.critic.value_clip)
            loss = self.algo.critic.coef * aggregate(loss_mat, micro["response_mask"], "token_mean",
                                                     num_tokens=num_tokens)
            loss.backward()
            value_loss += loss.item()
            clip_frac.add(m, weight=len(micro))
        grad_norm = self.value_model.clip_and_step()
        return {"value_loss": value_loss, "grad_norm": grad_norm, **clip_frac.result()}

    # ------------------------------------------------------------------ weights
    def weights_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """Named policy tensors for the rollout engine; a tied lm_head is the embedding, so it is left out
        (vLLM's tied lm_head has no weight loader of its own).

        With LoRA only what changed travels: each adapted layer's merged W + (α/r)·B A under the
        base model's name (what vLLM's loader expects), plus its unchanged packed siblings
        (PACKED_SIBLINGS) and biases, since vLLM reloads a fused layer whole."""
        if self.lora:
            return self._lora_merged_weights()
        tied = getattr(self.policy.config, "tie_word_embeddings", False)
        if self.sharded:   # gathered on rank 0 only (the engine's rank); [] elsewhere
            full = distributed.full_state_dict(self.policy)
            return [(name, full[name]) for name, _ in self.policy.named_parameters()
                    if name in full and not (tied and name == "lm_head.weight")]
        return [(name, p.detach()) for name, p in self.policy.named_parameters()
                if not (tied and name == "lm_head.weight")]

    @torch.no_grad()
    def _lora_merged_weights(self) -> list[tuple[str, torch.Tensor]]:
        from peft.tuners.lora import LoraLayer

        model = self.policy.get_base_model()                                 # the HF CausalLM, adapters injected
        modules = dict(model.named_modules())
        adapted = {name for name, m in modules.items() if isinstance(m, LoraLayer)}
        send = set(adapted)
        for name in adapted:
            parent, _, leaf = name.rpartition(".")
            for group in PACKED_SIBLINGS:
                if leaf in group:
                    send.update(s for s in (f"{parent}.{g}" if parent else g for g in group) if s in modules)
        out = []
        for name, module in modules.items():                                # model order: layer by layer
            if name not in send:
                continue
            base = module.get_base_layer() if isinstance(module, LoraLayer) else module
            for pname, p in base.named_parameters(recurse=False):
                t = p.detach()
                if pname == "weight" and isinstance(module, LoraLayer):
                    for adapter in module.active_adapters:                 # ΔW = (α/r)·B A (fan-in/out handled)
                        t = t + module.get_delta_weight(adapter).to(t.dtype)
                out.append((f"{name}.{pname}", t))
        return out

    def _merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy as a plain HF state dict (base names, adapters merged in)."""
        merged = dict(self._lora_merged_weights())
        state = {}
        for k, v in self.policy.get_base_model().state_dict().items():
            if ".lora_" in k:
                continue
            k = k.replace(".base_layer.", ".")
            state[k] = merged.get(k, v)
        return state

    def state_dict(self) -> dict:
        """Everything of the learner that changes over a run, except the policy weights (saved as a model
        directory beside it): optimizer moments, LR scheduler, critic and its optimizer, minibatch
        generator, step."""
        # Under fsdp2 the optimizer's shards go to the DCP checkpoint (save_dcp).
        state = {**self.actor.state_dict(optimizer=not self.sharded), "generator": self.generator.get_state(),
                 "step": self.step}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.value_model.optimizer.state_dict()
        return state

    def load_state(self, policy_dir: str | Path, state: dict) -> None:
        """Restore a checkpoint: policy weights from `policy_dir` (the reference stays the starting policy);
        with LoRA only the adapters, from `policy_dir/adapter` (the base never changes)."""
        from safetensors.torch import load_file

        dcp_dir = Path(policy_dir).parent / distributed.DCP_DIR
        if dcp_dir.is_dir() and not self.lora:
            # Written by an fsdp2 run: model + optimizer, resharded to this world size (1 included).
            distributed.load_dcp(self.policy, self.optimizer, dcp_dir)
        elif self.sharded:
            raise RuntimeError(f"{policy_dir} has no {distributed.DCP_DIR}/ beside it: learner.strategy=fsdp2 "
                               "resumes only from checkpoints written by an fsdp2 run")
        elif self.lora:
            from peft import set_peft_model_state_dict

            weights = load_file(str(Path(policy_dir) / "adapter" / "adapter_model.safetensors"), device=str(self.device))
            result = set_peft_model_state_dict(self.policy, weights)
            missing = [k for k in result.missing_keys if ".lora_" in k]
            if result.unexpected_keys or missing or not weights:
                raise RuntimeError(f"LoRA checkpoint {policy_dir}/adapter does not match the policy's adapters "
                                   f"(learner.lora.*): missing {missing}, unexpected {result.unexpected_keys}")
        else:
            weights = load_file(str(Path(policy_dir) / "model.safetensors"), device=str(self.device))
            missing, unexpected = self.policy.load_state_dict(weights, strict=False)
            tied = getattr(self.policy.config, "tie_word_embeddings", False)
            if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
                raise RuntimeError(f"checkpoint {policy_dir} does not match the policy: missing {missing}, "
                                   f"unexpected {unexpected}")
        self.actor.load_state_dict(state)
        self.generator.set_state(state["generator"])
        self.step = state["step"]
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.value_model.optimizer.load_state_dict(state["critic_optimizer"])

    def save(self, path: str | Path, tokenizer=None) -> None:
        """A plain HF model directory (what engines, evaluation and tables load). With LoRA: the
        merged weights there, and the peft adapter in `path/adapter` (what resume reloads)."""
        if self.sharded:   # a collective; only rank 0 writes
            full = distributed.full_state_dict(self.policy)
            if distributed.rank() != 0:
                return
            self.policy.save_pretrained(str(path), state_dict=full)
        elif self.lora:
            self.policy.get_base_model().save_pretrained(str(path), state_dict=self._merged_state_dict())
            self.policy.save_pretrained(str(Path(path) / "adapter"), save_embedding_layers=False)
        else:
            self.policy.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))

    def save_dcp(self, path: str | Path) -> None:
        """Sharded model + optimizer through torch.distributed.checkpoint (loads on any world size)."""
        distributed.save_dcp(self.policy, self.optimizer, path)

    def close(self) -> None:
        """Nothing to release in one process (LearnerGroup.close releases the other ranks)."""
