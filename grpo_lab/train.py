"""The RL loop: `python -m grpo_lab.train [overrides]` (Hydra; `-m` sweeps).

One step reads top to bottom as named phases:

    prompts ─▶ rollout (engine samples G per prompt) ─▶ rewards ─▶ [dynamic sampling]
            ─▶ learner.score (π_old, π_ref, values) ─▶ objective.prepare (advantages or pairs)
            ─▶ learner.update ─▶ push weights ─▶ metrics (rollout/, reward/, actor/, critic/, perf/, eval/)
            ─▶ metrics.jsonl + wandb ─▶ [resumable checkpoint every trainer.checkpoint_every steps]

The loop owns no math (grpo_lab/algos), no objective (grpo_lab/objectives), no set-up (grpo_lab/run_setup,
shared with the matched-compute SFT control) and no I/O format (grpo_lab/logging, grpo_lab/checkpoint).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
import psutil
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from tqdm.auto import tqdm

from grpo_lab import checkpoint, run_guard
from grpo_lab.backends import TRAINER_BACKENDS, follow
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.cpu_placement import engine_cores, plan_placement
from grpo_lab.evaluation import evaluate_held_out
from grpo_lab.learner import distributed
from grpo_lab.learner.learner import release_freed_host_memory
from grpo_lab.logging.recorder import RunRecorder, record_failure, recorded_lines
from grpo_lab.memory_plan import plan_memory
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.phases import RewardNormalizer, RolloutPipeline, rollout_metrics, to_learner_batch
from grpo_lab.progress import heartbeat
from grpo_lab.rollout import ROLLOUT_ENGINES
from grpo_lab.run_setup import log_initial_eval, open_recorder, record_outcome, start_run
from grpo_lab.schema import ConfigError


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


def evaluate_and_log_samples(engine, tokenizer, items: list, cfg: DictConfig, recorder: RunRecorder, *,
                             step: int) -> dict:
    """Held-out evaluation (grpo_lab.evaluation.evaluate_held_out); its first trainer.samples_per_log
    greedy completions go to samples.jsonl."""
    rows: list[dict] = []
    k = cfg.trainer.get("eval_sampled_k", 0)
    with heartbeat(f"evaluation at step {step}: {len(items)} held-out items, greedy"
                   f"{f' + {k} samples each' if k else ''}, up to {cfg.rollout.max_new_tokens} new tokens"):
        metrics = evaluate_held_out(engine, tokenizer, items, cfg, step=step, samples=rows,
                                    max_samples=cfg.trainer.samples_per_log)
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


def train(cfg: DictConfig, recorder: RunRecorder, resume_from: Path | None = None) -> dict:
    start = start_run(cfg)   # seed, learner threads, device, task, warm-up checkpoint, tokenizer
    task, tokenizer, device, policy_dir = start.task, start.tokenizer, start.device, start.policy_dir
    a, t = cfg.algorithm, cfg.trainer
    objective = OBJECTIVES.get(a.objective)
    # Where the learner and the engine run: this process (or torchrun ranks), or Ray actors (backends.py).
    build_learner, build_engine = TRAINER_BACKENDS.get(t.backend)(cfg)
    learner = build_learner(cfg, policy_dir, temperature=cfg.rollout.temperature, seed=cfg.seed,
                            max_completion_len=cfg.rollout.max_new_tokens)
    state = checkpoint.load(resume_from) if resume_from else None
    if state:  # before the engine starts, so a bad checkpoint fails cheaply
        learner.load_state(resume_from / "policy", state["learner"])
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
        engine = build_engine(policy_dir, cfg.rollout, seed=cfg.seed, device=str(device))
    eval_items = task.splits[t.eval_split]
    sampler = objective.make_sampler(cfg, engine, tokenizer, task.splits["train"])
    pipeline = RolloutPipeline(sampler, cfg, max_staleness=t.max_staleness)
    normalizer = RewardNormalizer(a.reward_ema_decay)
    try:
        if state:
            engine.load_weights(learner.weights_for_sync())
            pipeline.load_state_dict(state["pipeline"])
            normalizer.load_state_dict(state["normalizer"])
            checkpoint.set_rng_state(state["rng"])
            step, samples, bad_steps, before = state["step"], state["samples"], state["bad_steps"], state["before"]
        else:
            before = evaluate_and_log_samples(engine, tokenizer, eval_items, cfg, recorder, step=0)
            log_initial_eval(recorder, start, before)
            step = samples = bad_steps = 0
        progress = ProgressLine(total=t.total_steps, desc=cfg.run_name, start=step)
        last_eval = before
        while not schedule_done(cfg, step, samples):
            step += 1
            t_step, cpu_step = time.time(), time.process_time()
            scored, metrics = pipeline.take(step)
            samples += int(metrics.get("rollout/generated_samples", len(scored.rollout)))
            if not schedule_done(cfg, step, samples):
                pipeline.prefetch(step + 1)   # max_staleness=1: the engine samples while the learner trains

            t0 = time.time()
            bad = not bool(torch.isfinite(scored.rewards).all())
            if not bad:
                batch = to_learner_batch(scored, tokenizer)
                metrics.update(learner.score(batch))
                batch, prep_metrics = objective.prepare(batch, a, normalizer=normalizer, step=step, seed=cfg.seed)
                metrics.update(prep_metrics)
                metrics.update(learner.update(batch))
                if metrics.get("actor/empty_batch"):   # no update ran, so none was non-finite
                    print(f"step {step}: nothing to train on (the objective left an empty batch, e.g. no preference "
                          "pair: every group's rewards agree); this step makes no update")
                bad = metrics.get("actor/nonfinite_updates", 0.0) > 0
                if not learner.parameters_finite():
                    raise NonFiniteError(f"the policy's weights became NaN/inf at step {step} (learner.lr="
                                         f"{cfg.learner.lr:g}); lower learner.lr or set learner.grad_clip; no "
                                         "checkpoint was written over them")
            t_learn = time.time() - t0
            if bad:
                bad_steps += 1
                if bad_steps > t.max_bad_steps:
                    raise NonFiniteError(
                        f"{bad_steps} steps had NaN/inf rewards, losses or gradient norms (the last at step {step}); "
                        f"more than trainer.max_bad_steps={t.max_bad_steps}. Check the reward functions and "
                        "learner.lr; the last good policy is in the newest checkpoint")

            t0 = time.time()
            pipeline.wait_idle()              # the engine's weights change only while it is idle
            t_wait = time.time() - t0
            t0 = time.time()
            engine.load_weights(learner.weights_for_sync())
            pipeline.pushed()
            t_sync = time.time() - t0

            release_freed_host_memory()
            metrics.update(rollout_metrics(scored))
            metrics.update({"perf/host_rss_gib": host_tree_rss_gib(), "perf/learn_s": t_learn, "perf/sync_s": t_sync,
                            "perf/wait_rollout_s": t_wait,
                            "perf/step_time_s": time.time() - t_step,
                            "perf/cpu_time_s": time.process_time() - cpu_step,
                            "actor/skipped_steps": float(bad_steps)})
            if t.eval_every and step % t.eval_every == 0 and not schedule_done(cfg, step, samples):
                last_eval = evaluate_and_log_samples(engine, tokenizer, eval_items, cfg, recorder, step=step)
                metrics.update(last_eval)
            if t.log_samples_every and step % t.log_samples_every == 0:
                recorder.log_samples(scored.sample_rows(t.samples_per_log), step=step, kind="train")
            recorder.log(metrics, step=step, samples=samples)
            progress.update(metrics, last_eval, group_size=int(metrics["rollout/group_size"]))
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                checkpoint.save(recorder.run_dir, step, learner=learner, tokenizer=tokenizer, keep=t.keep_checkpoints,
                                state={"samples": samples, "bad_steps": bad_steps, "before": before,
                                       "pipeline": pipeline.state_dict(), "normalizer": normalizer.state_dict(),
                                       "recorder": recorder.state_dict()})
        progress.close()
        after = evaluate_and_log_samples(engine, tokenizer, eval_items, cfg, recorder, step=step)
        recorder.log(after, step=step, samples=samples)
        if t.save_checkpoint:
            learner.save(recorder.run_dir / "checkpoints" / "final", tokenizer)
        learner.close()   # fsdp2: releases the other ranks (only after success; on failure torchrun ends them)
        return {"before": before, "after": after, "warmup": start.warmup_summary, "learner_threads": start.threads}
    finally:
        pipeline.close()
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


def prepare_run_dir(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint to resume from (None: a fresh run). A fresh run never writes into a directory that
    already holds another run's metrics: that would mix two runs' lines."""
    resume_from = checkpoint.resolve(cfg.trainer.resume, run_dir)
    if resume_from is None and recorded_lines(run_dir) > 0:
        hint = ("it has no checkpoint to resume from (trainer.checkpoint_every was 0)" if cfg.trainer.resume
                else "continue it with trainer.resume=auto")
        raise ConfigError(f"{run_dir} already holds a run's metrics.jsonl; {hint}, or choose another "
                          "hydra.run.dir (the default is a new timestamped directory)")
    return resume_from


def check_resume(cfg: DictConfig, resume_from: Path | None) -> tuple[list[dict], list[dict]]:
    """(all resume changes of the run so far, this resume's) against the config the checkpoint was
    written under; a change of anything that defines the run is refused here, before any model loads."""
    if resume_from is None:
        return [], []
    # Its own copy; a checkpoint from before it had one: its run directory's.
    for recorded_file in (resume_from / checkpoint.CONFIG_FILE, resume_from.parent.parent / "config.yaml"):
        if recorded_file.is_file():
            recorded = yaml.safe_load(recorded_file.read_text()) or {}
            break
    else:
        print(f"warning: no config.yaml recorded for {resume_from}; the resumed config is not compared", file=sys.stderr)
        return [], []
    new = run_guard.resume_changes(cfg, recorded, step=checkpoint.load_step(resume_from))
    return [*recorded.get("resume_changes", []), *new], new


def refuse(run_dir: Path, lock: run_guard.RunLock | None) -> bool:
    """After a launch failed before it started: True when the directory holds a run (or another process
    owns it), which must then be left as it was (train.main restores what Hydra wrote)."""
    if lock is not None:
        lock.release()
    if lock is None or recorded_lines(run_dir) > 0 or checkpoint.checkpoints(run_dir):
        run_guard.REFUSED.add(Path(run_dir).resolve())
        return True
    return False


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def run(cfg: DictConfig) -> float:
    """One run: validate, then train, recording the outcome (also a failed validation) in the run directory."""
    run_guard.install_sigterm()
    hc = HydraConfig.get()
    cfg = finalize(cfg)
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    lock = None
    try:
        lock = run_guard.RunLock(run_dir)   # one process per run directory, before anything is loaded
        validate(cfg)  # before any model is loaded (includes the memory plan's verdict)
        print(plan_memory(cfg).render())
        resume_from = prepare_run_dir(cfg, run_dir)
        changes, new_changes = check_resume(cfg, resume_from)
        state = checkpoint.load(resume_from)["recorder"] if resume_from else None
    except Exception as err:
        # A sweep job that fails here still leaves a record the report counts as failed, unless the
        # directory already holds a run: then the launch is refused and nothing in it changes.
        if not refuse(run_dir, lock):
            record_failure(run_dir, cfg, overrides=overrides, error=err)
        raise
    with lock:   # released when the run ends (and by the OS if the process dies)
        lock.mark_owner()
        checkpoint.remove_partial(run_dir)
        recorder = open_recorder(run_dir, cfg, overrides, sweep=Path(hc.sweep.dir).name if multirun else None,
                                 resume=state)
        recorder.record_resume_changes(changes, new=new_changes)
        run_guard.on_stuck_sigterm(lambda: recorder.record_stuck(SystemExit(
            f"SIGTERM: the main thread did not unwind within {run_guard.SIGTERM_GRACE_S:g} s (stuck in a C "
            "call or a join); the watchdog ended the process")))
        try:
            result = record_outcome(recorder, lambda: train(cfg, recorder, resume_from),
                                    lambda r: {"warmup": r["warmup"], "learner_threads": r["learner_threads"],
                                               "resumed_from": str(resume_from) if resume_from else None})
        finally:
            run_guard.on_stuck_sigterm(None)
    print_before_after(result, recorder.run_dir)
    return float(result["after"]["eval/accuracy"])


def main() -> None:
    """Entry point: register the config schema and resolver explicitly, then let Hydra run."""
    if distributed.is_follower():   # torchrun rank > 0: serves rank 0's learner calls, nothing else
        follow()
        distributed.end_process()
    register_configs()
    # A launch refused because its directory holds a run leaves it as it was: Hydra has already written
    # `.hydra/` and its log there, so they are put back once Hydra has exited.
    run_guard.REFUSED.clear()
    given_dir = run_guard.run_dir_argument(sys.argv[1:])
    snapshot = run_guard.DirSnapshot(given_dir) if given_dir else None
    try:
        run()
    except BaseException:
        if snapshot is not None and snapshot.run_dir.resolve() in run_guard.REFUSED:
            snapshot.restore()
        raise
    if distributed.launched_distributed():   # a torchrun rank 0 that completed; see end_process for why
        distributed.end_process()


if __name__ == "__main__":
    main()
