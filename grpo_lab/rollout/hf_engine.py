"""Pure-torch rollout engine: transformers `generate` on the engine's own copy of the policy.

Slower than vLLM but needs nothing beyond torch; the learner sees the same `Rollout` either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.rollout.base import Rollout


class HFEngine:
    def __init__(self, model, tokenizer):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu") -> "HFEngine":
        """The engine's own copy of the weights, as a separate process's engine would have."""
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        return cls(model.to(device), AutoTokenizer.from_pretrained(str(model_dir)))

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        if seed is not None:
            torch.manual_seed(seed)
        greedy = temperature == 0.0
        # Left-pad prompts so all generated tokens start at the same column.
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.repeat_interleave(n, 0).to(self.device), attn.repeat_interleave(n, 0).to(self.device)
        gen = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=not greedy, max_new_tokens=max_new_tokens,
            temperature=None if greedy else temperature, top_p=None if greedy else top_p, top_k=None,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id, return_dict_in_generate=True,
            output_logits=logprobs)
        new = gen.sequences[:, width:]                                   # [N, T_gen]
        if logprobs:
            # Raw logits / T: the distribution sampled from (top_p=1), as vLLM's processed logprobs.
            logits = torch.stack(gen.logits, dim=1).float() / (1.0 if greedy else temperature)
            lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [N, T_gen]
        out = Rollout([], [], [], [], [], [])
        for k in range(new.shape[0]):
            row = new[k].tolist()
            stop = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            completion = row[:stop]
            out.prompt_ids.append(list(prompt_ids[k // n]))
            out.completion_ids.append(completion)
            out.sampler_logprobs.append(lp[k, :stop].tolist() if logprobs else [])
            out.texts.append(self.tokenizer.decode(completion, skip_special_tokens=True))
            out.group_ids.append(k // n)
            out.truncated.append(self.eos_id not in row[:stop])
        return out

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            params[name].copy_(t.to(params[name].device, params[name].dtype))

    def close(self) -> None:
        self.model = None
