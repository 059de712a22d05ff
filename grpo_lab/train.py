"""The RL loop, train(), and the phase helpers it calls. `python -m grpo_lab.train [overrides]` runs it
(Hydra; `-m` sweeps): main() hands train to grpo_lab/launch.py, which owns launch, resume and refusal
(the run directory, the config's checks before any model loads, the record of the outcome).

One step reads top to bottom as named phases:

    prompts ─▶ rollout (engine samples G per prompt) ─▶ rewards ─▶ [dynamic sampling]
            ─▶ learner.score (π_old, π_ref, values) ─▶ objective.prepare (advantages or pairs)
            ─▶ learner.update ─▶ push weights ─▶ metrics (rollout/, reward/, actor/, critic/, perf/, eval/)
            ─▶ metrics.jsonl + wandb ─▶ [resumable checkpoint every trainer.checkpoint_every steps]

The loop owns no math (grpo_lab/algos), no objective (grpo_lab/objectives), no set-up (grpo_lab/run_setup,
shared with the matched-compute SFT control), no sampling pipeline (grpo_lab/sampling) and no I/O format
(grpo_lab/logging, grpo_lab/checkpoint).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from grpo_lab import checkpoint, launch
from grpo_lab.backends import TRAINER_BACKENDS
from grpo_lab.cpu_placement import engine_cores, plan_placement
from grpo_lab.evaluation import evaluate_held_out
from grpo_lab.interaction import build_environment, step_record
from grpo_lab.learner import distributed
from grpo_lab.learner.learner import release_freed_host_memory
from grpo_lab.logging.recorder import RunRecorder
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.progress import heartbeat
from grpo_lab.rollout import ROLLOUT_ENGINES
from grpo_lab.run_setup import log_initial_eval, start_run
from grpo_lab.sampling import RewardNormalizer, RolloutPipeline, rollout_metrics, to_learner_batch


class NonFiniteError(RuntimeError):
    """The run produced NaN/inf values it cannot recover from; no checkpoint is written over them."""


class ProgressLine:
    """A progress bar with a live line of key metrics; in a log file (no TTY), a plain line every ~5 %."""

    def __init__(self, total: int, desc: str, start: int = 0):
        self.tty, self.total, self.step = sys.stdout.isatty(), total, start
        self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, file=sys.stdout,
                        disable=not self.tty)

    def update(self, m: dict, last_eval: dict, *, group_size: int) -> None:
        self.step += 1
        # Preference objectives compute no entropy: leave it out rather than print a NaN that reads as a failure.
        entropy = f"entropy {m['actor/entropy']:.3f} | " if "actor/entropy" in m else ""
        line = (f"reward {m['reward/mean']:.2f} | eval acc {last_eval['eval/accuracy']:.1%} | "
                f"{entropy}G {group_size} | {m['perf/step_time_s']:.2f}s/step")
        self.bar.update(1)
        self.bar.set_postfix_str(line, refresh=False)
        if not self.tty and (self.step % max(1, self.total // 20) == 0 or self.step == self.total):
            print(f"step {self.step}/{self.total} | {line}", flush=True)

    def close(self) -> None:
        self.bar.close()


def schedule_done(cfg: DictConfig, step: int, samples: int) -> bool:
    t = cfg.trainer
    return step >= t.total_steps or (t.total_samples is not None and samples >= t.total_samples)


def evaluate_and_log_samples(engine, tokenizer, items: list, cfg: DictConfig, recorder: RunRecorder, *,
                             step: int, environment=None) -> dict:
    """Held-out evaluation (grpo_lab.evaluation.evaluate_held_out; with a multi-turn `environment`,
    first answer, its reply and the revision); its first trainer.samples_per_log greedy completions go
    to samples.jsonl."""
    rows: list[dict] = []
    k = cfg.trainer.get("eval_sampled_k", 0)
    with heartbeat(f"evaluation at step {step}: {len(items)} held-out items, greedy"
                   f"{f' + {k} samples each' if k else ''}, up to {cfg.rollout.max_new_tokens} new tokens"):
        metrics = evaluate_held_out(engine, tokenizer, items, cfg, step=step, samples=rows,
                                    max_samples=cfg.trainer.samples_per_log, environment=environment)
    recorder.log_samples(rows, step=step, kind="eval")
    return metrics


def host_tree_rss_gib(root: psutil.Process | None = None) -> float:
    """Resident memory of `root` (default: this process) and all its children, e.g. vLLM's engine
    processes, in GiB: what the machine must hold for the run (scripts/peak_tree_rss.py samples it)."""
    root = root or psutil.Process()
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:   # a child that ended between the listing and the read
            pass
    return total / 2**30


@dataclass
class RunParts:
    """What one run trains with: the learner, the rollout engine, the pipeline that feeds it prompts,
    the objective, the reward normalizer, the held-out items it is evaluated on, and the multi-turn
    environment (None: single-turn)."""
    learner: Any
    engine: Any
    pipeline: RolloutPipeline
    objective: Any
    normalizer: RewardNormalizer
    eval_items: list
    environment: Any = None


@dataclass
class LoopState:
    """The counters a checkpoint carries: steps and samples done, steps skipped as non-finite, the
    evaluation before training and the newest one (the progress line's "eval acc", also after a resume)."""
    step: int = 0
    samples: int = 0
    bad_steps: int = 0
    before: dict = field(default_factory=dict)
    latest_eval: dict = field(default_factory=dict)


def start_learner(cfg: DictConfig, start: Any, resume_from: Path | None) -> tuple[Any, Any, dict | None]:
    """(learner, engine builder, the checkpoint's state or None); a resumed learner loads its
    checkpoint here, before the engine starts, so a bad checkpoint fails cheaply."""
    # Where the learner and the engine run: this process (or torchrun ranks), or Ray actors (backends.py).
    build_learner, build_engine = TRAINER_BACKENDS.get(cfg.trainer.backend)(cfg)
    learner = build_learner(cfg, start.policy_dir, temperature=cfg.rollout.temperature, seed=cfg.seed,
                            max_completion_len=cfg.rollout.max_new_tokens)
    state = checkpoint.load(resume_from) if resume_from else None
    if state:
        learner.load_state(resume_from / "policy", state["learner"])
    return learner, build_engine, state


def start_engine(cfg: DictConfig, start: Any, build_engine: Any) -> Any:
    """The rollout engine, on the cores the CPU placement gives it."""
    t, device = cfg.trainer, start.device
    if device.type == "cuda":   # vLLM checks free GPU memory at start; the warm-up's cached blocks would count
        torch.cuda.empty_cache()
    placement = plan_placement(t.get("cpu_placement", "auto"), overlapped=t.max_staleness > 0, n_learner=start.threads,
                               engine_own_process=ROLLOUT_ENGINES.fact(cfg.rollout.engine, "own_process"),
                               engine_on_cpu=not torch.cuda.is_available(),
                               spawns_engine=TRAINER_BACKENDS.fact(t.backend, "spawns_engine"),
                               distributed=distributed.launched_distributed())
    if placement:
        print(f"cpu placement: learner on cores {list(placement.learner)}, engine on {list(placement.engine)} "
              "(trainer.cpu_placement=shared: all cores to both)")
    with engine_cores(placement), heartbeat(f"rollout engine: starting {cfg.rollout.engine} on {device} "
                                            "(vLLM on a CPU: about a minute)"):
        return build_engine(start.policy_dir, cfg.rollout, seed=cfg.seed, device=str(device))


def begin(cfg: DictConfig, recorder: RunRecorder, start: Any, run: RunParts, state: dict | None) -> LoopState:
    """The loop's counters: restored with the engine's weights, pipeline, normalizer and RNG from a
    checkpoint, or fresh after the evaluation before training."""
    if state:
        run.engine.load_weights(run.learner.weights_for_sync())
        run.pipeline.load_state_dict(state["pipeline"])
        run.normalizer.load_state_dict(state["normalizer"])
        checkpoint.set_rng_state(state["rng"])
        if run.environment is not None:
            run.environment.load_state_dict(state.get("environment") or {})
        # Checkpoints written before the newest evaluation was kept carry only the one before training.
        return LoopState(state["step"], state["samples"], state["bad_steps"], state["before"],
                         state.get("latest_eval", state["before"]))
    before = evaluate_and_log_samples(run.engine, start.tokenizer, run.eval_items, cfg, recorder, step=0,
                                      environment=run.environment)
    log_initial_eval(recorder, start, before)
    return LoopState(before=before, latest_eval=before)


def learn(cfg: DictConfig, run: RunParts, tokenizer, scored, metrics: dict, step: int) -> bool:
    """Score, prepare and update on one step's rollouts (metrics into ``metrics``); True when the step
    is bad: non-finite rewards, or an update that produced non-finite values and was skipped."""
    if not bool(torch.isfinite(scored.rewards).all()):
        return True
    batch = to_learner_batch(scored, tokenizer)
    metrics.update(run.learner.score(batch))
    batch, prep_metrics = run.objective.prepare(batch, cfg.algorithm, normalizer=run.normalizer, step=step,
                                                seed=cfg.seed)
    metrics.update(prep_metrics)
    metrics.update(run.learner.update(batch))
    if run.environment is not None:   # an environment that learns (a critic) updates on what it saw
        metrics.update(run.environment.after_step(step, step_record(scored)))
    if metrics.get("actor/empty_batch"):   # no update ran, so none was non-finite
        print(f"step {step}: nothing to train on (the objective left an empty batch, e.g. no preference "
              "pair: every group's rewards agree); this step makes no update")
    bad = metrics.get("actor/nonfinite_updates", 0.0) > 0
    if not run.learner.parameters_finite():
        raise NonFiniteError(f"the policy's weights became NaN/inf at step {step} (learner.lr="
                             f"{cfg.learner.lr:g}); lower learner.lr or set learner.grad_clip; no "
                             "checkpoint was written over them")
    return bad


def count_bad_step(cfg: DictConfig, loop: LoopState) -> None:
    """One more bad step; NonFiniteError past trainer.max_bad_steps."""
    loop.bad_steps += 1
    if loop.bad_steps > cfg.trainer.max_bad_steps:
        raise NonFiniteError(
            f"{loop.bad_steps} steps had NaN/inf rewards, losses or gradient norms (the last at step {loop.step}); "
            f"more than trainer.max_bad_steps={cfg.trainer.max_bad_steps}. Check the reward functions and "
            "learner.lr; the last good policy is in the newest checkpoint")


def push_weights(run: RunParts) -> tuple[float, float]:
    """The learner's weights into the engine; (seconds waiting for the engine to idle, seconds syncing)."""
    t0 = time.time()
    run.pipeline.wait_idle()              # the engine's weights change only while it is idle
    t_wait = time.time() - t0
    t0 = time.time()
    run.engine.load_weights(run.learner.weights_for_sync())
    run.pipeline.pushed()
    return t_wait, time.time() - t0


def record_step(cfg: DictConfig, recorder: RunRecorder, tokenizer, run: RunParts, loop: LoopState, scored,
                metrics: dict, progress: ProgressLine) -> None:
    """A step's periodic evaluation (kept as loop.latest_eval), samples, metrics line, progress and checkpoint."""
    t, step = cfg.trainer, loop.step
    if t.eval_every and step % t.eval_every == 0 and not schedule_done(cfg, step, loop.samples):
        loop.latest_eval = evaluate_and_log_samples(run.engine, tokenizer, run.eval_items, cfg, recorder, step=step,
                                                    environment=run.environment)
        metrics.update(loop.latest_eval)
    if t.log_samples_every and step % t.log_samples_every == 0:
        recorder.log_samples(scored.sample_rows(t.samples_per_log), step=step, kind="train")
    recorder.log(metrics, step=step, samples=loop.samples)
    progress.update(metrics, loop.latest_eval, group_size=int(metrics["rollout/group_size"]))
    if t.checkpoint_every and step % t.checkpoint_every == 0:
        checkpoint.save(recorder.run_dir, step, learner=run.learner, tokenizer=tokenizer, keep=t.keep_checkpoints,
                        state={"samples": loop.samples, "bad_steps": loop.bad_steps, "before": loop.before,
                               "latest_eval": loop.latest_eval,
                               "pipeline": run.pipeline.state_dict(), "normalizer": run.normalizer.state_dict(),
                               "recorder": recorder.state_dict(),
                               **({"environment": run.environment.state_dict()} if run.environment is not None
                                  else {})})


def finish(cfg: DictConfig, recorder: RunRecorder, start: Any, run: RunParts, loop: LoopState) -> dict:
    """The evaluation after training, the final policy saved, and the run's before/after result."""
    after = evaluate_and_log_samples(run.engine, start.tokenizer, run.eval_items, cfg, recorder, step=loop.step,
                                     environment=run.environment)
    recorder.log(after, step=loop.step, samples=loop.samples)
    if cfg.trainer.save_checkpoint:
        run.learner.save(recorder.run_dir / "checkpoints" / "final", start.tokenizer)
    run.learner.close()   # fsdp2: releases the other ranks (only after success; on failure torchrun ends them)
    return {"before": loop.before, "after": after, "warmup": start.warmup_summary, "learner_threads": start.threads}


def train(cfg: DictConfig, recorder: RunRecorder, resume_from: Path | None = None) -> dict:
    """One run: set-up, the loop of phases the module docstring names, and the evaluation after training;
    the pipeline and the engine close however the run ends."""
    start = start_run(cfg)   # seed, learner threads, device, task, warm-up checkpoint, tokenizer
    tokenizer, t = start.tokenizer, cfg.trainer
    objective = OBJECTIVES.get(cfg.algorithm.objective)
    learner, build_engine, state = start_learner(cfg, start, resume_from)
    engine = start_engine(cfg, start, build_engine)
    environment = build_environment(cfg, tokenizer=tokenizer, task=start.task)   # None: single-turn
    sampler = objective.make_sampler(cfg, engine, tokenizer, start.task.splits["train"], environment)
    run = RunParts(learner, engine, RolloutPipeline(sampler, cfg, max_staleness=t.max_staleness), objective,
                   RewardNormalizer(cfg.algorithm.reward_ema_decay), start.task.splits[t.eval_split], environment)
    try:
        loop = begin(cfg, recorder, start, run, state)
        progress = ProgressLine(total=t.total_steps, desc=cfg.run_name, start=loop.step)
        while not schedule_done(cfg, loop.step, loop.samples):
            loop.step += 1
            t_step, cpu_step = time.time(), time.process_time()
            scored, metrics = run.pipeline.take(loop.step)
            loop.samples += int(metrics.get("rollout/generated_samples", len(scored.rollout)))
            if not schedule_done(cfg, loop.step, loop.samples):
                run.pipeline.prefetch(loop.step + 1)   # max_staleness=1: the engine samples while the learner trains

            t0 = time.time()
            bad = learn(cfg, run, tokenizer, scored, metrics, loop.step)
            t_learn = time.time() - t0
            if bad:
                count_bad_step(cfg, loop)

            t_wait, t_sync = push_weights(run)

            release_freed_host_memory()
            metrics.update(rollout_metrics(scored))
            # The machine's 1-minute load average: how many processes wanted its cores during the step,
            # this run's included, so step times of runs made alone and beside other jobs can be told apart.
            metrics.update({"perf/host_rss_gib": host_tree_rss_gib(), "perf/host_load_1m": os.getloadavg()[0],
                            "perf/learn_s": t_learn, "perf/sync_s": t_sync,
                            "perf/wait_rollout_s": t_wait,
                            "perf/step_time_s": time.time() - t_step,
                            "perf/cpu_time_s": time.process_time() - cpu_step,
                            "actor/skipped_steps": float(loop.bad_steps)})
            record_step(cfg, recorder, tokenizer, run, loop, scored, metrics, progress)
        progress.close()
        return finish(cfg, recorder, start, run, loop)
    finally:
        run.pipeline.close()
        if environment is not None:
            environment.close()
        run.engine.close()


def main() -> None:
    """Entry point: launch (grpo_lab.launch: Hydra, the run directory, resume, refusal) runs this loop."""
    launch.main(train)


if __name__ == "__main__":
    main()
