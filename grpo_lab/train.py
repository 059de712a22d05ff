"""The RL loop: `python -m grpo_lab.train [overrides]` (Hydra; `-m` sweeps).

One step reads top to bottom as named phases:

    prompts ─▶ rollout (engine samples G per prompt) ─▶ rewards ─▶ [dynamic sampling]
            ─▶ learner.score (π_old, π_ref, values) ─▶ advantages ─▶ learner.update ─▶ push weights
            ─▶ metrics (rollout/, reward/, actor/, critic/, perf/, eval/) ─▶ metrics.jsonl + wandb

The loop owns no math (grpo_lab/algos) and no I/O format (grpo_lab/logging).
"""

from __future__ import annotations

import inspect
import signal
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from grpo_lab.algos import linear_warmup
from grpo_lab.config import derive_run_name, finalize, register_configs, validate
from grpo_lab.learner.learner import Learner, resolve_device, set_cpu_threads
from grpo_lab.learner.sft import cache_key, warmup_sft
from grpo_lab.logging.recorder import RunRecorder
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.phases import (PREPARE_BATCH, RewardNormalizer, collect_phase, evaluate, group_size_at, make_sampler,
                             rollout_metrics, to_learner_batch)
from grpo_lab.rollout import make_engine
from grpo_lab.tasks import TASKS

register_configs()
# Used by hydra.run.dir / hydra.sweep.subdir, so directories carry the same name as the run.
OmegaConf.register_new_resolver(
    "grpo_run_name", lambda *, _root_: _root_.get("run_name") or derive_run_name(_root_), replace=True)


def call_with_known_kwargs(fn, values: dict):
    """Call a registered builder with the config fields its signature names (one schema, many builders)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(**values)
    return fn(**{k: v for k, v in values.items() if k in params})


def build_task(cfg: DictConfig):
    fields = {k: v for k, v in OmegaConf.to_container(cfg.task, resolve=True).items() if v is not None}
    fields.pop("max_completion_tokens")
    return call_with_known_kwargs(TASKS.get(fields.pop("source")), fields)


def build_policy(cfg: DictConfig, task, device: torch.device) -> tuple[Path, dict]:
    """Model built from config (cached), then supervised warm-up (cached): the RL starting point."""
    cache = Path(cfg.cache_dir)
    model_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if v is not None}
    builder = MODEL_BUILDERS.get(model_kwargs.pop("builder"))
    alphabet = task.alphabet()
    base_dir = cache / "models" / cache_key(cfg.model, alphabet, cfg.seed)
    base_dir = Path(call_with_known_kwargs(builder, {"out_dir": base_dir, "alphabet": alphabet, "seed": cfg.seed,
                                                     **model_kwargs}))
    if cfg.warmup.max_steps == 0:
        return base_dir, {"skipped": True}
    warm_dir = cache / "warmup" / cache_key(cfg.model, cfg.task, cfg.warmup, alphabet, cfg.seed)
    stats = warmup_sft(base_dir, warm_dir, task, cfg.warmup, max_new_tokens=cfg.rollout.max_new_tokens,
                       seed=cfg.seed, device=device)
    return warm_dir, stats


class ProgressLine:
    """A progress bar with a live line of key metrics; in a log file (no TTY), a plain line every ~5 %."""

    def __init__(self, total: int, desc: str):
        self.tty, self.total, self.step = sys.stdout.isatty(), total, 0
        self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stdout, disable=not self.tty)

    def update(self, m: dict, last_eval: dict, *, group_size: int) -> None:
        self.step += 1
        line = (f"reward {m['reward/mean']:.2f} | eval acc {last_eval['eval/accuracy']:.1%} | "
                f"entropy {m.get('actor/entropy', float('nan')):.3f} | G {group_size} | {m['perf/step_time_s']:.2f}s/step")
        self.bar.update(1)
        self.bar.set_postfix_str(line, refresh=False)
        if not self.tty and (self.step % max(1, self.total // 20) == 0 or self.step == self.total):
            print(f"step {self.step}/{self.total} | {line}", flush=True)

    def close(self) -> None:
        self.bar.close()


def schedule_done(cfg: DictConfig, step: int, samples: int) -> bool:
    t = cfg.trainer
    return step >= t.total_steps or (t.total_samples is not None and samples >= t.total_samples)


def train(cfg: DictConfig, recorder: RunRecorder) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    set_cpu_threads(cfg.learner.num_threads)
    device = resolve_device(cfg.learner.device)
    task = build_task(cfg)
    policy_dir, warm = build_policy(cfg, task, device)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    learner = Learner(policy_dir, learner_cfg=cfg.learner, algo_cfg=cfg.algorithm,
                      temperature=cfg.rollout.temperature, seed=cfg.seed,
                      max_completion_len=cfg.rollout.max_new_tokens)
    engine = make_engine(policy_dir, cfg.rollout, seed=cfg.seed, device=str(device))
    a, t = cfg.algorithm, cfg.trainer
    eval_items = task.splits[t.eval_split]
    max_new = cfg.rollout.max_new_tokens
    sampler = make_sampler(cfg, engine, tokenizer, task.splits["train"])
    normalizer = RewardNormalizer(a.reward_ema_decay)
    try:
        before = evaluate(engine, tokenizer, eval_items, max_new_tokens=max_new)
        recorder.log({**before, "warmup/steps": warm.get("steps", 0)}, step=0, samples=0)
        step = samples = 0
        progress = ProgressLine(total=t.total_steps, desc=cfg.run_name)
        last_eval = before
        while not schedule_done(cfg, step, samples):
            step += 1
            sampler.reset(group_size=group_size_at(step, cfg.rollout))
            t_step = time.time()
            scored, metrics = collect_phase(sampler, t.prompts_per_step, dynamic=a.dynamic_sampling.enabled,
                                            max_rounds=a.dynamic_sampling.max_rounds)
            samples += int(metrics.get("rollout/generated_samples", len(scored.rollout)))

            t0 = time.time()
            batch = to_learner_batch(scored, tokenizer)
            metrics.update(learner.score(batch))
            batch, prep_metrics = PREPARE_BATCH.get(a.objective)(batch, a, normalizer=normalizer)
            metrics.update(prep_metrics)
            anchor = linear_warmup(step, a.sft_anchor_warmup, a.sft_anchor_coef)
            metrics.update(learner.update(batch, anchor_coef=anchor))
            t_learn = time.time() - t0

            t0 = time.time()
            engine.load_weights(learner.weights_for_sync())
            t_sync = time.time() - t0

            metrics.update(rollout_metrics(scored))
            metrics.update(sampler.reward_metrics)
            metrics.update({"perf/rollout_s": sampler.timings["rollout"], "perf/reward_s": sampler.timings["reward"],
                            "perf/learn_s": t_learn, "perf/sync_s": t_sync,
                            "perf/step_time_s": time.time() - t_step})
            if t.eval_every and step % t.eval_every == 0 and not schedule_done(cfg, step, samples):
                last_eval = evaluate(engine, tokenizer, eval_items, max_new_tokens=max_new)
                metrics.update(last_eval)
            recorder.log(metrics, step=step, samples=samples)
            progress.update(metrics, last_eval, group_size=sampler.group_size)
        progress.close()
        after = evaluate(engine, tokenizer, eval_items, max_new_tokens=max_new)
        recorder.log(after, step=step, samples=samples)
        if t.save_checkpoint:
            learner.save(recorder.run_dir / "checkpoints" / "final", tokenizer)
        return {"before": before, "after": after, "warmup": {k: v for k, v in warm.items() if k != "history"}}
    finally:
        engine.close()


def print_before_after(result: dict, run_dir: Path) -> None:
    before, after = result["before"], result["after"]
    rows = [("held-out accuracy (greedy)", f"{before['eval/accuracy']:.1%}", f"{after['eval/accuracy']:.1%}"),
            ("mean completion length", f"{before['eval/completion_len_mean']:.2f}",
             f"{after['eval/completion_len_mean']:.2f}"),
            ("mean length of wrong answers", f"{before['eval/wrong_len_mean']:.2f}", f"{after['eval/wrong_len_mean']:.2f}")]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}   before RL   after RL")
    for name, b, c in rows:
        print(f"{name:{width}}   {b:>9}   {c:>8}")
    print(f"gain: {100 * (after['eval/accuracy'] - before['eval/accuracy']):+.1f} points   run: {run_dir}\n")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    # SIGTERM (a cancelled job, `kill`) unwinds like Ctrl-C, so the run is recorded as failed and the
    # engine's processes are shut down instead of being orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    hc = HydraConfig.get()
    cfg = finalize(cfg)
    validate(cfg)  # before any model is loaded
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    recorder = RunRecorder(Path(hc.runtime.output_dir), cfg, overrides=overrides,
                           sweep=Path(hc.sweep.dir).name if multirun else None,
                           swept_keys=[o.split("=", 1)[0] for o in overrides if "=" in o])
    try:
        result = train(cfg, recorder)
    except BaseException as err:
        recorder.finish(status="failed", error=err)
        raise
    recorder.finish(status="completed", extra={"warmup": result["warmup"]})
    print_before_after(result, recorder.run_dir)
    return float(result["after"]["eval/accuracy"])


if __name__ == "__main__":
    main()
