"""Continue a killed or preempted run: `python -m grpo_lab.resume <run dir> [extra overrides]`
(`make resume RUN=<run dir>`).

Replays the run's own command-line overrides (Hydra saved them in `<run dir>/.hydra/overrides.yaml`),
pinned to the same directory with `trainer.resume=auto`, so the run continues from its newest
checkpoint (grpo_lab/checkpoint.py) with the same config, the same wandb run and no duplicated
lines in metrics.jsonl.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

# Overrides the resume sets itself.
_PINNED = ("hydra.run.dir", "trainer.resume")


def resume_command(run_dir: Path, extra: list[str] = ()) -> list[str]:
    run_dir = Path(run_dir).resolve()
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        raise SystemExit(f"{run_dir} is not a grpo_lab run directory (no .hydra/overrides.yaml); give the "
                         "directory a run wrote (outputs/runs/<time>_<name> or a sweep's job directory)")
    if not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").glob("step_*")):
        raise SystemExit(f"{run_dir} has no resumable checkpoint (checkpoints/step_N): the run was started "
                         "with trainer.checkpoint_every=0; start it again with trainer.checkpoint_every=N")
    overrides = [o for o in yaml.safe_load(overrides_file.read_text()) or []
                 if o.split("=", 1)[0].lstrip("+~") not in _PINNED]
    return [sys.executable, "-m", "grpo_lab.train", *overrides, *extra,
            f"hydra.run.dir={run_dir}", "trainer.resume=auto"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    cmd = resume_command(Path(argv[0]), argv[1:])
    print("resuming:", " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
