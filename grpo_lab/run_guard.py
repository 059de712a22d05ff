"""One run directory, one run: what keeps a long run's record whole across kills, resumes and mistakes.

* Ownership (:class:`RunLock`): a process owns its run directory for the run's life through
  ``fcntl.flock`` on ``<run dir>/.run.lock``, which holds its pid. The kernel drops the lock when the
  process dies (``kill -9`` included), so no stale lock outlives a run; a second process into the same
  directory fails at once, naming the owner, before it loads anything.
* Refused launches touch nothing (:class:`DirSnapshot`): Hydra writes ``.hydra/`` and its job log into
  the run directory before our code runs; a launch that is then refused (the directory holds another
  run, is owned by a live process, or a resume would change what defines the run) puts those files
  back byte for byte.
* What a resume may change (:data:`RESUMABLE_CHANGES`): everything else in the resolved config defines
  the run, so a resume that changes it is refused, naming each key with its old and new value.
* SIGTERM always ends a run with a failed summary.json (:func:`install_sigterm`): the Python handler
  unwinds the main thread like Ctrl-C; when that thread is stuck (a C call that does not return to
  the interpreter, a join on a thread that never ends), a watchdog thread records the failure and
  exits after :data:`SIGTERM_GRACE_S`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_lab.schema import ConfigError

LOCK_FILE = ".run.lock"

# Keys a resume may change, with why it is safe: none of them changes the math of a step already
# planned, only how long the run goes, how often it evaluates, logs or saves, and where it reports.
# `trainer.resume` itself differs between any launch and its resume and is never compared. A change
# is recorded in config.yaml (`resume_changes`) and as a metrics.jsonl line at the resume step.
RESUMABLE_CHANGES: dict[str, str] = {
    "trainer.total_steps": "how long the run goes",
    "trainer.total_samples": "how long the run goes (in generated completions)",
    "trainer.eval_every": "how often it evaluates",
    "trainer.log_samples_every": "how often it logs samples",
    "trainer.samples_per_log": "how many samples it logs",
    "trainer.checkpoint_every": "how often it saves",
    "trainer.keep_checkpoints": "how many checkpoints it keeps",
    "trainer.save_checkpoint": "whether it saves the final policy",
    "trainer.max_bad_steps": "how many non-finite steps it tolerates before failing",
    "logger.*": "where it reports (wandb project, mode, tags, ...)",
}
# Besides these, a key that neither the checkpoint's run nor the resumed one reads may change (e.g.
# learner.total_steps, which follows trainer.total_steps, under a constant schedule): grpo_lab.config_reads
# says which keys a run reads, the same rule that refuses an unread setting at launch.

# Under Slurm's default KillWait (30 s between SIGTERM and SIGKILL), with room for the engine's shutdown.
SIGTERM_GRACE_S = 20.0


class RunDirInUse(RuntimeError):
    """Another live process owns the run directory."""


def resumable(key: str, unread_old: Container[str], unread_new: Container[str]) -> bool:
    """A change of `key` a resume may make: listed in RESUMABLE_CHANGES, or read by neither run (the
    `unread_*` sets: grpo_lab.config_reads.unread_keys of each side's config)."""
    if key in RESUMABLE_CHANGES or any(k.endswith(".*") and key.startswith(k[:-1]) for k in RESUMABLE_CHANGES):
        return True
    return key in unread_old and key in unread_new


# A key one of the two configs does not have (a section the schema gained after the checkpoint was written).
ABSENT = "(absent)"


def config_changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every leaf that differs between two config trees; a key only
    one of them has is compared as ABSENT on the other side."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, dotted = old.get(key, ABSENT), new.get(key, ABSENT), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{dotted}.")
        elif a != b:
            out.append((dotted, a, b))
    return out


def resume_changes(cfg: DictConfig, recorded: dict, *, step: int) -> list[dict]:
    """The changes of a resume from a checkpoint whose run had the resolved config `recorded`, as records
    ({step, key, old, new}); raises ConfigError naming every change that is not in RESUMABLE_CHANGES."""
    new = OmegaConf.to_container(cfg, resolve=True)
    old = {k: v for k, v in recorded.items() if k != "resume_changes"}
    changes = [c for c in config_changes(old, new) if c[0] != "trainer.resume"]
    unread_old, unread_new = _unread(old), _unread(new)
    refused = [c for c in changes if not resumable(c[0], unread_old, unread_new) and not added_at_default(*c)]
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused)
        raise ConfigError(
            f"resuming would change what defines the run ({listed}). A resumed run continues the same "
            f"experiment: drop these overrides (or start a new run in another directory). A resume may change "
            f"only {', '.join(RESUMABLE_CHANGES)} (grpo_lab/run_guard.py: RESUMABLE_CHANGES)")
    return [{"step": step, "key": k, "old": a, "new": b} for k, a, b in changes]


def _unread(cfg: dict) -> set[str]:
    """Keys the run of `cfg` does not read; none when the config does not fit today's schema (a checkpoint
    from a much older schema): then nothing beyond RESUMABLE_CHANGES may change."""
    from grpo_lab.config_reads import unread_keys

    try:
        return set(unread_keys(cfg))
    except Exception:
        return set()


def added_at_default(key: str, old, new) -> bool:
    """A key the checkpoint's config lacks, set to the schema's default now: the schema gained it after the
    checkpoint was written (e.g. a new config section), and its default is what the old code did, so
    resuming with it changes nothing."""
    from grpo_lab.schema import Config

    if old != ABSENT:
        return False
    default = OmegaConf.select(OmegaConf.structured(Config), key, default=ABSENT, throw_on_missing=False)
    if OmegaConf.is_config(default):
        default = OmegaConf.to_container(default, resolve=True)
    return default == new


class RunLock:
    """The run directory's owner lock (module docstring). Held until `release()` or the process ends."""

    _held: list[RunLock] = []   # keeps every acquired lock's descriptor open for the process's life

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC: a program started with exec does not hold it; a forked child closes it (below), so an
        # orphaned fork cannot keep the directory locked after its parent died.
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RunDirInUse(f"{run_dir} is in use by process {holder} (it holds {self.path}); two processes "
                              "writing one run directory would interleave its metrics. Wait for that run to "
                              f"end, or stop it (kill {holder}), then resume") from None
        RunLock._held.append(self)

    def mark_owner(self) -> None:
        """Write this process's pid into the lock file (after the launch was accepted, so a refused one
        leaves the file as it was)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self in RunLock._held:
            RunLock._held.remove(self)
            os.close(self.fd)



def _close_locks_in_child() -> None:
    for lock in RunLock._held:
        os.close(lock.fd)   # the parent's descriptor keeps the lock
    RunLock._held.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)

class DirSnapshot:
    """What Hydra writes into an existing run directory before our code runs: `.hydra/` (kept whole) and
    its job log `<job>.log` at the top level (kept by length: it is only appended to). Nothing else is
    restored: another live process may own the directory and be writing its other files."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.hydra_existed = (self.run_dir / ".hydra").is_dir()
        self.hydra = {p: p.read_bytes() for p in self._hydra_files()}
        self.logs = {p: p.stat().st_size for p in self._logs()}

    def _hydra_files(self) -> list[Path]:
        return [p for p in self.run_dir.glob(".hydra/*") if p.is_file()]

    def _logs(self) -> list[Path]:
        return [p for p in self.run_dir.glob("*.log") if p.is_file()]

    def restore(self) -> None:
        for p in self._hydra_files():
            if p not in self.hydra:
                p.unlink()
        for p, kept in self.hydra.items():
            if not p.is_file() or p.read_bytes() != kept:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(kept)
        if not self.hydra_existed:
            shutil.rmtree(self.run_dir / ".hydra", ignore_errors=True)
        for p in self._logs():
            if p not in self.logs:
                p.unlink()
            elif p.stat().st_size > self.logs[p]:
                with open(p, "r+b") as f:
                    f.truncate(self.logs[p])


# Run directories whose launch was refused in this process (launch.run marks them; launch.main restores
# their snapshot once Hydra has exited).
REFUSED: set[Path] = set()


def run_dir_argument(argv: list[str]) -> Path | None:
    """The `hydra.run.dir=` a single run was launched with (None when Hydra picks a new directory or
    the launch is a sweep, whose jobs each get a new one)."""
    if any(a in ("-m", "--multirun") for a in argv):
        return None
    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" and "=" in a]
    return Path(given[-1].strip("'\"")) if given else None


# ------------------------------------------------------------------ SIGTERM
_on_stuck: list[Callable[[], None]] = []
_watchdog: list[threading.Thread] = []
_wakeup: list[socket.socket] = []   # the watchdog's socket pair, open for the process's life


def _watch(reader: socket.socket) -> None:
    while True:
        data = reader.recv(64)
        if not data:
            return
        if signal.SIGTERM in data:
            break
    # The Python handler has had SIGTERM_GRACE_S to unwind the main thread; this only runs if it did not.
    threading.Event().wait(SIGTERM_GRACE_S)
    for callback in list(_on_stuck):
        try:
            callback()
        except Exception as err:   # the exit below must happen whatever the record did
            print(f"recording the SIGTERM failed: {err!r}", file=sys.stderr, flush=True)
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:
        pass
    os._exit(128 + signal.SIGTERM)


def install_sigterm() -> None:
    """SIGTERM (a cancelled job, `kill`) unwinds the main thread like Ctrl-C, so the run is recorded as
    failed and the engine's processes are shut down instead of being orphaned. Python runs that handler
    only between bytecodes of the main thread, so the signal is also written to a wakeup socket that a
    watchdog thread reads: if the process still lives SIGTERM_GRACE_S later, it runs the `on_stuck`
    callbacks (which record the failure), kills the process's children and exits with 143."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if _watchdog and _watchdog[0].is_alive():
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=_watch, args=(reader,), name="sigterm-watchdog", daemon=True)
    thread.start()
    _watchdog[:] = [thread]
    _wakeup[:] = [reader, writer]


def on_stuck_sigterm(callback: Callable[[], None] | None) -> None:
    """What the watchdog runs before it exits (None: nothing); one callback per process."""
    _on_stuck[:] = [callback] if callback else []


@contextmanager
def stuck_sigterm_recorded(recorder) -> Iterator[None]:
    """While inside: a SIGTERM the main thread cannot unwind from is still recorded as the run's failure
    (`recorder.record_stuck`) by the watchdog before it ends the process."""
    on_stuck_sigterm(lambda: recorder.record_stuck(SystemExit(
        f"SIGTERM: the main thread did not unwind within {SIGTERM_GRACE_S:g} s (stuck in a C call or a join); "
        "the watchdog ended the process")))
    try:
        yield
    finally:
        on_stuck_sigterm(None)
