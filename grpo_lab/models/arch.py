"""The sizes of a Llama-style decoder that the memory plan needs, from a model's config alone.

A model builder declares its architecture as the registry fact `architecture` (model config section
-> `Arch`), so the planner knows a policy's size before any weights load: from `config.json`
(``transformers.AutoConfig``) when the directory is here, else from a table of known models, for
recipes composed on a machine that does not hold the directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# tiny_llama's vocabulary is 4 specials + the task's alphabet (grpo_lab/models/char_tokenizer.py),
# which is only known once the task is built; 4 + 96 (printable ASCII, newline) bounds it.
TINY_VOCAB_BOUND = 100


@dataclass(frozen=True)
class Arch:
    """The sizes of a Llama-style decoder (Llama, Qwen2/2.5/3, Mistral, SmolLM2) that the plan needs."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: Optional[int] = None       # null = hidden_size / num_heads
    qkv_bias: bool = False               # Qwen2 / Qwen2.5: biases on q, k, v
    qk_norm: bool = False                # Qwen3: RMSNorm on each head's q and k
    source: str = ""                     # where the numbers come from

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by its HF module name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.d, self.num_kv_heads * self.d, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        h = self.hidden_size
        n = sum(i * o for i, o in self.linear_shapes().values())
        if self.qkv_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.d
        if self.qk_norm:
            n += 2 * self.d
        return n + 2 * h                                      # + input and post-attention RMSNorm

    def lm_head_params(self) -> int:
        """Parameters of the output layer that are not the embedding's (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def trunk_params(self) -> int:
        """Embedding + layers + final norm: what AutoModel (no lm_head) holds, e.g. the critic's trunk."""
        return self.vocab_size * self.hidden_size + self.num_layers * self.layer_params() + self.hidden_size

    def num_params(self) -> int:
        return self.trunk_params() + self.lm_head_params()


def _hf(name: str) -> str:
    return f"https://huggingface.co/{name}/blob/main/config.json"


# Public config.json values (the URL in each `source`), for models named by GPU recipes whose
# directories exist only on the GPU machine. Keyed by the lower-cased directory name, without an
# -Instruct / -Base / -RL / -Chat suffix (the suffix does not change the architecture).
KNOWN_ARCHITECTURES: dict[str, Arch] = {a.name.lower(): a for a in [
    Arch("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, source=_hf("HuggingFaceTB/SmolLM2-135M-Instruct")),
    Arch("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True, source=_hf("Qwen/Qwen2.5-0.5B")),
    Arch("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True, source=_hf("Qwen/Qwen2.5-1.5B")),
    Arch("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True, source=_hf("Qwen/Qwen2.5-7B")),
    Arch("Qwen2.5-Math-7B", 3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True,
         source=_hf("Qwen/Qwen2.5-Math-7B")),
    Arch("Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064, False, qkv_bias=True, source=_hf("Qwen/Qwen2.5-32B")),
    Arch("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, False, head_dim=128, qk_norm=True, source=_hf("Qwen/Qwen3-8B")),
    Arch("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, source=_hf("meta-llama/Llama-3.1-8B")),
    Arch("Mistral-7B-v0.1", 4096, 32, 32, 8, 14336, 32000, False, source=_hf("mistralai/Mistral-7B-v0.1")),
    # deepseek-math-7b (base, instruct, rl) is a DeepSeek-LLM-7B-shaped Llama (arXiv 2402.03300).
    Arch("deepseek-math-7b", 4096, 30, 32, 32, 11008, 102400, False, source=_hf("deepseek-ai/deepseek-math-7b-instruct")),
]}
_ALIASES = {"meta-llama-3.1-8b": "llama-3.1-8b"}
_SUFFIXES = ("-instruct", "-base", "-rl", "-chat", "-it")


def arch_from_hf_config(config, name: str = "", source: str = "") -> Arch:
    """An ``Arch`` from a ``transformers.PretrainedConfig`` (AutoConfig), for Llama-style decoders."""
    heads = config.num_attention_heads
    model_type = getattr(config, "model_type", "")
    return Arch(
        name=name or getattr(config, "_name_or_path", "") or model_type,
        hidden_size=config.hidden_size, num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=getattr(config, "head_dim", None),
        # Qwen2's attention always has q/k/v biases (transformers' Qwen2Attention); Llama only with attention_bias.
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        qk_norm=model_type == "qwen3", source=source)


def known_arch(path: str) -> Optional[Arch]:
    """The table's entry for a model directory name (``/models/Qwen2.5-Math-7B-Instruct`` -> Qwen2.5-Math-7B)."""
    key = Path(str(path).rstrip("/")).name.lower()
    for _ in range(3):  # e.g. "-rl" then "-instruct"
        key = _ALIASES.get(key, key)
        if key in KNOWN_ARCHITECTURES:
            return KNOWN_ARCHITECTURES[key]
        key = next((key[: -len(s)] for s in _SUFFIXES if key.endswith(s)), key)
    return None


def tiny_llama_arch(m) -> Arch:
    """tiny_llama's architecture from its model.* sizes."""
    return Arch("tiny_llama", m.hidden_size or 128, m.num_layers or 2, m.num_heads or 4, m.num_heads or 4,
                m.intermediate_size or 512, TINY_VOCAB_BOUND,
                True if m.tie_word_embeddings is None else bool(m.tie_word_embeddings),
                source="model.* sizes; vocabulary bounded by 4 specials + 96 characters")


def smollm2_arch(m) -> Arch:
    return KNOWN_ARCHITECTURES["smollm2-135m"]


def local_dir_arch(m) -> Optional[Arch]:
    """A pretrained model's architecture from model.path's config.json (AutoConfig, no weights), else from
    the table of known models by the directory's name."""
    if not m.path:
        return None
    if (Path(m.path) / "config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(m.path), local_files_only=True)
        config = getattr(config, "text_config", None) or config   # multimodal wrappers
        return arch_from_hf_config(config, name=Path(m.path).name, source=f"{m.path}/config.json")
    return known_arch(m.path)


__all__ = ["Arch", "KNOWN_ARCHITECTURES", "arch_from_hf_config", "known_arch", "local_dir_arch", "smollm2_arch",
           "tiny_llama_arch"]
