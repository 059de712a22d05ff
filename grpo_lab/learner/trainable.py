"""A model with its own optimizer: the one place in the lab where a gradient step is taken.

Every model the lab trains goes through `TrainableModel`: the policy and PPO's value model
(grpo_lab/learner/learner.py), the warm-up's and the SFT control's supervised steps
(grpo_lab/warmup.py), and the second models (grpo_lab/second_models: the critic LLM, reward models).
It owns what every one of them needs and none should write again:

* the optimizer (AdamW over the trainable tensors only: with LoRA, the adapters) and an optional
  learning-rate schedule (LambdaLR, stepped once per RL step by its owner);
* bf16 autocast over fp32 master weights (`dtype="bf16"`: mixed precision, arXiv 1710.03740; bf16 has
  fp32's exponent range, so no loss scaling);
* gradient clipping, and the rule that a step whose gradient norm is not finite is not applied at all,
  so one bad batch cannot destroy the weights or Adam's moments;
* its optimizer and schedule state for checkpoints.

Callers own their forwards and losses: `train_step(loss_fn)` runs one whole step around a closure,
`sft_step(batch)` is the supervised step every SFT in the lab takes, and owners that accumulate
gradients over micro-batches themselves (the learner) call `zero_grad` / `clip_and_step`.

`load_causal_lm` builds a causal LM the way every trained model is built (attention kernel, gradient
checkpointing, LoRA adapters through peft, arXiv 2106.09685), so a second model gets LoRA exactly
as the policy does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from grpo_lab.learner.batch import TensorBatch, completion_logits, token_logprobs


def apply_lora(model: nn.Module, lora_cfg, *, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap `model` with peft LoRA adapters (B = 0 at start, so the model starts as the base). With
    task_type="SEQ_CLS" (a reward model's scalar head, named `score` in transformers' layout) the head
    trains in full beside the adapters: it starts untrained."""
    from peft import LoraConfig, get_peft_model

    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in lora_cfg.target_modules:
        raise ValueError("learner.lora.target_modules names lm_head, but this model ties it to the input "
                         "embedding; adapt the embedding (embed_tokens) or leave lm_head out")
    config = LoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                        target_modules=list(lora_cfg.target_modules), bias="none", task_type=task_type,
                        modules_to_save=["score"] if task_type == "SEQ_CLS" else None)
    return get_peft_model(model, config)


def load_causal_lm(model_dir: str | Path, *, device: torch.device, attn_implementation: str | None = None,
                   gradient_checkpointing: bool = False, lora=None) -> nn.Module:
    """A causal LM from a Hugging Face directory, fp32 on `device`, in train mode: with
    `gradient_checkpointing` its layers recompute activations in backward, with `lora` (a section with
    rank > 0) only peft adapters train."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32,
        **({"attn_implementation": attn_implementation} if attn_implementation else {})).to(device)
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and autocast, needs no
        # enable_input_require_grads, and is what torch recommends (torch.utils.checkpoint docs).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.rank > 0:
        model = apply_lora(model, lora)
    return model.train()



def to_float(x) -> float:
    """A (possibly DTensor) scalar as a Python float on every rank."""
    from torch.distributed.tensor import DTensor

    return float(x.full_tensor() if isinstance(x, DTensor) else x)

class TrainableModel:
    """`model` with its own AdamW, schedule, autocast and clipped step (module docstring).

    grad_clip: global gradient-norm clip, 0 = off (the norm is still computed, to refuse a non-finite
    step). lr_lambda: LambdaLR's factor of the step count; None = a constant rate. sharded: the
    gradients are FSDP2 DTensor shards, whose norms are reduced over the ranks.
    """

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 0.0,
                 dtype: str = "fp32", sharded: bool = False, lr_lambda: Callable[[int], float] | None = None):
        self.model, self.grad_clip, self.sharded = model, grad_clip, sharded
        self.device = next(model.parameters()).device
        # Parameters stay fp32 in every mode: with bf16 they are the master weights.
        self.autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
        # Only trainable tensors get AdamW state (with LoRA: the adapters; else every parameter, in order).
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay)
        self.scheduler = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    @property
    def lr(self) -> float:
        """The rate the next step uses (the schedule's current value)."""
        return self.optimizer.param_groups[0]["lr"]

    def autocast(self):
        """bf16 compute over fp32 master weights (dtype=bf16); nothing otherwise. Backward runs outside
        it and replays each op in its forward dtype, so gradients reach the fp32 parameters."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self) -> float:
        """Clip and apply the accumulated gradient; returns its norm before clipping. A non-finite norm
        (a NaN/inf loss or reward got through) is not applied at all."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        # Under fsdp2 the gradients are DTensor shards: the norms below are global (DTensor reduces them).
        if self.grad_clip > 0:
            norm = to_float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        elif self.sharded:
            norm = to_float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in params])))
        if math.isfinite(norm):
            self.optimizer.step()
        self.zero_grad()
        return norm

    def train_step(self, loss_fn: Callable[[], tuple[torch.Tensor, dict]]) -> tuple[float, float, dict]:
        """One whole step: `loss_fn()` -> (loss, metrics) under autocast, backward, clipped step.
        Returns (loss, gradient norm, metrics)."""
        self.zero_grad()
        with self.autocast():
            loss, metrics = loss_fn()
        loss.backward()
        return loss.item(), self.clip_and_step(), metrics

    def sft_step(self, batch: TensorBatch) -> float:
        """One supervised step: mean NLL of the completion tokens (the prompt is context, not target)."""
        def nll():
            logp = token_logprobs(completion_logits(self.model, batch), batch["completion_ids"])   # [B, T]
            mask = batch["response_mask"]
            return -(logp * mask).sum() / mask.sum(), {}
        return self.train_step(nll)[0]

    def parameters_finite(self) -> bool:
        """One reduction over every weight: NaN or inf anywhere makes the sum non-finite."""
        with torch.no_grad():
            if self.sharded:
                return math.isfinite(math.fsum(to_float(p.float().sum()) for p in self.model.parameters()))
            return bool(torch.isfinite(torch.stack([p.float().sum() for p in self.model.parameters()]).sum()))

    def state_dict(self, *, optimizer: bool = True) -> dict:
        """Optimizer moments (unless `optimizer=False`: fsdp2 saves its shards elsewhere) and schedule."""
        state = {}
        if optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
