"""Model + tokenizer builders: tiny from-scratch models and converters to plain HF directories.

Public API::

    build_char_tokenizer(alphabet) -> PreTrainedTokenizerFast
    build_tiny_llama(tokenizer, *, hidden_size=128, num_layers=2, num_heads=4,
                     intermediate_size=512, max_position_embeddings=256,
                     tie_word_embeddings=True, seed=0) -> LlamaForCausalLM
    smollm2_135m(out_dir) -> Path
    MODEL_BUILDERS: Registry("model"), fn(out_dir, *, alphabet, **model_kwargs) -> Path
        tiny_llama | smollm2_135m | pretrained(path=...)
    is_complete_model_dir(path) -> bool
    build_model_dir(model_cfg, *, alphabet, seed, cache_dir) -> Path   built or found in the cache
"""

from .builders import MODEL_BUILDERS, build_model_dir, is_complete_model_dir
from .char_tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from .smollm2 import smollm2_135m
from .tiny_llama import build_tiny_llama

__all__ = [
    "MODEL_BUILDERS",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_model_dir",
    "build_tiny_llama",
    "is_complete_model_dir",
    "smollm2_135m",
]
