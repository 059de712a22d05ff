"""Launch, resume and refusal of a run: what `python -m grpo_lab.train [overrides]` does around the loop.

`python -m grpo_lab.train` calls main("grpo_lab.train:train") here (grpo_lab.train.main(): main(train)):
Hydra parses the command line (`-m` sweeps; torchrun ranks above 0 only serve rank 0's learner), and each
job's `run` takes the run directory (one process per directory; a fresh run never writes into another run's),
validates the config and prints the memory plan before any model loads, compares a resume with the config its
checkpoint was written under, and records the outcome, a failure before the start included, around the loop it
was given (grpo_lab.train.train).
A launch refused because its directory holds a run leaves that directory as it was.

The loop comes in as an argument (or its import path), so this module stays below grpo_lab.train
(tests/test_layers.py). Nothing this module imports at its top loads torch, transformers or vLLM: a config
whose own values are wrong, or that names an entry no registry holds (by the index an earlier launch wrote,
grpo_lab.name_index), is refused before they load, in about a second; the rest of the lab is imported once a
config has passed those checks.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from grpo_lab import checkpoint, run_guard
from grpo_lab.config import finalize, invalid_config, register_configs, validate, value_errors
from grpo_lab.logging.recorder import RunRecorder, record_failure, recorded_lines
from grpo_lab.name_index import unknown_names, write_index
from grpo_lab.schema import ConfigError

# The loop a run trains with: (config, recorder, checkpoint to resume from or None) -> its result
# ({"before", "after", "warmup", "learner_threads"}); grpo_lab.train.train.
Loop = Callable[[DictConfig, RunRecorder, "Path | None"], dict]

# The repository's conf/, as an absolute path: Hydra resolves a relative config_path against the task
# function's package, which for this module would not be the directory conf/ lies in.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def record_outcome(recorder: RunRecorder, run: Callable[[], dict], summary: Callable[[dict], dict]) -> dict:
    """`run()`'s result. summary.json says "failed" with the error when it raises (re-raised, Ctrl-C
    included), else "completed" with the fields `summary(result)` gives."""
    try:
        result = run()
    except BaseException as err:
        recorder.finish(status="failed", error=err)
        raise
    recorder.finish(status="completed", extra=summary(result))
    return result


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
    owns it), which must then be left as it was (main restores what Hydra wrote)."""
    if lock is not None:
        lock.release()
    if lock is None or recorded_lines(run_dir) > 0 or checkpoint.checkpoints(run_dir):
        run_guard.REFUSED.add(Path(run_dir).resolve())
        return True
    return False


def run(cfg: DictConfig, loop: Loop | str) -> float:
    """One run: validate, then train with `loop` (or the loop its import path "module:function" names,
    imported once the config is valid), recording the outcome (also a failed validation) in the run
    directory."""
    run_guard.install_sigterm()
    hc = HydraConfig.get()
    # The config's own values, and names that no registry holds by the index of an earlier launch: nothing
    # heavy is loaded for these.
    refused_early = value_errors(cfg) + unknown_names(cfg, cfg.cache_dir)
    cfg = finalize(cfg, name_knobs=not refused_early)
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    lock = None
    try:
        lock = run_guard.RunLock(run_dir)   # one process per run directory, before anything is loaded
        if refused_early:
            raise invalid_config(refused_early, "(the other checks run once these are fixed: the registered "
                                                "parts' own settings, reward, task, memory plan)")
        validate(cfg)  # before any model is loaded (includes the memory plan's verdict)
        # The names the registries hold, for the next launch's early refusal (after a valid config only: a
        # refused launch writes nothing).
        write_index(cfg.cache_dir)
        from grpo_lab.memory_plan import plan_memory
        from grpo_lab.run_setup import open_recorder

        print(plan_memory(cfg).render())
        if isinstance(loop, str):
            module, _, name = loop.partition(":")
            loop = getattr(importlib.import_module(module), name)
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
                                 resume=state,
                                 searchpath=[o for o in hc.overrides.hydra if o.startswith("hydra.searchpath=")])
        recorder.record_resume_changes(changes, new=new_changes)
        with run_guard.stuck_sigterm_recorded(recorder):
            result = record_outcome(recorder, lambda: loop(cfg, recorder, resume_from),
                                    lambda r: {"warmup": r["warmup"], "learner_threads": r["learner_threads"],
                                               "resumed_from": str(resume_from) if resume_from else None,
                                               **{k: r[k] for k in ("prepared_rewards",) if k in r}})
    print_before_after(result, recorder.run_dir)
    return float(result["after"]["eval/accuracy"])


# `python -m grpo_lab.train -v ...`: the libraries' own start-up lines too (taken off the command line
# before Hydra, which has no such flag, parses it).
VERBOSE_FLAGS = ("-v", "--verbose")


def quiet_unless_verbose() -> None:
    """Take -v/--verbose off the command line (Hydra would refuse it) and quiet the libraries unless it was
    there: every entry point calls this before Hydra parses its arguments."""
    verbose = any(a in VERBOSE_FLAGS for a in sys.argv[1:])
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in VERBOSE_FLAGS)]
    quiet_libraries(verbose)


def quiet_libraries(verbose: bool) -> None:
    """Keep a run's output to the lab's own lines: vLLM's start-up logging (platform notes), torch's C++
    warnings (vLLM's NUMA binding notice), deprecation warnings raised inside the libraries, and the
    progress bars of loading and writing weights, unless `verbose`. One line stays: vLLM's engine
    processes report "Triton is installed, but doesn't include CPU backend" on a CPU before vLLM has
    configured its logging (Python's last-resort handler prints it), which no setting reaches. Set as
    environment variables before torch or vLLM load, so the processes the run starts (vLLM's engine core
    and workers) inherit them; a variable the user set wins. The lab's warnings and errors are printed as before."""
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # transformers' weight-loading bars read it too
    # Child processes only (read at interpreter start). The resource tracker's notice at exit is about vLLM's
    # own broadcast queue in shared memory, which the tracker then removes: nothing is left behind.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning,"
                          "ignore::UserWarning:multiprocessing.resource_tracker")
    logging.getLogger("vllm").setLevel(logging.ERROR)


def main(loop: Loop | str) -> None:
    """Entry point (grpo_lab.train passes its loop, by import path when run as `python -m grpo_lab.train`):
    register the config schema and resolver explicitly, then let Hydra parse the command line and call
    `run` with `loop`, once per job of a sweep. `-v` keeps the libraries' start-up output (quiet_libraries)."""
    quiet_unless_verbose()
    if "RANK" in os.environ:   # under torchrun (or another launcher that sets RANK)
        from grpo_lab.learner import distributed

        if distributed.is_follower():   # rank > 0: serves rank 0's learner calls, nothing else
            from grpo_lab.backends import follow

            follow()
            distributed.end_process()
    register_configs()
    # A launch refused because its directory holds a run leaves it as it was: Hydra has already written
    # `.hydra/` and its log there, so they are put back once Hydra has exited.
    run_guard.REFUSED.clear()
    given_dir = run_guard.run_dir_argument(sys.argv[1:])
    snapshot = run_guard.DirSnapshot(given_dir) if given_dir else None

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
    def task(cfg: DictConfig) -> float:
        return run(cfg, loop)

    try:
        task()
    except BaseException:
        if snapshot is not None and snapshot.run_dir.resolve() in run_guard.REFUSED:
            snapshot.restore()
        raise
    if "RANK" in os.environ:
        from grpo_lab.learner import distributed

        if distributed.launched_distributed():   # a torchrun rank 0 that completed; see end_process for why
            distributed.end_process()
