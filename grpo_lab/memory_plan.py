"""Memory plan of one learner device, computed from config alone before any weights load.

It adds up what one device holds at the learner's peak, item by item, so that `validate()` refuses a
config that cannot fit, with the numbers and the changes that would make it fit, instead of the run
dying out of memory after the model, the engine and the warm-up have loaded. The sizes come from the
model's config (`grpo_lab.models.arch`); nothing is measured, so the plan is an upper bound of the
peak, not a measurement. Units: bytes, shown in GB = 1e9 bytes (the unit of
``learner.device_memory_gb``). P = policy parameters, T = tokens of one micro-batch, e = activation
bytes (4 fp32, 2 bf16), N = ``learner.num_devices``.

* Full fine-tuning: fp32 weights, gradients and AdamW's two moments, 16·P; bf16 adds the 2·P compute
  copy (autocast's weight cache) over fp32 master weights (mixed precision, arXiv 1710.03740).
* LoRA (arXiv 2106.09685): the frozen base at e·P, fp32 adapters r·(in + out) per target module at 16
  bytes each; the reference is the base with adapters off, so no copy.
* Reference (when the objective reads it): e·P. Critic (PPO): the trunk plus a value head, trained
  in full; its update follows the policy's, so its activations are not added.
* Activations of one micro-batch: e·(4h + 2(a + a_kv)·d + 4I) per token per decoder layer, the
  tensors autograd saves in a Llama block (Korthikanti et al., arXiv 2205.05198, §4.1, without
  dropout masks and attention scores, which SDPA's fused kernels do not store); gradient
  checkpointing keeps each layer's input plus one layer in recompute. Not sharded by N.
* Logits: four fp32 copies of the full-vocabulary logits (LM-head output, temperature-scaled copy,
  log-softmax, entropy), over one chunk when ``learner.logits_chunk_tokens`` is set.
* The rollout engine colocated on the learner's device: vLLM on CUDA takes
  ``rollout.gpu_memory_utilization`` of the device (weights and KV cache); on CPU that fraction of RAM
  is its KV cache and its weights come on top; the HF engine holds a weight copy and one generate
  call's KV cache.
* N > 1: weights, gradients, optimizer state, reference and critic sharded FSDP-style (ZeRO-3, arXiv
  1910.02054).

Not counted: the CUDA context and allocator fragmentation, activation gradients in flight, LoRA's own
small activations, and DPO's doubled sequences per pair.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from grpo_lab.models.arch import Arch
from grpo_lab.schema import LEARNER_DTYPES, ConfigError

GB = 1e9
# The H200 / H100-class single GPU the GPU recipes are planned for: the card's marketed 141 GB
# (torch reports a little more, ~140 GiB), so 141e9 bytes is the conservative reading.
DEFAULT_CUDA_MEMORY_GB = 141.0
# Four fp32 copies of the full-vocabulary logits per micro-batch (output, temperature copy,
# log-softmax, entropy).
LOGITS_COPIES = 4
# Adapter rank the refusal message tries when suggesting LoRA.
SUGGESTED_LORA_RANK = 64


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
    declared = cfg.learner.device_memory_gb
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
    if ln.max_tokens_per_micro_batch:
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
    n_dev = max(int(ln.num_devices), 1)
    plan = MemoryPlan(arch, device=kind, device_memory=mem, num_devices=n_dev)
    if _device_kind(cfg, machine) is None:
        plan.notes.append("learner.device=auto planned as cuda (the machine it runs on is not this one)")
    if arch is None:
        plan.notes.append(f"no config for model.builder={cfg.model.builder} model.path={cfg.model.path}: the "
                          "directory is not on this machine and its name is not in grpo_lab.models.arch."
                          "KNOWN_ARCHITECTURES")
        return plan

    P, h, L, V = arch.num_params(), arch.hidden_size, arch.num_layers, arch.vocab_size
    bf16 = ln.dtype == "bf16"
    e = 2 if bf16 else 4                      # activation / frozen-weight bytes
    shard = f"/{n_dev}" if n_dev > 1 else ""
    rank = int(ln.lora.rank)
    add = lambda name, b, f: plan.items.append(PlanItem(name, float(b), f))  # noqa: E731

    if rank > 0:
        A = lora_params(arch, rank, ln.lora.target_modules)
        add("policy base (frozen)", e * P / n_dev, f"{e}·P{shard}, P={P:,}")
        add("LoRA adapters (fp32)", 16 * A, f"16·A (weights 4 + grads 4 + AdamW 8), A=r·Σ(in+out)·L={A:,}")
    else:
        add("policy weights (fp32)", 4 * P / n_dev, f"4·P{shard}, P={P:,}")
        if bf16:
            add("policy bf16 copy", 2 * P / n_dev, f"2·P{shard} (compute copy / autocast cache)")
        add("gradients (fp32)", 4 * P / n_dev, f"4·P{shard}")
        add("AdamW state (fp32)", 8 * P / n_dev, f"8·P{shard} (exp_avg + exp_avg_sq)")

    needs = OBJECTIVES.get(a.objective).needs(a)
    if needs.reference:
        if rank > 0:
            plan.notes.append("reference = base with adapters disabled: no copy")
        else:
            add("reference model", e * P / n_dev, f"{e}·P{shard} (frozen, compute dtype)")
    if needs.critic:
        C = arch.trunk_params() + h + 1
        per = 18 if bf16 else 16
        add("critic (+AdamW)", per * C / n_dev, f"{per}·C{shard}, C=trunk+head={C:,}")

    if "reward_model" in cfg.reward.weights:
        _reward_model_items(cfg, arch, add, plan.notes)

    T = micro_batch_tokens(cfg)
    layer = e * (4 * h + 2 * (arch.num_heads + arch.num_kv_heads) * arch.d + 4 * arch.intermediate_size)
    if ln.gradient_checkpointing:
        add("activations", T * (L * h * e + layer + 2 * h * e),
            f"T·(L·h·e + one layer {layer:,} B + 2h·e), T={T:,}, e={e} (checkpointed)")
    else:
        add("activations", T * (L * layer + 2 * h * e), f"T·(L·{layer:,} B + 2h·e), T={T:,}, e={e}")
    chunk = ln.logits_chunk_tokens
    Tl = min(T, int(chunk)) if chunk else T
    add("logits (fp32)", Tl * V * 4 * LOGITS_COPIES,
        f"{Tl:,} tokens{' (chunk)' if chunk else ''} × V × 4 B × {LOGITS_COPIES} copies")

    eng = _dtype_bytes(r.dtype)
    from grpo_lab.rollout import ROLLOUT_ENGINES

    if r.engine in ROLLOUT_ENGINES and ROLLOUT_ENGINES.fact(r.engine, "reserves_memory_fraction"):
        if r.kv_cache_bytes is not None:   # vLLM then ignores gpu_memory_utilization
            dp = 1 if kind == "cuda" else int(r.data_parallel_size)
            add(f"rollout engine ({r.engine})", dp * (r.kv_cache_bytes + eng * P),
                f"{dp} × ({r.kv_cache_bytes:,} B KV cache (rollout.kv_cache_bytes) + {eng}·P weights)")
        elif kind == "cuda":
            add(f"rollout engine ({r.engine})", r.gpu_memory_utilization * (mem or 0),
                f"gpu_memory_utilization {r.gpu_memory_utilization} × device memory (weights + KV cache)")
        else:   # every replica (rollout.data_parallel_size) reserves its own share of the one RAM
            dp = int(r.data_parallel_size)
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


def _reward_model_items(cfg: DictConfig, arch: Arch, add, notes: list[str]) -> None:
    """The learned reward models a run optimises against (reward=reward_model): each of the ensemble_size
    members holds the trunk and a scalar head, frozen in reward.reward_model.dtype (fp32, or bf16 to score
    only); with online refresh (refresh_every > 0) each also trains in fp32: gradients and AdamW state
    (full), or LoRA adapters. They sit in the trainer process beside the learner, unsharded. Their training
    before RL starts, and their scoring forwards (no gradient), peak below the learner's update and are not
    counted."""
    rm = cfg.reward_model
    if rm.trunk == "path":
        notes.append("reward_model.trunk=path: the reward model's size is not planned (its directory is read when "
                     "it loads)")
        return
    k, C = int(rm.ensemble_size), arch.trunk_params() + arch.hidden_size + 1
    members = f"{k} × " if k > 1 else ""
    if rm.refresh_every > 0 and rm.lora.rank > 0:
        A = lora_params(arch, int(rm.lora.rank), rm.lora.target_modules)
        add("reward model (refreshed, LoRA)", k * (4 * C + 16 * A), f"{members}(4·C + 16·A), C=trunk+head={C:,}, A={A:,}")
    elif rm.refresh_every > 0:
        add("reward model (refreshed, +AdamW)", k * 16 * C, f"{members}16·C (weights, gradients, AdamW), C={C:,}")
    else:
        dtype = cfg.reward.reward_model.dtype
        b = _dtype_bytes(dtype)
        add("reward model (frozen)", k * b * C, f"{members}{b}·C ({dtype}), C=trunk+head={C:,}")


def _with(cfg: DictConfig, **updates) -> DictConfig:
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in updates.items():
        OmegaConf.update(out, key.replace("__", "."), value, force_add=True)
    return out


def _suggestions(cfg: DictConfig, plan: MemoryPlan, machine: bool) -> list[str]:
    """Each change that would help, with the total it would give (computed, not guessed)."""
    ln, mem = cfg.learner, plan.device_memory
    tries = []
    if not ln.lora.rank:
        tries.append(("learner.lora.rank", SUGGESTED_LORA_RANK))
    if ln.dtype != "bf16":
        tries.append(("learner.dtype", "bf16"))
    if not ln.gradient_checkpointing:
        tries.append(("learner.gradient_checkpointing", True))
    if not ln.logits_chunk_tokens:
        tries.append(("learner.logits_chunk_tokens", 1024))
    # A smaller micro-batch: the largest halving that fits (a token budget never below one full sequence).
    budget = ln.max_tokens_per_micro_batch
    key, size, floor = (("learner.max_tokens_per_micro_batch", int(budget), cfg.rollout.max_model_len) if budget
                        else ("learner.micro_batch_size", micro_batch_tokens(cfg) // cfg.rollout.max_model_len, 1))
    smaller = size // 2
    while smaller >= floor and not plan_memory(_with(cfg, **{key.replace(".", "__"): smaller}), machine=machine,
                                               device_memory=mem).fits:
        smaller //= 2
    tries.append((key, max(smaller, floor)))
    out = []
    for key, value in tries:
        if value == OmegaConf.select(cfg, key):
            continue
        total = plan_memory(_with(cfg, **{key.replace(".", "__"): value}), machine=machine, device_memory=mem).total
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value} -> {total / GB:.1f} GB")
    engine = plan.item("rollout engine (vllm)")
    if engine:
        out.append(_engine_share_suggestion(cfg, plan))
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


def _engine_share_suggestion(cfg: DictConfig, plan: MemoryPlan) -> str:
    """The rollout.gpu_memory_utilization that would just fit, and what the value means on this device:
    the engine reserves that share of the GPU's memory, or on the CPU build that share of RAM for every
    replica's KV cache, which the learner then cannot use."""
    r, mem = cfg.rollout, plan.device_memory
    replicas = 1 if plan.device == "cuda" else int(r.data_parallel_size)
    util = r.gpu_memory_utilization - (plan.total - mem) / (mem * replicas)
    share = "of the GPU's memory" if plan.device == "cuda" else "of RAM the vLLM CPU build reserves for its KV cache"
    meaning = f"rollout.gpu_memory_utilization must lie in (0, 1], the share {share}"
    if util >= 0.05:
        return f"rollout.gpu_memory_utilization={util:.2f} would just fit (if the KV cache still holds a batch; {meaning})"
    return f"lowering rollout.gpu_memory_utilization alone cannot fit it ({meaning}; 0.05-0.1 suits small models)"


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
    mode = ln.memory_plan
    errors = []
    if mode not in ("check", "warn", "off"):
        errors.append(f"learner.memory_plan={mode!r}; valid choices: check, warn, off")
    if int(ln.num_devices) < 1:
        errors.append(f"learner.num_devices={ln.num_devices} must be >= 1")
    if ln.device_memory_gb is not None and ln.device_memory_gb <= 0:
        errors.append(f"learner.device_memory_gb={ln.device_memory_gb} must be > 0 or null (detect)")
    # An unknown learner.dtype or an unregistered objective is reported by validate(); the plan needs both.
    if errors or mode == "off" or ln.dtype not in LEARNER_DTYPES \
            or cfg.algorithm.objective not in OBJECTIVES:
        return errors
    try:
        check_fits(cfg, machine=machine)
    except ConfigError as err:
        if mode == "check":
            errors.append(str(err))
        else:
            warnings.warn(str(err), stacklevel=2)
    return errors


__all__ = ["MemoryPlan", "PlanItem", "check_fits", "device_memory_bytes", "lora_params", "memory_plan_errors",
           "micro_batch_tokens", "plan_memory", "resolve_arch"]
