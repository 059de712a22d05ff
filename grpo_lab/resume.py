"""Continue a killed or preempted run: `python -m grpo_lab.resume <run dir> [extra overrides]`
(`make resume RUN=<run dir>`).

Replays the run's own command-line overrides (the recorder keeps them in `<run dir>/overrides.yaml`,
with the launch's `hydra.searchpath` where a config group came from another directory, as a table's
`+variant=<row>` does; a run from before it did: Hydra's `<run dir>/.hydra/overrides.yaml`), pinned to
the same directory with `trainer.resume=auto`, so the run continues from its newest intact checkpoint
(grpo_lab/checkpoint.py) with the same config, the same wandb run and no duplicated lines in metrics.jsonl. An extra
`trainer.resume=<checkpoint dir>` continues from that checkpoint instead. Extra overrides may change
only what grpo_lab/run_guard.py's RESUMABLE_CHANGES lists (e.g. trainer.total_steps=300): the
launch refuses any other change before it loads a model, and records the allowed ones.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from grpo_lab.logging.recorder import OVERRIDES_FILE

# Overrides the resume sets itself.
_PINNED = ("hydra.run.dir", "trainer.resume")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def resume_command(run_dir: Path, extra: list[str] = ()) -> list[str]:
    run_dir = Path(run_dir).resolve()
    overrides_file = next((f for f in (run_dir / OVERRIDES_FILE, run_dir / ".hydra" / "overrides.yaml") if f.is_file()),
                          None)
    if overrides_file is None:
        raise SystemExit(f"{run_dir} is not a grpo_lab run directory (no {OVERRIDES_FILE}); give the "
                         "directory a run wrote (outputs/runs/<time>_<name> or a sweep's job directory)")
    if not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").glob("step_*")):
        raise SystemExit(f"{run_dir} has no resumable checkpoint (checkpoints/step_N): the run was started "
                         "with trainer.checkpoint_every=0; start it again with trainer.checkpoint_every=N")
    if any(_key(o) == "hydra.run.dir" for o in extra):
        raise SystemExit("hydra.run.dir is the run directory given as the first argument; drop the override")
    chosen = [o for o in extra if _key(o) == "trainer.resume"]
    given = {_key(o) for o in extra}   # an extra override replaces the recorded one of its key
    overrides = [o for o in yaml.safe_load(overrides_file.read_text()) or [] if _key(o) not in (*_PINNED, *given)]
    return [sys.executable, "-m", "grpo_lab.train", *overrides, *(o for o in extra if _key(o) not in _PINNED),
            f"hydra.run.dir={run_dir}", chosen[-1] if chosen else "trainer.resume=auto"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    cmd = resume_command(Path(argv[0]), argv[1:])
    print("resuming:", " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
