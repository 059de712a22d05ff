"""A tiny randomly initialised Llama for lab-scale runs on CPU.

Sizes: hidden 128, 2 layers, 4 heads, MLP 512, tied embeddings, character vocabulary: ~0.53M
parameters, small enough that a short SFT warm-up plus GRPO on a two-core CPU learns 2-term 2-digit
``chain_sum``.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A float32 ``LlamaForCausalLM`` sized for ``tokenizer`` (vocab = ``len(tokenizer)``).

    pad/bos/eos ids come from the tokenizer. Initialisation is deterministic given ``seed`` and does
    not disturb the caller's global torch RNG (it runs inside ``torch.random.fork_rng``).
    Full multi-head attention (``num_key_value_heads = num_heads``).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    # generate() and vLLM read these from generation_config.json; keep them consistent.
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
