"""Reward models: a trunk with a scalar head read at the last token of prompt + completion, trained on
ranked completions as a second model.

    RewardModel(model_dir, *, lr, grad_clip, seed, lora=None, dtype="fp32", device="cpu", weight_decay=0.01,
                weights_dtype="fp32")
        .scores(prompts, completions, *, batch_size) -> [N] floats    (no gradient)
        .ranking_step(groups, *, loss, margins=None) -> metrics     one step on ranked groups, best first
        .save(dir)                                                  a directory AutoModelForSequenceClassification loads

The layout is transformers' sequence-classification convention (`AutoModelForSequenceClassification`,
num_labels=1): a linear `score` head on the trunk's hidden states, read at each row's last non-pad token
(InstructGPT's reward model, arXiv 2203.02155 §3.5: "a scalar reward" from the final token; TRL's
RewardTrainer and OpenRLHF's train_rm use the same head). Any trunk the lab builds or loads serves (the tiny
Llama, SmolLM2-135M, a local HF directory); the head starts from the run's seed. The reward model scores
*text* with its own tokenizer, so its tokenizer may differ from the policy's. LoRA puts adapters on the
trunk and trains the head in full (grpo_lab.learner.trainable.apply_lora, task_type SEQ_CLS); `dtype` bf16 is
the shared piece's autocast over fp32 weights. A model that only scores may hold its weights in bf16
(`weights_dtype`, reward.reward_model.dtype): half the memory, as verl and OpenRLHF hold reward models. The
step is `SecondModel.ranking_update` (grpo_lab/algos/ranking.py's registered losses: Bradley–Terry with an
optional margin per pair, Plackett–Luce on longer rankings); metrics carry the prefix ``reward_model/``.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from grpo_lab.learner.batch import encode_prompt, encode_target
from grpo_lab.learner.trainable import apply_lora
from grpo_lab.second_models.base import SecondModel


class RewardModel:
    """A scalar-head model over `model_dir`'s trunk (module docstring)."""

    def __init__(self, model_dir: str | Path, *, lr: float, grad_clip: float = 1.0, seed: int = 0, lora=None,
                 dtype: str = "fp32", device: str = "cpu", weight_decay: float = 0.01, weights_dtype: str = "fp32"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)   # the new head's initialisation, without moving the run's generator
            model = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), num_labels=1, dtype=torch.bfloat16 if weights_dtype == "bf16" else torch.float32)
            # The head reads the last token that is not padding: the tokenizer's pad id marks it.
            model.config.pad_token_id = self.tokenizer.pad_token_id
            if lora is not None and lora.rank > 0:
                model = apply_lora(model, lora, task_type="SEQ_CLS")
        self.second = SecondModel(model.to(device), lr=lr, grad_clip=grad_clip, prefix="reward_model/", dtype=dtype,
                                  weight_decay=weight_decay)
        self.model, self.device = self.second.model, torch.device(device)

    def encode(self, prompt: str, completion: str) -> list[int]:
        """Prompt and completion as the reward model's tokens (its own tokenizer and prompt format)."""
        return encode_prompt(self.tokenizer, prompt) + encode_target(self.tokenizer, completion)

    def _forward(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """Scores [N] of token rows, right-padded (the head reads each row's last real token)."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        with self.second.trainable.autocast():
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()

    @torch.no_grad()
    def scores(self, prompts: Sequence[str], completions: Sequence[str], *, batch_size: int = 64) -> list[float]:
        """The reward of each (prompt, completion), in eval mode, `batch_size` rows a forward."""
        rows = [self.encode(p, c) for p, c in zip(prompts, completions)]
        self.model.eval()
        try:
            return [s for i in range(0, len(rows), batch_size) for s in self._forward(rows[i:i + batch_size]).tolist()]
        finally:
            self.model.train()

    def ranking_step(self, groups: Sequence[tuple[str, Sequence[str]]], *, loss: str = "bradley_terry",
                     margins: Sequence[float] | None = None, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step on `groups`, each (prompt, completions best first: a pair is two), forward and
        backward `micro_batch_size` groups at a time (None: all at once; the step is the same); returns
        reward_model/ metrics (loss, pairwise accuracy, margin, gradient norm)."""
        k = max(len(c) for _, c in groups)
        size = micro_batch_size or len(groups)

        def micro_batch(start: int):
            part = groups[start:start + size]
            rows = [self.encode(p, c) for p, completions in part for c in completions]
            mask = torch.tensor([[1.0] * len(c) + [0.0] * (k - len(c)) for _, c in part], device=self.device)
            margin = None if margins is None else torch.tensor(list(margins[start:start + size]),
                                                               dtype=torch.float32, device=self.device)

            def ranked_scores():
                flat = self._forward(rows)                                      # [sum of lengths]
                out = torch.zeros(len(part), k, device=self.device, dtype=flat.dtype)
                out[mask > 0] = flat                                            # row-major: each group's order
                return out
            return ranked_scores, mask, margin

        self.model.train()
        value, metrics = self.second.ranking_update([micro_batch(s) for s in range(0, len(groups), size)], loss=loss)
        return self.second.metrics({"loss": value, **metrics})

    def save(self, path: str | Path) -> None:
        """A directory `AutoModelForSequenceClassification.from_pretrained` loads (LoRA merged in), with the
        tokenizer."""
        # With LoRA, a merged copy: the adapters keep training in this one.
        model = copy.deepcopy(self.model).merge_and_unload() if hasattr(self.model, "merge_and_unload") else self.model
        model.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))


_MODELS: dict[tuple[str, str], "RewardModel"] = {}
_LOCK = threading.Lock()


def loaded_reward_model(path: str | Path, dtype: str = "fp32"):
    """The RewardModel saved at `path` with its weights in `dtype` (fp32, or bf16 to score only), loaded once per
    process (on the GPU when there is one)."""
    key = (str(Path(path).resolve()), dtype)
    with _LOCK:
        if key not in _MODELS:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            _MODELS[key] = RewardModel(key[0], lr=0.0, device=device, weights_dtype=dtype)
        return _MODELS[key]


def forget_reward_model(path: str | Path) -> None:
    """Drop a loaded model, in every dtype (an online refresh is done with it)."""
    path = str(Path(path).resolve())
    with _LOCK:
        for key in [k for k in _MODELS if k[0] == path]:
            del _MODELS[key]
