"""Rollouts as padded tensors for the learner.

Layout of one row (P = longest prompt, T = longest completion):

    [pad … pad  p_1 … p_k][c_1 … c_m  pad … pad]
     └──── left-padded prompt (P) ───┘└──── right-padded completion (T) ────┘

so completion token t of every row sits at column P + t and is predicted by the logits at column
P + t − 1: one slice serves the whole batch. Position ids count real tokens only, so a row's
logits do not depend on how much padding its batch needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from grpo_lab.algos import entropy_from_logits


@dataclass
class TensorBatch:
    """Named tensors with a shared first dimension N (sequences), plus the prompt width P."""

    tensors: dict[str, torch.Tensor]
    prompt_width: int
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        assert value.shape[0] == len(self), f"{key}: first dim {value.shape[0]} != batch size {len(self)}"
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.tensors.get(key, default)

    def view(self, prefix: str) -> "TensorBatch":
        """The tensors stored under `prefix` (e.g. "chosen/"), with the prefix stripped."""
        return TensorBatch({k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)},
                           self.prompt_width, self.extras)

    def index(self, idx: torch.Tensor) -> "TensorBatch":
        return TensorBatch({k: v[idx] for k, v in self.tensors.items()}, self.prompt_width, self.extras)

    def to(self, device: torch.device) -> "TensorBatch":
        return TensorBatch({k: v.to(device) for k, v in self.tensors.items()}, self.prompt_width, self.extras)

    def lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Real (prompt, completion) tokens per row [N], [N]; with several views (chosen/, rejected/)
        the longest of them, since each view is one forward of the same rows."""
        P = self.prompt_width
        masks = [v for k, v in self.tensors.items() if k.endswith("attention_mask")]
        # From the attention mask, not response_mask: a multi-turn row's environment tokens are real
        # completion tokens (read by the forward) that the loss ignores.
        prompt = torch.stack([v[:, :P].sum(-1) for v in masks])
        completion = torch.stack([v[:, P:].sum(-1) for v in masks])
        return prompt.amax(0).long(), completion.amax(0).long()

    def trim(self, prompt_width: int, completion_width: int) -> "TensorBatch":
        """The same rows without the padding columns no row needs: [N, P+T] tensors keep columns
        [P − prompt_width, P + completion_width), [N, T] tensors the first completion_width (the
        layout above: prompts are left-padded, completions right-padded). Position ids count real
        tokens, so no row's logits change."""
        P = self.prompt_width
        T = next(v.shape[1] for k, v in self.tensors.items() if k.endswith("response_mask"))
        out = {}
        for k, v in self.tensors.items():
            if v.dim() >= 2 and v.shape[1] == P + T:
                v = v[:, P - prompt_width:P + completion_width]
            elif v.dim() >= 2 and v.shape[1] == T:
                v = v[:, :completion_width]
            out[k] = v
        return TensorBatch(out, prompt_width, self.extras)


def padded_rows(rows: list[list], width: int, fill, dtype: torch.dtype, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows -> ([N, width] tensor padded with `fill` on the left or right, bool mask of the
    real entries), in one scatter: a boolean-mask assignment fills row-major, the order of `flat`."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)                 # [N]
    cols = torch.arange(width)
    real = cols >= width - lengths[:, None] if left else cols < lengths[:, None]      # [N, width]
    out = torch.full((len(rows), width), fill, dtype=dtype)
    out[real] = torch.tensor([x for r in rows for x in r], dtype=dtype)
    return out, real


def collate(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
            sampler_logprobs: list[list[float]] | None = None,
            loss_masks: list[list[int]] | None = None) -> TensorBatch:
    """Pad N (prompt, completion) pairs into the layout above.

    Returns tensors: input_ids, attention_mask, position_ids [N, P+T]; completion_ids,
    response_mask [N, T]; sampler_logprobs [N, T] when given (0 at padding). `loss_masks` (a
    multi-turn rollout's, 1 = the actor's token, 0 = the environment's) multiply into response_mask,
    so nothing trains on what the environment wrote; attention_mask still reads every token.
    """
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    prompt, prompt_real = padded_rows(prompt_ids, P, pad_id, torch.long, left=True)          # [N, P]
    completion, completion_real = padded_rows(completion_ids, T, pad_id, torch.long, left=False)  # [N, T]
    input_ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([prompt_real, completion_real], 1).long()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = completion_real.float()
    if loss_masks is not None:
        response_mask = response_mask * padded_rows(loss_masks, T, 0.0, torch.float32, left=False)[0]
    tensors = {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
               "completion_ids": completion, "response_mask": response_mask}
    if sampler_logprobs is not None:
        # Only rows with a completion carry logprobs (an empty completion has none, whatever was passed).
        rows = [lp if c else [] for lp, c in zip(sampler_logprobs, completion_ids)]
        tensors["sampler_logprobs"] = padded_rows(rows, T, 0.0, torch.float32, left=False)[0]
    return TensorBatch(tensors, P)


def prompt_groups(batch: TensorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [U], inverse [N]): the batch's U distinct prompts as one row index each, and each row's
    prompt as an index into them (row i's prompt is row first[inverse[i]]'s). Prompts are compared
    with their padding marked, so two prompts that differ only in where the padding ends never merge."""
    P, n = batch.prompt_width, len(batch)
    key = batch["input_ids"][:, :P].masked_fill(batch["attention_mask"][:, :P] == 0, -1)      # [N, P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.long, device=inverse.device)
    return first.scatter_reduce_(0, inverse, torch.arange(n, device=inverse.device), "amin"), inverse


def _predicting_outputs(forward, batch: TensorBatch, field: str, *, shared_prompts: bool, logits: bool) -> torch.Tensor:
    """`field` of `forward`'s output (logits or last_hidden_state) at the T positions that predict the
    completion tokens, P − 1 … P + T − 2: [N, T, ·]. `forward` is a CausalLM (logits=True: only the
    positions kept go through the LM head, HF's `logits_to_keep`) or its decoder. shared_prompts:
    `_shared_prompt_outputs`."""
    if shared_prompts:
        return _shared_prompt_outputs(forward, batch, field, logits=logits)
    T = batch["completion_ids"].shape[1]
    out = getattr(forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"], use_cache=False,
                          **({"logits_to_keep": T + 1} if logits else {})), field)
    assert not logits or out.shape[1] == T + 1, "the model ignored logits_to_keep"
    return out[:, -(T + 1):-1]     # the last position predicts nothing


def _shared_prompt_outputs(forward, batch: TensorBatch, field: str, *, logits: bool) -> torch.Tensor:
    """`_predicting_outputs` with learner.shared_prompt_forward: each distinct prompt goes through the
    model once, and the rows that share it run only their completions, attending to its keys and values
    (the KV cache, repeated per row, on the autograd graph): Prefix Grouper's shared-prefix forward
    (arXiv 2506.05433). A group of G completions costs P + G·T positions instead of G·(P + T); the
    outputs and gradients are the same up to float rounding (tests: 1e-5)."""
    P, T = batch.prompt_width, batch["completion_ids"].shape[1]
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    first, inverse = prompt_groups(batch)
    prompt = forward(input_ids=ids[first, :P], attention_mask=mask[first, :P], position_ids=pos[first, :P],
                     use_cache=True, **({"logits_to_keep": 1} if logits else {}))
    cache = prompt.past_key_values
    if cache is None or cache.get_seq_length() != P:
        raise ValueError("learner.shared_prompt_forward needs the model's KV cache of the prompts, which this forward "
                         "did not fill (gradient checkpointing turns it off): set learner.shared_prompt_forward=false "
                         "or learner.gradient_checkpointing=false")
    cache.batch_select_indices(inverse)                   # [U, ·, P, ·] -> [N, ·, P, ·]: each row's prompt
    completion = forward(input_ids=ids[:, P:], attention_mask=mask, position_ids=pos[:, P:], past_key_values=cache,
                         use_cache=True, cache_position=torch.arange(P, P + T, device=ids.device),
                         **({"logits_to_keep": 0} if logits else {}))     # 0: every position
    return torch.cat([getattr(prompt, field)[:, -1:][inverse], getattr(completion, field)[:, :T - 1]], 1)


def completion_logits(model, batch: TensorBatch, temperature: float = 1.0, *,
                      shared_prompts: bool = False) -> torch.Tensor:
    """Logits [N, T, V] that predict each completion token, divided by the sampling temperature.

    Only the last T + 1 positions go through the LM head (HF's `logits_to_keep`): completions are
    right-padded to the row's end, so those are positions P − 1 … P + T − 1, and the last one predicts
    nothing. The prompt positions' logits ([N, P, V], most of a short answer's batch) are never made.
    shared_prompts: each distinct prompt's forward once (`_predicting_outputs`)."""
    logits = _predicting_outputs(model, batch, "logits", shared_prompts=shared_prompts, logits=True)
    return logits.float() / temperature                                  # [N, T, V]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position: [N, T, V], [N, T] -> [N, T]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _entropy(logits: torch.Tensor, entropy: bool, entropy_grad: bool) -> torch.Tensor | None:
    """Token entropy [..] of `logits` [.., V]: on the autograd graph only when a loss term uses it
    (an entropy bonus); as a metric it is computed from detached logits, so backward neither keeps
    its [.., V] intermediates nor differentiates through them."""
    if not entropy:
        return None
    return entropy_from_logits(logits if entropy_grad else logits.detach())


def _head_stats(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy: bool,
                entropy_grad: bool) -> torch.Tensor:
    """One chunk: [c, H], [c] -> [c, 1] (token logprob) or [c, 2] (logprob, entropy)."""
    logits = head(hidden).float() / temperature                           # [c, V]
    logp = token_logprobs(logits, tokens)                                 # [c]
    return torch.stack([logp, _entropy(logits, True, entropy_grad)], -1) if entropy else logp.unsqueeze(-1)


def completion_stats(model, batch: TensorBatch, temperature: float = 1.0, *, chunk_tokens: int | None = None,
                     entropy: bool = False, entropy_grad: bool = False,
                     shared_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token logprobs [N, T], entropy [N, T] or None) of the completions under `model`; the entropy
    carries a gradient only with entropy_grad=True (`_entropy`).

    chunk_tokens=None: from the full logits [N, T, V] (`completion_logits`); otherwise
    `_chunked_completion_stats`. shared_prompts: each distinct prompt's forward once, in either mode
    (`_predicting_outputs`).
    """
    if chunk_tokens is not None:
        return _chunked_completion_stats(model, batch, temperature, chunk_tokens=chunk_tokens, entropy=entropy,
                                         entropy_grad=entropy_grad, shared_prompts=shared_prompts)
    logits = completion_logits(model, batch, temperature, shared_prompts=shared_prompts)   # [N, T, V]
    return token_logprobs(logits, batch["completion_ids"]), _entropy(logits, entropy, entropy_grad)


def _chunked_completion_stats(model, batch: TensorBatch, temperature: float, *, chunk_tokens: int, entropy: bool,
                              entropy_grad: bool, shared_prompts: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_stats` with learner.logits_chunk_tokens: the decoder's hidden states [N, T, H] go
    through the LM head `chunk_tokens` (row, position) slots at a time, each chunk under non-reentrant
    activation checkpointing: backward keeps only the chunk's hidden states and recomputes its logits,
    so at most one chunk's fp32 logits [chunk, V] exist at any moment instead of the micro-batch's
    [N, T, V] three or four times (output, temperature copy, log-softmax, entropy). Same numbers up
    to matmul rounding (tests: 1e-6 in fp32), same gradients. Needs a CausalLM whose logits are
    lm_head(hidden) (Llama, Qwen2, Mistral; not soft-capped heads)."""
    tokens = batch["completion_ids"]
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft wrapper -> HF CausalLM
    N, T = tokens.shape
    hidden = _predicting_outputs(lm.get_decoder(), batch, "last_hidden_state", shared_prompts=shared_prompts,
                                 logits=False).reshape(N * T, -1)      # [N·T, H]
    flat, head, parts = tokens.reshape(N * T), lm.get_output_embeddings(), []
    for start in range(0, N * T, chunk_tokens):
        args = (head, hidden[start:start + chunk_tokens], flat[start:start + chunk_tokens], temperature, entropy,
                entropy_grad)
        parts.append(checkpoint(_head_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _head_stats(*args))                             # [c, 1 or 2]
    stats = torch.cat(parts).view(N, T, -1)                               # [N, T, 1 or 2]
    if not entropy:
        return stats[..., 0], None
    return stats[..., 0], stats[..., 1] if entropy_grad else stats[..., 1].detach()   # detached in _head_stats


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids: through the model's chat template when it has one, else <bos> + the text's tokens
    (task.chat_template / task.system_prompt; the rules live in grpo_lab/prompts.py)."""
    from grpo_lab.prompts import encode_prompt as _encode  # one owner of the prompt format

    return _encode(tokenizer, text)


def encode_target(tokenizer, text: str) -> list[int]:
    """Supervised target ids: the text's tokens + <eos>, so the model learns to stop."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def pair_batch(batch: TensorBatch, chosen: torch.Tensor, rejected: torch.Tensor, weights: torch.Tensor) -> TensorBatch:
    """One row per preference pair: every tensor of `batch` under "chosen/" and "rejected/".

    `loss_mask` (the chosen completion's mask) lets the learner count pairs like sequences.
    """
    tensors = {f"{side}/{k}": v[idx] for side, idx in (("chosen", chosen), ("rejected", rejected))
               for k, v in batch.tensors.items()}
    tensors["pair_weight"] = weights.float()
    tensors["loss_mask"] = tensors["chosen/response_mask"]
    return TensorBatch(tensors, batch.prompt_width, batch.extras)
