"""One call site for everything a run records.

Every run writes, under its directory: `config.yaml` (the resolved config actually run; after a resume
that changed a key grpo_lab.run_guard allows, also `resume_changes`: one {step, key, old, new} per
change), `overrides.yaml` (the command-line overrides it was launched with: what `grpo_lab.resume`
replays; Hydra's `.hydra/overrides.yaml` is rewritten by any launch into the directory, a refused one
included), `metrics.jsonl` (one line per step, plus eval lines, plus a `resume_changes` line at the
step a resume changed something), `summary.json` (status, error, initial and final metrics) — so the
table makers never depend on a wandb server. When `logger.backend=wandb`
the same metrics go to wandb (offline unless the user configured it online), with run name,
group, job_type and tags derived from the config and the sweep.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

OVERRIDES_FILE = "overrides.yaml"


def wandb_mode(configured: str | None) -> str:
    """`logger.mode` if set; else WANDB_MODE; else online only when credentials exist, offline otherwise."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if has_key else "offline"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v))


def run_tags(cfg: DictConfig, overrides: list[str], swept_keys: list[str]) -> list[str]:
    """The settings researchers filter by, always present, then every swept override as key=value."""
    from grpo_lab.tasks import task_label

    a = cfg.algorithm
    tags = [f"algorithm={a.name}", f"G={cfg.rollout.group_size}", f"clip={a.clip_low:g}-{a.clip_high:g}",
            f"kl={a.kl.coef:g}", f"seed={cfg.seed}", f"task={task_label(cfg.task)}"]
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    tags += [f"{k}={values[k]}" for k in swept_keys if k in values] + list(cfg.logger.tags)
    # wandb caps a tag at 64 characters; keep order, drop duplicates.
    return list(dict.fromkeys(t[:64] for t in tags))


def recorded_lines(run_dir: Path) -> int:
    """How many metric lines a run directory already holds (0 when none)."""
    f = Path(run_dir) / "metrics.jsonl"
    return sum(1 for line in f.read_text().splitlines() if line.strip()) if f.is_file() else 0


class RunRecorder:
    """`resume`: the recorder state saved in a checkpoint (`state_dict()`); metrics.jsonl is cut back to
    the lines written up to that checkpoint, so a resumed run never duplicates a step, and wandb
    continues the same run id."""

    def __init__(self, run_dir: Path, cfg: DictConfig, *, overrides: list[str], sweep: str | None,
                 swept_keys: list[str], resume: dict | None = None, searchpath: list[str] = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.overrides = cfg, overrides
        self.start = time.time() - (resume["elapsed"] if resume else 0.0)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        # The searchpath goes with them: a config group from another directory (a table's `+variant=`)
        # composes only where Hydra is told to look for it.
        (self.run_dir / OVERRIDES_FILE).write_text(yaml.safe_dump([*overrides, *searchpath], default_flow_style=False))
        self._finishing, self.summary = threading.Lock(), None
        metrics_path = self.run_dir / "metrics.jsonl"
        self.lines = 0
        if resume:
            kept = [line for line in metrics_path.read_text().splitlines() if line.strip()][:resume["metrics_lines"]]
            metrics_path.write_text("".join(line + "\n" for line in kept))
            self.lines = len(kept)
        self.metrics_file = open(metrics_path, "a", buffering=1)
        samples_path = self.run_dir / "samples.jsonl"
        self.sample_lines = 0
        if resume and samples_path.is_file():
            kept = [line for line in samples_path.read_text().splitlines() if line.strip()]
            kept = kept[:resume.get("sample_lines", len(kept))]
            samples_path.write_text("".join(line + "\n" for line in kept))
            self.sample_lines = len(kept)
        self.samples_file = open(samples_path, "a", buffering=1)
        self.initial: dict = dict(resume["initial"]) if resume else {}
        self.last: dict = {}
        self.step, self.samples = (resume["step"], resume["samples"]) if resume else (0, 0)
        self.wandb = None
        if cfg.logger.backend == "wandb":
            import wandb

            from grpo_lab.tasks import task_label

            self.wandb = wandb.init(
                id=resume.get("wandb_id") if resume else None, resume="allow" if resume else None,
                project=cfg.logger.project, entity=cfg.logger.entity, name=cfg.run_name,
                group=cfg.logger.group or sweep or f"{task_label(cfg.task)}-{cfg.algorithm.name}",
                job_type=cfg.algorithm.name, tags=run_tags(cfg, overrides, swept_keys),
                config=OmegaConf.to_container(cfg, resolve=True), dir=str(self.run_dir),
                mode=wandb_mode(cfg.logger.mode), reinit="finish_previous",
                settings=wandb.Settings(console="off", silent=True))

    def log(self, metrics: dict, *, step: int, samples: int) -> None:
        """Append one line to metrics.jsonl and send the same metrics to wandb."""
        self.step, self.samples = step, samples
        record = {"step": step, "samples": samples, "wall_time_s": round(time.time() - self.start, 3)}
        record.update({k: (float(v) if _finite(v) else None) for k, v in metrics.items()})
        self.metrics_file.write(json.dumps(record) + "\n")
        self.lines += 1
        for k, v in metrics.items():
            if k.startswith("eval/") and k not in self.initial:
                self.initial[k] = v
        self.last.update(metrics)
        if self.wandb is not None:
            self.wandb.log({**metrics, "samples": samples}, step=step)

    def record_resume_changes(self, changes: list[dict], *, new: list[dict]) -> None:
        """`changes`: every change of the run's resumes so far ({step, key, old, new}), into config.yaml;
        `new`: this resume's, also as one metrics.jsonl line at the resume step (and into wandb's config)."""
        if changes:
            (self.run_dir / "config.yaml").write_text(
                OmegaConf.to_yaml(self.cfg, resolve=True) + yaml.safe_dump({"resume_changes": changes}, sort_keys=False))
        if new:
            record = {"step": self.step, "samples": self.samples, "wall_time_s": round(time.time() - self.start, 3),
                      "resume_changes": {c["key"]: {"old": c["old"], "new": c["new"]} for c in new}}
            self.metrics_file.write(json.dumps(record, default=str) + "\n")
            self.lines += 1
            if self.wandb is not None:
                self.wandb.config.update({**OmegaConf.to_container(self.cfg, resolve=True), "resume_changes": changes},
                                         allow_val_change=True)

    def log_samples(self, rows: list[dict], *, step: int, kind: str) -> None:
        """What the policy wrote: one samples.jsonl line per row (`kind`: "train" or "eval"), and the
        same rows as a wandb Table (`samples/<kind>`)."""
        if not rows:
            return
        for row in rows:
            self.samples_file.write(json.dumps({"step": step, "kind": kind, **row}, default=str) + "\n")
            self.sample_lines += 1
        if self.wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = wandb.Table(columns=columns, data=[[str(row.get(c, "")) if isinstance(row.get(c), str)
                                                        else row.get(c) for c in columns] for row in rows])
            self.wandb.log({f"samples/{kind}": table}, step=step)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this record exactly (saved in each checkpoint)."""
        return {"metrics_lines": self.lines, "sample_lines": self.sample_lines, "initial": dict(self.initial), "elapsed": time.time() - self.start,
                "step": self.step, "samples": self.samples,
                "wandb_id": self.wandb.id if self.wandb is not None else None}

    def _write_summary(self, status: str, error: BaseException | None, extra: dict | None) -> dict:
        summary = _summary(status, error, self.cfg, self.overrides, initial=self.initial,
                           final={k: v for k, v in self.last.items() if _finite(v)}, steps=self.step,
                           samples=self.samples, wall_time_s=round(time.time() - self.start, 2), **(extra or {}))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.summary = summary
        return summary

    def record_stuck(self, error: BaseException) -> None:
        """summary.json (status "failed") from another thread while the main thread is stuck (the SIGTERM
        watchdog, grpo_lab.run_guard): nothing else, since the main thread may hold the files and wandb."""
        if self._finishing.acquire(timeout=2):
            try:
                if self.summary is None:
                    self._write_summary("failed", error, None)
            finally:
                self._finishing.release()

    def finish(self, *, status: str, error: BaseException | None = None, extra: dict | None = None) -> dict:
        with self._finishing:
            if self.summary is not None:   # recorded already (the SIGTERM watchdog)
                return self.summary
            summary = self._write_summary(status, error, extra)
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb is not None:
            for k, v in summary["final"].items():
                self.wandb.summary[k] = v
            self.wandb.summary["status"] = status
            self.wandb.finish(exit_code=0 if status == "completed" else 1)
        return summary


def _summary(status: str, error: BaseException | None, cfg: DictConfig, overrides: list[str], **fields) -> dict:
    """summary.json's record: status, error (message and traceback), run name, overrides, then `fields`."""
    return {"status": status,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "traceback": None if error is None else "".join(traceback.format_exception(error))[-4000:],
            # The rollout engine's own log of its failure (its processes' ERROR lines), when it died.
            "engine_error": getattr(error, "engine_error", None) or None,
            "run_name": cfg.run_name, "overrides": overrides, **fields}


def record_failure(run_dir: Path, cfg: DictConfig, *, overrides: list[str], error: BaseException) -> None:
    """config.yaml + summary.json (status "failed") for a run that failed before it started (e.g. its
    config did not validate), so a sweep's report counts it instead of missing it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = _summary("failed", error, cfg, overrides, initial={}, final={}, steps=0, samples=0, wall_time_s=0.0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
