"""Memory plan of one learner device, computed before any weights load (issue 7).

From the model's *config* only (``transformers.AutoConfig``, or a table of known architectures when the
model directory is on another machine), the learner's settings and the rollout engine's share, it
adds up what one device must hold at the learner's peak, prints it item by item, and refuses (in
``validate()``) a config whose total exceeds the device's memory, saying what to change.

Public API::

    plan_memory(cfg, *, machine=True, device_memory_bytes=None) -> MemoryPlan   # pure arithmetic
    MemoryPlan.render() -> str                                                 # the plan table
    check_fits(cfg, *, machine=True) -> MemoryPlan                             # raises ConfigError
    memory_plan_errors(cfg, *, machine=True) -> list[str]                      # what validate() appends
    resolve_arch(cfg) -> Arch | None ; KNOWN_ARCHITECTURES

Units: bytes; shown in GB = 1e9 bytes (``learner.device_memory_gb`` is in the same unit). Notation
below: P = policy parameters, T = tokens of one micro-batch, h = hidden size, L = layers, V =
vocabulary, I = MLP intermediate size, a / a_kv = attention / key-value heads, d = head dim, N =
``learner.num_devices``, e = activation bytes (4 for fp32, 2 for bf16).

Items and the assumptions behind each (the plan is an upper bound of the learner's peak, not a
measurement):

* policy weights, full fine-tuning: fp32 -> 4·P. bf16 -> 4·P fp32 master weights *plus* 2·P for the
  bf16 copy the forward pass computes with: an explicit bf16 module copy, or torch.autocast's
  weight-cast cache, which keeps one bf16 copy of every weight for the whole autocast region
  (https://pytorch.org/docs/stable/amp.html, ``cache_enabled``). Either way 6·P; that bf16 is
  *more* weight memory than fp32 is the price of fp32 master weights (Micikevicius et al., mixed
  precision training, arXiv 1710.03740); bf16 pays for itself in activations, logits and the
  reference model.
* gradients: fp32, 4·P (they accumulate on the fp32 master weights).
* AdamW state: exp_avg + exp_avg_sq in fp32, 8·P (torch.optim.AdamW keeps both in the parameter's
  dtype, which is fp32 here).
  Weights + gradients + AdamW = 16·P bytes in fp32: a 7.6B model needs 121.6 GB before activations.
* LoRA (``learner.lora.rank`` r > 0, arXiv 2106.09685): the base is frozen in the compute dtype
  (4·P or 2·P, no gradient, no optimizer state); the adapters are trainable: for every target
  module W (in -> out) of every layer, A is r×in and B is out×r, so r·(in + out) parameters, kept
  in fp32 (peft's default ``autocast_adapter_dtype=True`` upcasts adapters to fp32), 16 bytes each
  (weights, gradients, AdamW). No reference copy: the reference is the base with adapters disabled.
* reference model (only when the objective reads it: ``OBJECTIVES[...].needs_reference``): a frozen
  copy in the compute dtype, 4·P (fp32) or 2·P (bf16); its forward runs under no_grad in the
  scoring phase, so it adds no stored activations.
* critic (``needs_critic``): the policy's trunk (P without an untied lm_head) + a value head of h + 1,
  trained in full like the policy (16 or 18 bytes per parameter) even under LoRA, because the
  learner's critic is a separate AutoModel. Its update runs after the policy's, so its activations
  are not added to the policy's (the peak is one of the two, and the policy's has the logits).
* activations of one micro-batch, T tokens: T = ``learner.max_tokens_per_micro_batch`` when set,
  else sequences × ``rollout.max_model_len`` (prompt + completion never exceed it), with sequences =
  min(``learner.micro_batch_size``, the sequences of one minibatch). Per token per layer, counting
  the tensors autograd saves as Korthikanti et al. (arXiv 2205.05198, §4.1) do for GPT — there
  s·b·h·(34 + 5·a·s/h) bytes at 2 bytes per value — but for a Llama-style layer (RMSNorm, GQA,
  SwiGLU, no dropout):
      e · (4h + 2(a + a_kv)·d + 4I)
  = two norm inputs + two norm outputs (the q/k/v and MLP inputs) 4h; Q and K after RoPE, V and the
  attention output (a + a_kv)·d + a_kv·d + a·d; SwiGLU's gate, up, silu(gate) and their product 4I.
  For GPT (a_kv = a, a·d = h, a 4h GeLU MLP saving 2 tensors) this gives the paper's 34 minus its
  dropout masks and attention-score terms. The paper's 5·a·s/h term (the s×s attention scores) is
  dropped: transformers' default attention is SDPA, whose fused kernels (FlashAttention,
  memory-efficient) never store the scores; with ``attn_implementation="eager"`` add a·s·e per token
  per layer. Without checkpointing all L layers are stored; with gradient checkpointing each layer
  keeps only its input (h·e per token) and one layer's full set exists during its recompute
  (Korthikanti et al.'s "full recomputation"). Plus the final norm's input and output (2h·e).
  Activations are not sharded by N (every device runs its own micro-batch).
* full-vocabulary logits: T' × V × 4 bytes × 4 copies, where the 4 fp32 copies are the ones issue 7
  counts per micro-batch (the lm_head output, the temperature-scaled copy, log-softmax, entropy),
  and T' = min(T, ``learner.logits_chunk_tokens``) when chunked (only one chunk's logits exist at a
  time; the chunked path must recompute or backpropagate chunk by chunk to keep that true).
* rollout engine's share, colocated on the learner's device (the default and the only layout the
  config expresses today): vLLM on CUDA -> ``rollout.gpu_memory_utilization`` × device memory, which
  is vLLM's budget for *all* of its memory, weights and KV cache included (vLLM EngineArgs:
  "fraction of GPU memory to be used for the model executor"). vLLM on CPU -> that fraction of RAM
  is the KV cache (shared/ENVIRONMENT.md) and the engine's own weights come on top (P × the
  rollout dtype). The HF engine -> its own weight copy + the KV cache of one generate call
  (prompts × G sequences × max_model_len × 2·L·a_kv·d × e).
* sharding (``learner.num_devices`` N > 1): FSDP-style full sharding (ZeRO-3, arXiv 1910.02054)
  divides weights, bf16 copy, gradients, optimizer state, the reference and the critic by N; the
  gathered layer in flight is not counted. grpo_lab's learner does not shard yet (FSDP2 is the
  plan in shared/ARCHITECTURE.md): N > 1 plans the recipe it needs, it does not make it run.

Not counted: the CUDA context and allocator fragmentation (a few GB), activation gradients in
flight during backward, LoRA's own small activations, and DPO's doubled sequences per pair.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from grpo_lab.config import ConfigError

GB = 1e9
# The H200 / H100-class single GPU issue 7 plans the GPU recipes for: the card's marketed 141 GB
# (torch reports a little more, ~140 GiB), so 141e9 bytes is the conservative reading.
DEFAULT_CUDA_MEMORY_GB = 141.0
# Four fp32 copies of the full-vocabulary logits per micro-batch (issue 7: output, temperature copy,
# log-softmax, entropy).
LOGITS_COPIES = 4
# tiny_llama's vocabulary is 4 specials + the task's alphabet (grpo_lab/models/char_tokenizer.py),
# which is only known once the task is built; 4 + 96 (printable ASCII, newline) bounds it.
TINY_VOCAB_BOUND = 100
# Adapter rank the refusal message tries when suggesting LoRA.
SUGGESTED_LORA_RANK = 64


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


def resolve_arch(cfg: DictConfig) -> Optional[Arch]:
    """The policy's architecture from config alone (no weights), through the model builder's registry
    fact `architecture` (grpo_lab/models/builders.py). None when unknown (the plan is then skipped, and
    says so) — e.g. a plug-in builder that declares none."""
    from grpo_lab.models import MODEL_BUILDERS

    if cfg.model.builder not in MODEL_BUILDERS:
        return None
    arch = MODEL_BUILDERS.fact(cfg.model.builder, "architecture")
    return arch(cfg.model) if arch is not None else None


@dataclass
class PlanItem:
    name: str
    bytes: float
    formula: str


@dataclass
class MemoryPlan:
    """What one learner device holds at the learner's peak; ``items`` in bytes."""

    arch: Optional[Arch]
    items: list[PlanItem] = field(default_factory=list)
    device: str = "cpu"
    device_memory: Optional[float] = None     # bytes; None = unknown (nothing to check against)
    num_devices: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(i.bytes for i in self.items))

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory is None or self.arch is None else self.total <= self.device_memory

    def item(self, name: str) -> float:
        return sum(i.bytes for i in self.items if i.name == name)

    def render(self) -> str:
        if self.arch is None:
            return "memory plan: skipped (" + "; ".join(self.notes) + ")"
        a = self.arch
        head = (f"memory plan: {a.name} ({a.num_params() / 1e9:.3f}B params; h={a.hidden_size} L={a.num_layers} "
                f"heads={a.num_heads}/{a.num_kv_heads} I={a.intermediate_size} V={a.vocab_size}"
                f"{' tied' if a.tie_word_embeddings else ''}), per learner device ({self.device}, "
                f"{self.num_devices} device{'s' if self.num_devices > 1 else ''})")
        w = max(len(i.name) for i in self.items)
        lines = [head, f"  {'item':<{w}}  {'GB':>9}  formula"]
        lines += [f"  {i.name:<{w}}  {i.bytes / GB:9.3f}  {i.formula}" for i in self.items]
        lines.append(f"  {'total':<{w}}  {self.total / GB:9.3f}")
        if self.device_memory is None:
            lines.append(f"  {'device memory':<{w}}  {'unknown':>9}  (not checked)")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'device memory':<{w}}  {self.device_memory / GB:9.3f}  {verdict} "
                         f"(headroom {(self.device_memory - self.total) / GB:.3f} GB)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _device_kind(cfg: DictConfig, machine: bool) -> Optional[str]:
    """"cuda" / "cpu" for the learner, or None when it cannot be known here (auto, machine=False)."""
    dev = cfg.learner.device
    if dev in ("cuda", "cpu"):
        return dev
    if machine:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return None


def device_memory_bytes(cfg: DictConfig, *, machine: bool = True) -> Optional[float]:
    """learner.device_memory_gb when declared; else on this machine the CUDA device's total memory or
    the RAM; else (machine=False) 141 GB for a device=cuda recipe; else None (unknown)."""
    declared = cfg.learner.get("device_memory_gb")
    if declared is not None:
        return float(declared) * GB
    kind = _device_kind(cfg, machine)
    if machine:
        if kind == "cuda":
            import torch

            # No CUDA here although the recipe asks for it: validate() reports that; nothing to plan against.
            return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DEFAULT_CUDA_MEMORY_GB * GB if kind == "cuda" else None


def micro_batch_tokens(cfg: DictConfig) -> int:
    """Tokens of one micro-batch: the token budget, else sequences × rollout.max_model_len."""
    ln, r = cfg.learner, cfg.rollout
    if ln.get("max_tokens_per_micro_batch"):
        return int(ln.max_tokens_per_micro_batch)
    group = max([r.group_size, *(r.group_size_schedule or {}).values()])
    per_minibatch = math.ceil(cfg.trainer.prompts_per_step * group / max(cfg.algorithm.minibatches, 1))
    return min(ln.micro_batch_size, per_minibatch) * r.max_model_len


def _dtype_bytes(name: str) -> int:
    return 2 if name in ("bf16", "bfloat16", "fp16", "float16", "half") else 4


def lora_params(arch: Arch, rank: int, targets) -> int:
    """Trainable LoRA parameters: r·(in + out) per targeted linear layer, in every decoder layer."""
    shapes = arch.linear_shapes()
    return arch.num_layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def plan_memory(cfg: DictConfig, *, machine: bool = True, device_memory: Optional[float] = None) -> MemoryPlan:
    """The plan of one learner device for ``cfg`` (pure arithmetic on the model's config; nothing loads).

    ``device_memory`` (bytes) overrides detection (``device_memory_bytes``)."""
    from grpo_lab.objectives import OBJECTIVES

    ln, r, a = cfg.learner, cfg.rollout, cfg.algorithm
    arch = resolve_arch(cfg)
    kind = _device_kind(cfg, machine) or "cuda"
    mem = device_memory if device_memory is not None else device_memory_bytes(cfg, machine=machine)
    n_dev = max(int(ln.get("num_devices", 1) or 1), 1)
    plan = MemoryPlan(arch, device=kind, device_memory=mem, num_devices=n_dev)
    if _device_kind(cfg, machine) is None:
        plan.notes.append("learner.device=auto planned as cuda (the machine it runs on is not this one)")
    if arch is None:
        plan.notes.append(f"no config for model.builder={cfg.model.builder} model.path={cfg.model.path}: the "
                          "directory is not on this machine and its name is not in grpo_lab.memory_plan."
                          "KNOWN_ARCHITECTURES")
        return plan

    P, h, L, V = arch.num_params(), arch.hidden_size, arch.num_layers, arch.vocab_size
    bf16 = ln.get("dtype", "fp32") == "bf16"
    e = 2 if bf16 else 4                      # activation / frozen-weight bytes
    shard = f"/{n_dev}" if n_dev > 1 else ""
    lora = ln.get("lora") or {}
    rank = int(lora.get("rank", 0) or 0)
    add = lambda name, b, f: plan.items.append(PlanItem(name, float(b), f))  # noqa: E731

    if rank > 0:
        A = lora_params(arch, rank, lora.get("target_modules") or [])
        add("policy base (frozen)", e * P / n_dev, f"{e}·P{shard}, P={P:,}")
        add("LoRA adapters (fp32)", 16 * A, f"16·A (weights 4 + grads 4 + AdamW 8), A=r·Σ(in+out)·L={A:,}")
    else:
        add("policy weights (fp32)", 4 * P / n_dev, f"4·P{shard}, P={P:,}")
        if bf16:
            add("policy bf16 copy", 2 * P / n_dev, f"2·P{shard} (compute copy / autocast cache)")
        add("gradients (fp32)", 4 * P / n_dev, f"4·P{shard}")
        add("AdamW state (fp32)", 8 * P / n_dev, f"8·P{shard} (exp_avg + exp_avg_sq)")

    objective = OBJECTIVES.get(a.objective)
    if objective.needs_reference(a):
        if rank > 0:
            plan.notes.append("reference = base with adapters disabled: no copy")
        else:
            add("reference model", e * P / n_dev, f"{e}·P{shard} (frozen, compute dtype)")
    if objective.needs_critic(a):
        C = arch.trunk_params() + h + 1
        per = 18 if bf16 else 16
        add("critic (+AdamW)", per * C / n_dev, f"{per}·C{shard}, C=trunk+head={C:,}")

    T = micro_batch_tokens(cfg)
    layer = e * (4 * h + 2 * (arch.num_heads + arch.num_kv_heads) * arch.d + 4 * arch.intermediate_size)
    if ln.get("gradient_checkpointing"):
        add("activations", T * (L * h * e + layer + 2 * h * e),
            f"T·(L·h·e + one layer {layer:,} B + 2h·e), T={T:,}, e={e} (checkpointed)")
    else:
        add("activations", T * (L * layer + 2 * h * e), f"T·(L·{layer:,} B + 2h·e), T={T:,}, e={e}")
    chunk = ln.get("logits_chunk_tokens")
    Tl = min(T, int(chunk)) if chunk else T
    add("logits (fp32)", Tl * V * 4 * LOGITS_COPIES,
        f"{Tl:,} tokens{' (chunk)' if chunk else ''} × V × 4 B × {LOGITS_COPIES} copies")

    eng = _dtype_bytes(r.dtype)
    from grpo_lab.rollout import ROLLOUT_ENGINES

    if r.engine in ROLLOUT_ENGINES and ROLLOUT_ENGINES.fact(r.engine, "reserves_memory_fraction"):
        if kind == "cuda":
            add(f"rollout engine ({r.engine})", r.gpu_memory_utilization * (mem or 0),
                f"gpu_memory_utilization {r.gpu_memory_utilization} × device memory (weights + KV cache)")
        else:   # every replica (rollout.data_parallel_size) reserves its own share of the one RAM
            dp = int(r.get("data_parallel_size", 1))
            add(f"rollout engine ({r.engine})", dp * (r.gpu_memory_utilization * (mem or 0) + eng * P),
                f"{dp} × ({r.gpu_memory_utilization} × RAM (KV cache) + {eng}·P weights)" if dp > 1 else
                f"{r.gpu_memory_utilization} × RAM (KV cache) + {eng}·P weights")
    else:
        group = max([r.group_size, *(r.group_size_schedule or {}).values()])
        kv = cfg.trainer.prompts_per_step * group * r.max_model_len * 2 * L * arch.num_kv_heads * arch.d * eng
        add(f"rollout engine ({r.engine})", eng * P + kv, f"{eng}·P weights + KV cache of one generate call")
    if n_dev > 1:
        plan.notes.append(f"learner.num_devices={n_dev}: weights, gradients, optimizer, reference and critic "
                          "sharded FSDP-style (learner.strategy=fsdp2 under torchrun --nproc_per_node N)")
    return plan


def _with(cfg: DictConfig, **updates) -> DictConfig:
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in updates.items():
        OmegaConf.update(out, key.replace("__", "."), value, force_add=True)
    return out


def _suggestions(cfg: DictConfig, plan: MemoryPlan, machine: bool) -> list[str]:
    """Each change that would help, with the total it would give (computed, not guessed)."""
    ln, mem = cfg.learner, plan.device_memory
    tries = []
    if not (ln.get("lora") or {}).get("rank"):
        tries.append(("learner.lora.rank", SUGGESTED_LORA_RANK))
    if ln.get("dtype", "fp32") != "bf16":
        tries.append(("learner.dtype", "bf16"))
    if not ln.get("gradient_checkpointing"):
        tries.append(("learner.gradient_checkpointing", True))
    if not ln.get("logits_chunk_tokens"):
        tries.append(("learner.logits_chunk_tokens", 1024))
    # A smaller micro-batch: the largest halving that fits (a token budget never below one full sequence).
    budget = ln.get("max_tokens_per_micro_batch")
    key, size, floor = (("learner.max_tokens_per_micro_batch", int(budget), cfg.rollout.max_model_len) if budget
                        else ("learner.micro_batch_size", micro_batch_tokens(cfg) // cfg.rollout.max_model_len, 1))
    smaller = size // 2
    while smaller >= floor and not plan_memory(_with(cfg, **{key.replace(".", "__"): smaller}), machine=machine,
                                               device_memory=mem).fits:
        smaller //= 2
    tries.append((key, max(smaller, floor)))
    out = []
    for key, value in tries:
        if value == ln.get(key.split(".")[-1]):
            continue
        total = plan_memory(_with(cfg, **{key.replace(".", "__"): value}), machine=machine, device_memory=mem).total
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value} -> {total / GB:.1f} GB")
    engine = plan.item("rollout engine (vllm)")
    if engine and plan.device == "cuda":
        util = cfg.rollout.gpu_memory_utilization - (plan.total - mem) / mem
        out.append(f"rollout.gpu_memory_utilization={util:.2f} would just fit (if the KV cache still holds a batch)"
                   if util >= 0.05 else "lowering rollout.gpu_memory_utilization alone cannot fit it")
    sharded = _fewest_devices(cfg, plan, machine)
    out.append(f"learner.num_devices={sharded} (FSDP full sharding, declared in the recipe's header)" if sharded
               else "no learner.num_devices <= 128 fits without other changes")
    # Together: the changes that keep full fine-tuning, then LoRA on top if that is still not enough.
    combined = {k.replace(".", "__"): v for k, v in tries if k in (
        "learner.dtype", "learner.gradient_checkpointing", "learner.logits_chunk_tokens")}
    if len(combined) > 1:
        both = _with(cfg, **combined)
        p = plan_memory(both, machine=machine, device_memory=mem)
        what = " ".join(f"{k.replace('__', '.')}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in combined.items())
        n = None if p.fits else _fewest_devices(both, p, machine)
        out.append(f"together {what} -> {p.total / GB:.1f} GB" + ("" if p.fits else (
            f", fits with learner.num_devices={n}" if n else ", still too large on any number of devices")))
    return out


def _fewest_devices(cfg: DictConfig, plan: MemoryPlan, machine: bool) -> Optional[int]:
    """Smallest power-of-two learner.num_devices (<= 128) whose sharded plan fits, or None."""
    return next((n for n in (2, 4, 8, 16, 32, 64, 128) if n > plan.num_devices and plan_memory(
        _with(cfg, learner__num_devices=n), machine=machine, device_memory=plan.device_memory).fits), None)


def check_fits(cfg: DictConfig, *, machine: bool = True) -> MemoryPlan:
    """The plan, or ConfigError when its total exceeds the device's memory (numbers + what to change)."""
    plan = plan_memory(cfg, machine=machine)
    if plan.fits is False:
        raise ConfigError(
            f"the learner does not fit: the memory plan needs {plan.total / GB:.1f} GB per device but the device has "
            f"{plan.device_memory / GB:.1f} GB (learner.device_memory_gb; set it if detection is wrong). Largest items: "
            + ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in sorted(plan.items, key=lambda i: -i.bytes)[:4])
            + ". Each of these changes alone would give: " + "; ".join(_suggestions(cfg, plan, machine))
            + ". Or set learner.memory_plan=warn to run anyway. The plan:\n" + plan.render())
    return plan


def memory_plan_errors(cfg: DictConfig, *, machine: bool = True) -> list[str]:
    """What validate() appends: the plan's own settings, then the fit (per learner.memory_plan)."""
    from grpo_lab.objectives import OBJECTIVES

    ln = cfg.learner
    mode = ln.get("memory_plan", "check")
    errors = []
    if mode not in ("check", "warn", "off"):
        errors.append(f"learner.memory_plan={mode!r}; valid choices: check, warn, off")
    if int(ln.get("num_devices", 1)) < 1:
        errors.append(f"learner.num_devices={ln.num_devices} must be >= 1")
    if ln.get("device_memory_gb") is not None and ln.device_memory_gb <= 0:
        errors.append(f"learner.device_memory_gb={ln.device_memory_gb} must be > 0 or null (detect)")
    if ln.get("dtype", "fp32") not in ("fp32", "bf16"):
        errors.append(f"learner.dtype={ln.dtype!r}; valid choices: fp32, bf16")
    # An unregistered objective is already reported; the plan needs its facts.
    if errors or mode == "off" or cfg.algorithm.objective not in OBJECTIVES:
        return errors
    try:
        check_fits(cfg, machine=machine)
    except ConfigError as err:
        if mode == "check":
            errors.append(str(err))
        else:
            warnings.warn(str(err), stacklevel=2)
    return errors


__all__ = ["Arch", "KNOWN_ARCHITECTURES", "MemoryPlan", "PlanItem", "arch_from_hf_config", "check_fits",
           "device_memory_bytes", "known_arch", "lora_params", "memory_plan_errors", "micro_batch_tokens",
           "plan_memory", "resolve_arch"]
