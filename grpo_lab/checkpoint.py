"""Resumable checkpoints: everything that changes over a run, written atomically together.

    <run dir>/checkpoints/step_<k>/
        policy/              the policy (save_pretrained: loadable as a plain HF model directory)
        learner_dcp/         learner.strategy=fsdp2 only: model + optimizer shards (torch.distributed.checkpoint),
                             loadable on any world size; the optimizer is then not in trainer_state.pt
        trainer_state.pt     optimizer, critic + its optimizer, learner counters and generator,
                             RNG states (python, numpy, torch CPU / CUDA), prompt-stream position,
                             sampler call counter, reward normaliser, step and sample counters,
                             recorder state (wandb run id, metrics.jsonl line count, initial evals),
                             a multi-turn environment's state_dict (grpo_lab/interaction)
        config.yaml          the run's config.yaml when it was written (what a resume compares against)
        manifest.json        every other file's size and sha256; written last

A checkpoint is written into a temporary sibling and renamed into place, so a kill at any moment
leaves either the previous set of checkpoints or the new one, never a half-written directory that
`resume=auto` would pick (a killed write leaves a `.step_N.tmp-*` sibling, removed at the next save or
resume). Its manifest is written last, atomically, after every file was flushed to disk: a checkpoint
is complete only with a manifest its files match, so a disk that lost or damaged a file later is
caught on load, and `resume=auto` falls back to the newest checkpoint that verifies. A checkpoint
written before manifests existed is accepted unverified when it has its state file. The group-size
schedule position is a function of the step, so it needs no state of its own. Restoring all of it reproduces the uninterrupted run (tests/test_resume.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np

from grpo_lab.atomic_dir import write_dir_atomically

# torch is imported by the functions that write or read a state, not here: listing and resolving a run's
# checkpoints is part of refusing a launch, which must not wait for torch to load.

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_GLOB = ".step_*.tmp-*"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or damaged; the message names the file."""


def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving process saw; a resume may see fewer (an 8-GPU run resumed on one
        # GPU): restore those it has (set_rng_state_all would index past the last device).
        for index, gpu_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, index)


def checkpoints(run_dir: Path) -> list[Path]:
    """Resumable checkpoints of a run directory (with a manifest, or a state file from before manifests),
    oldest first; `verify` says whether one is intact."""
    root = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := _STEP_DIR.match(p.name)) and ((p / MANIFEST).is_file() or (p / STATE_FILE).is_file())]
    return [p for _, p in sorted(found)]


def _sha256(path: Path, *, sync: bool = False) -> str:
    """The file's sha256; `sync`: also flush it to disk, so a manifest is never written ahead of its files."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def write_manifest(ckpt: Path) -> None:
    """`ckpt/manifest.json`: every file's size and sha256, written last and atomically."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p, sync=True)} for p in files}
    tmp = ckpt / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def verify(ckpt: Path) -> None:
    """Raise CheckpointError naming the first file of `ckpt` that is missing, truncated or altered."""
    ckpt, manifest = Path(ckpt), Path(ckpt) / MANIFEST
    if not manifest.is_file():
        if (ckpt / STATE_FILE).is_file():   # written before manifests existed: accepted unverified
            print(f"note: checkpoint {ckpt} has no {MANIFEST} (written by an older grpo_lab); loading it unverified",
                  file=sys.stderr)
            return
        raise CheckpointError(f"{ckpt} is not a complete checkpoint: it has no {MANIFEST}")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest} is unreadable ({err})") from None
    if STATE_FILE not in entries:
        raise CheckpointError(f"{manifest} lists no {STATE_FILE}")
    for rel, entry in entries.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {manifest})")
        if path.stat().st_size != entry["size"]:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes; {manifest} says {entry['size']}")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its sha256 differs from {manifest}'s")


def remove_partial(run_dir: Path) -> None:
    """Delete the `.step_N.tmp-*` directories of checkpoint writes that were killed midway (only the
    process that owns the run directory calls this, so none of them is still being written)."""
    for tmp in (Path(run_dir) / "checkpoints").glob(_PARTIAL_GLOB):
        shutil.rmtree(tmp, ignore_errors=True)


def save(run_dir: Path, step: int, *, learner, tokenizer, state: dict, keep: int) -> Path:
    """Write checkpoint `step_<step>` atomically (over one of the same step from an interrupted
    attempt), then delete all but the newest `keep`."""
    remove_partial(run_dir)

    import torch

    def write(tmp: Path) -> None:
        learner.save(tmp / "policy", tokenizer)
        if getattr(learner, "sharded", False):
            from grpo_lab.learner.distributed import DCP_DIR

            learner.save_dcp(tmp / DCP_DIR)
        torch.save({"step": step, "learner": learner.state_dict(), "rng": rng_state(), **state}, tmp / STATE_FILE)
        if (Path(run_dir) / CONFIG_FILE).is_file():
            shutil.copyfile(Path(run_dir) / CONFIG_FILE, tmp / CONFIG_FILE)
        write_manifest(tmp)

    final = write_dir_atomically(Path(run_dir) / "checkpoints" / f"step_{step}", write)
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: None (fresh run), "auto" (the newest of `run_dir` that
    verifies, warning about each newer one that does not; None when it has none yet), or an explicit
    checkpoint directory (which must verify: the user chose it)."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        for ckpt in reversed(found):
            try:
                verify(ckpt)
                return ckpt
            except CheckpointError as err:
                print(f"warning: skipping checkpoint {ckpt.name}: {err}; falling back to the one before it",
                      file=sys.stderr, flush=True)
        if found:
            raise CheckpointError(f"none of the checkpoints of {run_dir} verifies (see the warnings above); "
                                  "resume from one of another run with trainer.resume=<checkpoint dir>, or "
                                  "start a new run in another directory")
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file() and not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} holds no {STATE_FILE}; give a <run dir>/checkpoints/"
                                "step_N directory or trainer.resume=auto")
    verify(path)
    return path


def load_step(path: Path) -> int:
    """The step checkpoint `path` was written at."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else int(load(path)["step"])


def load(path: Path) -> dict:
    """The trainer state of checkpoint `path` (its policy weights are in `path / "policy"`)."""
    # Our own file: it holds python and numpy RNG states, which weights_only loading refuses.
    # map_location: tensors saved from GPU state (optimizer moments) load on any machine, a GPU-less one
    # included; Optimizer.load_state_dict moves them to the parameters' device.
    import torch

    try:
        return torch.load(Path(path) / STATE_FILE, weights_only=False, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{Path(path) / STATE_FILE} cannot be loaded ({type(err).__name__}: {err}); "
                              "resume from an earlier checkpoint with trainer.resume=<checkpoint dir>") from err
