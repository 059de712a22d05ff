"""Pure-torch rollout engine on the engine's own copy of the policy.

Two samplers (`rollout.sampler`), the same distribution:

- `generate`: transformers `generate` on every (prompt, sample) row, the committed tables' setting.
- `shared_prefill`: each distinct prompt goes through the model once and its n samples decode from
  copies of its KV cache (the shared-prefix idea of vLLM's prefix caching and of arXiv 2506.05433,
  for sampling), in a plain loop without `generate`'s per-token machinery. It draws different random
  numbers than `generate`, so a table's rows stay on one sampler.

Slower than vLLM on real models but needs nothing beyond torch; the learner sees the same `Rollout`
either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache, TemperatureLogitsWarper, TopPLogitsWarper

from grpo_lab.learner.batch import padded_rows
from grpo_lab.rollout.base import Rollout
from grpo_lab.schema import SAMPLERS


class HFEngine:
    def __init__(self, model, tokenizer, *, sampler: str = "generate"):
        if sampler not in SAMPLERS:
            raise ValueError(f"rollout.sampler={sampler!r} is not one of {', '.join(SAMPLERS)}")
        self.sampler = sampler
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 sampler: str = "generate") -> "HFEngine":
        """The engine's own copy of the weights, as a separate process's engine would have."""
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        return cls(model.to(device), AutoTokenizer.from_pretrained(str(model_dir)), sampler=sampler)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        if seed is not None:
            torch.manual_seed(seed)
        sample = self._sample_shared_prefill if self.sampler == "shared_prefill" else self._sample_generate
        new, lp = sample(prompt_ids, n, temperature, top_p, max_new_tokens, logprobs)   # [N, T_gen] each
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

    def _left_padded(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts left-padded so all generated tokens start at the same column: ids, mask [U, width]."""
        ids, real = padded_rows(prompt_ids, max(len(p) for p in prompt_ids), self.pad_id, torch.long, left=True)
        return ids.to(self.device), real.long().to(self.device)

    def _sample_generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, logprobs):
        """transformers `generate` on all len(prompts)·n rows: (tokens [N, T_gen], logprobs [N, T_gen] or None)."""
        greedy = temperature == 0.0
        ids, attn = self._left_padded(prompt_ids)
        width = ids.shape[1]
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        gen = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=not greedy, max_new_tokens=max_new_tokens,
            temperature=None if greedy else temperature, top_p=None if greedy else top_p, top_k=None,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id, return_dict_in_generate=True,
            output_logits=logprobs)
        new = gen.sequences[:, width:]                                   # [N, T_gen]
        if not logprobs:
            return new, None
        # Raw logits / T: the distribution sampled from (top_p=1), as vLLM's processed logprobs.
        logits = torch.stack(gen.logits, dim=1).float() / (1.0 if greedy else temperature)
        return new, torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)

    def _sample_shared_prefill(self, prompt_ids, n, temperature, top_p, max_new_tokens, logprobs):
        """Each prompt's forward once, its n rows decoding from copies of its KV cache; the same
        distribution as `generate` (its temperature and top-p warpers, the logprobs of logits / T),
        the same stop rule (a row is done at EOS, the loop when every row is). Position ids count real
        tokens, as in `generate` and the learner (grpo_lab/learner/batch.py)."""
        greedy = temperature == 0.0
        ids, attn = self._left_padded(prompt_ids)                              # [U, P]
        width = ids.shape[1]
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=1)
        # Row k continues prompt k // n. A preallocated cache, written in place: a growing one
        # concatenates every layer's keys and values into fresh memory at each token, a large share
        # of the decode loop's time.
        cache = StaticCache(config=self.model.config, max_cache_len=width + max_new_tokens)
        for i, layer in enumerate(out.past_key_values.layers):
            cache.update(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), i)
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)             # [N, V]
        attn = torch.nn.functional.pad(attn, (0, max_new_tokens)).repeat_interleave(n, 0)   # a column per new token
        next_pos = positions[:, -1].repeat_interleave(n, 0) + 1
        warpers = [] if greedy else [TemperatureLogitsWarper(temperature)] + (
            [TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
        done = torch.zeros(len(attn), dtype=torch.bool, device=self.device)
        tokens, token_logprobs = [], []
        for t in range(max_new_tokens):
            scores = logits
            for warp in warpers:
                scores = warp(None, scores)
            token = scores.argmax(-1) if greedy else torch.multinomial(torch.softmax(scores, -1), 1).squeeze(-1)
            token = token.masked_fill(done, self.pad_id)                      # what `generate` writes after EOS
            tokens.append(token)
            if logprobs:
                raw = logits if greedy else logits / temperature            # before top-p, as `_sample_generate`
                token_logprobs.append(torch.log_softmax(raw, -1).gather(-1, token[:, None]).squeeze(-1))
            done |= token == self.eos_id
            if done.all() or t == max_new_tokens - 1:
                break
            attn[:, width + t] = 1
            out = self.model(input_ids=token[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True,
                             cache_position=torch.tensor([width + t], device=self.device))
            logits, next_pos = out.logits[:, -1].float(), next_pos + 1
        return torch.stack(tokens, 1), torch.stack(token_logprobs, 1) if logprobs else None

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            params[name].copy_(t.to(params[name].device, params[name].dtype))

    def close(self) -> None:
        self.model = None
