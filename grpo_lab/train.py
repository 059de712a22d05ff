"""The RL loop: `python -m grpo_lab.train [overrides]` (Hydra; `-m` sweeps).

One step reads top to bottom as named phases:

    prompts ─▶ rollout (engine samples G per prompt) ─▶ rewards ─▶ [dynamic sampling]
            ─▶ learner.score (π_old, π_ref, values) ─▶ objective.prepare (advantages or pairs)
            ─▶ learner.update ─▶ push weights ─▶ metrics (rollout/, reward/, actor/, critic/, perf/, eval/)
            ─▶ metrics.jsonl + wandb ─▶ [resumable checkpoint every trainer.checkpoint_every steps]

The loop owns no math (grpo_lab/algos), no objective (grpo_lab/objectives), no set-up and no config
(grpo_lab/run_setup.assemble builds every part from its own section), no launch (grpo_lab/launch: Hydra,
the run directory, resume, refusal) and no I/O format (grpo_lab/logging, grpo_lab/checkpoint).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # `python -m grpo_lab.train`: the launcher validates the config before torch, transformers and vLLM
    # load (a config refused for its values returns in about a second), then imports this module by name
    # (as grpo_lab.train) for the loop below; this copy, run as __main__, stops here.
    from grpo_lab import launch

    launch.main("grpo_lab.train:train")
    sys.exit()

import os  # (these imports load torch: see above)
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from grpo_lab import checkpoint, launch
from grpo_lab.algos.kl import off_policy_sequence_kl, sequence_kl
from grpo_lab.interaction import step_record
from grpo_lab.learner.learner import release_freed_host_memory
from grpo_lab.logging.recorder import RunRecorder
from grpo_lab.progress import heartbeat
from grpo_lab.run_setup import RunParts, assemble, log_initial_eval
from grpo_lab.sampling import rollout_metrics, to_learner_batch
from grpo_lab.schema import typed_sections


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


def evaluate_and_log_samples(evaluator, recorder: RunRecorder, *, step: int, samples_per_log: int) -> dict:
    """Held-out evaluation (grpo_lab.evaluation.Evaluator: greedy, mean@k, and with a multi-turn
    environment first answer, its reply and the revision); its first `samples_per_log` greedy completions
    go to samples.jsonl."""
    rows: list[dict] = []
    k = evaluator.sampled_k
    with heartbeat(f"evaluation at step {step}: {len(evaluator.items)} held-out items, greedy"
                   f"{f' + {k} samples each' if k else ''}, up to {evaluator.max_new_tokens} new tokens"):
        metrics = evaluator(step=step, samples=rows, max_samples=samples_per_log)
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
class LoopState:
    """The counters a checkpoint carries: steps and samples done, steps skipped as non-finite, the
    evaluation before training and the newest one (the progress line's "eval acc", also after a resume)."""
    step: int = 0
    samples: int = 0
    bad_steps: int = 0
    before: dict = field(default_factory=dict)
    latest_eval: dict = field(default_factory=dict)


def begin(run: RunParts, recorder: RunRecorder) -> LoopState:
    """The loop's counters: restored with the engine's weights, pipeline, normalizer and RNG from the
    checkpoint the run resumes from, or fresh after the evaluation before training."""
    state = run.state
    if state:
        run.engine.load_weights(run.learner.weights_for_sync())
        run.pipeline.load_state_dict(state["pipeline"])
        run.normalizer.load_state_dict(state["normalizer"])
        checkpoint.set_rng_state(state["rng"])
        if run.environment is not None:
            run.environment.load_state_dict(state.get("environment") or {})
        for i, part in enumerate(run.online_rewards):
            part.load_state_dict(state["online_rewards"][i])
        # Checkpoints written before the newest evaluation was kept carry only the one before training.
        return LoopState(state["step"], state["samples"], state["bad_steps"], state["before"],
                         state.get("latest_eval", state["before"]))
    before = evaluate_and_log_samples(run.evaluator, recorder, step=0, samples_per_log=run.trainer.samples_per_log)
    log_initial_eval(recorder, run.start, before)
    return LoopState(before=before, latest_eval=before)


def reference_kl_metrics(batch) -> dict[str, float]:
    """KL(π || π_ref) of the step's samples, under the policy that sampled them (the sampler's log-probs; the
    learner's own for pairs read from a file): kl_ref/seq summed over each completion's policy tokens, and
    kl_ref/token per token (grpo_lab.algos.kl.sequence_kl). Rows an earlier policy sampled (offline
    preferences drawn from the start policy's pool) are weighted by π_learner / π_sampler, so the numbers are
    the current policy's KL, with kl_ref/ess saying how many rows carry the estimate
    (grpo_lab.algos.kl.off_policy_sequence_kl)."""
    mask = batch["response_mask"].float()   # the policy's own tokens (a multi-turn environment's are 0)
    if batch.extras.get("offline") and "sampler_logprobs" in batch:
        kl, per_token, ess = off_policy_sequence_kl(batch["learner_logprobs"].float(), batch["ref_logprobs"].float(),
                                                    batch["sampler_logprobs"].float(), mask)
        return {"kl_ref/seq": float(kl), "kl_ref/token": float(per_token), "kl_ref/ess": float(ess)}
    logp = batch["sampler_logprobs"] if "sampler_logprobs" in batch else batch["learner_logprobs"]
    per_seq = sequence_kl(logp.float(), batch["ref_logprobs"].float(), mask)
    return {"kl_ref/seq": float(per_seq.mean()), "kl_ref/token": float(per_seq.sum() / mask.sum().clamp(min=1))}


def schedule_done(trainer, step: int, samples: int) -> bool:
    """Whether the run's budget is spent: trainer.total_steps steps, or trainer.total_samples samples."""
    return step >= trainer.total_steps or (trainer.total_samples is not None and samples >= trainer.total_samples)


def learn(run: RunParts, scored, metrics: dict, step: int) -> bool:
    """Score, prepare and update on one step's rollouts (metrics into ``metrics``); True when the step
    is bad: non-finite rewards, or an update that produced non-finite values and was skipped."""
    if not bool(torch.isfinite(scored.rewards).all()):
        return True
    batch = to_learner_batch(scored, run.tokenizer)
    metrics.update(run.learner.score(batch))
    if "ref_logprobs" in batch:   # KL of this step's samples from the reference: the x axis of over-optimisation
        metrics.update(reference_kl_metrics(batch))
    batch, prep_metrics = run.objective.prepare(batch, run.algorithm, normalizer=run.normalizer, step=step,
                                                seed=run.seed)
    metrics.update(prep_metrics)
    metrics.update(run.learner.update(batch))
    if run.environment is not None:   # an environment that learns (a critic) updates on what it saw
        metrics.update(run.environment.after_step(step, step_record(scored)))
    for part in run.online_rewards:   # a learned reward model relabels the policy's samples and updates
        metrics.update(part.after_step(step, scored.rollout.texts, scored.items, scored.rollout.group_ids))
    if metrics.get("actor/empty_batch"):   # no update ran, so none was non-finite
        print(f"step {step}: nothing to train on (the objective left an empty batch, e.g. no preference "
              "pair: every group's rewards agree); this step makes no update")
    bad = metrics.get("actor/nonfinite_updates", 0.0) > 0
    if not run.learner.parameters_finite():
        raise NonFiniteError(f"the policy's weights became NaN/inf at step {step} (learner.lr="
                             f"{run.learner_lr:g}); lower learner.lr or set learner.grad_clip; no "
                             "checkpoint was written over them")
    return bad


def count_bad_step(run: RunParts, loop: LoopState) -> None:
    """One more bad step; NonFiniteError past trainer.max_bad_steps."""
    loop.bad_steps += 1
    if loop.bad_steps > run.trainer.max_bad_steps:
        raise NonFiniteError(
            f"{loop.bad_steps} steps had NaN/inf rewards, losses or gradient norms (the last at step {loop.step}); "
            f"more than trainer.max_bad_steps={run.trainer.max_bad_steps}. Check the reward functions and "
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


def record_step(run: RunParts, recorder: RunRecorder, loop: LoopState, scored, metrics: dict,
                progress: ProgressLine) -> None:
    """A step's periodic evaluation (kept as loop.latest_eval), samples, metrics line, progress and checkpoint."""
    t, step = run.trainer, loop.step
    if t.eval_every and step % t.eval_every == 0 and not schedule_done(t, step, loop.samples):
        loop.latest_eval = evaluate_and_log_samples(run.evaluator, recorder, step=step,
                                                    samples_per_log=t.samples_per_log)
        metrics.update(loop.latest_eval)
    if t.log_samples_every and step % t.log_samples_every == 0:
        recorder.log_samples(scored.sample_rows(t.samples_per_log), step=step, kind="train")
    recorder.log(metrics, step=step, samples=loop.samples)
    progress.update(metrics, loop.latest_eval, group_size=int(metrics["rollout/group_size"]))
    if t.checkpoint_every and step % t.checkpoint_every == 0:
        checkpoint.save(recorder.run_dir, step, learner=run.learner, tokenizer=run.tokenizer, keep=t.keep_checkpoints,
                        state={"samples": loop.samples, "bad_steps": loop.bad_steps, "before": loop.before,
                               "latest_eval": loop.latest_eval,
                               "pipeline": run.pipeline.state_dict(), "normalizer": run.normalizer.state_dict(),
                               "recorder": recorder.state_dict(),
                               **({"environment": run.environment.state_dict()} if run.environment is not None
                                  else {}),
                               "online_rewards": [part.state_dict() for part in run.online_rewards]})


def finish(run: RunParts, recorder: RunRecorder, loop: LoopState) -> dict:
    """The evaluation after training, the final policy saved, and the run's before/after result."""
    after = evaluate_and_log_samples(run.evaluator, recorder, step=loop.step, samples_per_log=run.trainer.samples_per_log)
    recorder.log(after, step=loop.step, samples=loop.samples)
    if run.trainer.save_checkpoint:
        run.learner.save(recorder.run_dir / "checkpoints" / "final", run.tokenizer)
    run.learner.close()   # fsdp2: releases the other ranks (only after success; on failure torchrun ends them)
    return {"before": loop.before, "after": after, "warmup": run.start.warmup_summary,
            "learner_threads": run.start.threads,
            **({"prepared_rewards": run.prepared_rewards} if run.prepared_rewards else {})}


def train(cfg: DictConfig, recorder: RunRecorder, resume_from: Path | None = None) -> dict:
    """One run: its parts built from the config (`assemble`), the loop of phases the module docstring names,
    and the evaluation after training; the parts close however the run ends."""
    # Typed sections (the schema's dataclasses), built once: every part of the run receives its own.
    run = assemble(typed_sections(cfg), resume_from)
    try:
        loop = begin(run, recorder)
        progress = ProgressLine(total=run.trainer.total_steps, desc=cfg.run_name, start=loop.step)
        while not schedule_done(run.trainer, loop.step, loop.samples):
            loop.step += 1
            t_step, cpu_step = time.time(), time.process_time()
            scored, metrics = run.pipeline.take(loop.step)
            loop.samples += int(metrics.get("rollout/generated_samples", len(scored.rollout.completion_ids)))
            if not schedule_done(run.trainer, loop.step, loop.samples):
                run.pipeline.prefetch(loop.step + 1)   # max_staleness=1: the engine samples while the learner trains

            t0 = time.time()
            bad = learn(run, scored, metrics, loop.step)
            t_learn = time.time() - t0
            if bad:
                count_bad_step(run, loop)

            t_wait, t_sync = push_weights(run)

            release_freed_host_memory()
            metrics.update(rollout_metrics(scored))
            # The machine's 1-minute load average: how many processes wanted its cores during the step,
            # this run's included, so step times of runs made alone and beside other jobs can be told apart.
            metrics.update({"perf/host_rss_gib": host_tree_rss_gib(), "perf/host_load_1m": os.getloadavg()[0],
                            "perf/learn_s": t_learn, "perf/sync_s": t_sync,
                            "perf/wait_rollout_s": t_wait,
                            "perf/step_time_s": time.time() - t_step,
                            # The reward's share of the step (a learned reward model's forward passes, a judge's)
                            "perf/reward_share": metrics.get("perf/reward_s", 0.0) / max(time.time() - t_step, 1e-9),
                            "perf/cpu_time_s": time.process_time() - cpu_step,
                            "actor/skipped_steps": float(loop.bad_steps)})
            record_step(run, recorder, loop, scored, metrics, progress)
        progress.close()
        return finish(run, recorder, loop)
    finally:
        run.close()


def main() -> None:
    """Entry point for an installed script: launch (grpo_lab.launch: Hydra, the run directory, resume,
    refusal) runs this loop. `python -m grpo_lab.train` goes through the launcher at the top of this file."""
    launch.main(train)
