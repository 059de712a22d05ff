"""Resumable checkpoints: everything that changes over a run, written atomically together.

    <run dir>/checkpoints/step_<k>/
        policy/              the policy (save_pretrained: loadable as a plain HF model directory)
        learner_dcp/         learner.strategy=fsdp2 only: model + optimizer shards (torch.distributed.checkpoint),
                             loadable on any world size; the optimizer is then not in trainer_state.pt
        trainer_state.pt     optimizer, critic + its optimizer, learner counters and generator,
                             RNG states (python, numpy, torch CPU / CUDA), prompt-stream position,
                             sampler call counter, reward normaliser, step and sample counters,
                             recorder state (wandb run id, metrics.jsonl line count, initial evals)

A checkpoint is written into a temporary sibling and renamed into place, so a kill at any moment
leaves either the previous set of checkpoints or the new one, never a half-written directory that
`resume=auto` would pick. The group-size schedule position is a function of the step, so it needs
no state of its own. Restoring all of it reproduces the uninterrupted run (tests/test_resume.py).
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from grpo_lab.atomic_dir import write_dir_atomically

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving process saw; a resume may see fewer (an 8-GPU run resumed on one
        # GPU): restore those it has (set_rng_state_all would index past the last device).
        for index, gpu_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, index)


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete resumable checkpoints of a run directory, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def save(run_dir: Path, step: int, *, learner, tokenizer, state: dict, keep: int) -> Path:
    """Write checkpoint `step_<step>` atomically (over one of the same step from an interrupted
    attempt), then delete all but the newest `keep`."""

    def write(tmp: Path) -> None:
        learner.save(tmp / "policy", tokenizer)
        if getattr(learner, "sharded", False):
            from grpo_lab.learner.distributed import DCP_DIR

            learner.save_dcp(tmp / DCP_DIR)
        torch.save({"step": step, "learner": learner.state_dict(), "rng": rng_state(), **state}, tmp / STATE_FILE)

    final = write_dir_atomically(Path(run_dir) / "checkpoints" / f"step_{step}", write)
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: None (fresh run), "auto" (newest of `run_dir`, or None
    when it has none yet), or an explicit checkpoint directory."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} holds no {STATE_FILE}; give a <run dir>/checkpoints/"
                                "step_N directory or trainer.resume=auto")
    return path


def load(path: Path) -> dict:
    """The trainer state of checkpoint `path` (its policy weights are in `path / "policy"`)."""
    # Our own file: it holds python and numpy RNG states, which weights_only loading refuses.
    # map_location: tensors saved from GPU state (optimizer moments) load on any machine, a GPU-less one
    # included; Optimizer.load_state_dict moves them to the parameters' device.
    return torch.load(Path(path) / STATE_FILE, weights_only=False, map_location="cpu")
