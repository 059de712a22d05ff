"""Engine processes that die with their parent, and keep their last error where the parent can read it.

Why: without this, `kill -9` (or the OOM killer) on the trainer leaves vLLM's EngineCore, its worker
and a resource tracker alive indefinitely, holding gigabytes of memory: nothing in them notices that
the process that drives them is gone (the worker watches a pipe to the EngineCore, but the EngineCore
only waits on its ZMQ input socket).

How: vLLM starts both of its process kinds through ``get_mp_context().Process(target=...)``
(vllm 0.32: ``vllm/v1/engine/utils.py`` for the EngineCore, ``vllm/v1/executor/multiproc_executor.py``
for each worker; both import ``get_mp_context`` by name). :func:`install` replaces that name in those
two modules with a context whose ``Process`` wraps the target in :func:`_child_main`, a module-level
function (so it pickles under the spawn start method). In the child, before vLLM's own code runs,
``_child_main``

* sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, man 2 prctl): the kernel kills the child when
  the *thread* that started it exits, SIGKILL of the parent included. The EngineCore is therefore
  started from the caller's (long-lived, normally the main) thread, never from a helper thread;
* re-checks the parent pid, closing the race where the parent died before prctl ran;
* installs itself again (the EngineCore starts the workers, which get the same treatment);
* appends vLLM's ERROR log records (with traceback) to ``error_file``, so the parent can attach the
  engine's root error to the exception it raises (vLLM's client only says "EngineCore encountered
  an issue. See stack trace (above) for the root cause").

The resource tracker needs nothing: it exits when every process holding its pipe has exited
(CPython ``multiprocessing/resource_tracker.py``: it reads until EOF, then cleans up).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import traceback
from pathlib import Path
from typing import Any, Callable

from grpo_lab.parent_death import set_parent_death_signal  # also lifeline.set_parent_death_signal for engine_process

# Modules (vllm 0.32) that start engine processes through a module-level `get_mp_context` name.
VLLM_PROCESS_STARTERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor")


class _ErrorFileHandler(logging.Handler):
    """Appends ERROR records (message + traceback) to a file, one block per record."""

    def __init__(self, path: str):
        super().__init__(level=logging.ERROR)
        self.path = path
        self.setFormatter(logging.Formatter("[%(processName)s pid=%(process)d] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(self.format(record).rstrip() + "\n\n")
        except Exception:  # a full disk must not turn an engine error into a logging error
            pass


def _attach_sticky(logger: logging.Logger, handler: logging.Handler) -> None:
    """Add ``handler`` so that a later ``logging.config.dictConfig`` cannot remove it.

    vLLM's engine and worker processes re-apply vLLM's logging dictConfig when they start
    (``configure_logging`` in ``run_engine_core`` / ``worker_main``), which removes every handler of
    the "vllm" logger (``logger.removeHandler``, CPython ``logging/config.py: common_logger_config``)
    and clears those of its child loggers; module loggers propagate to "vllm", so one handler
    there sees every vLLM error record once it survives the reconfiguration.
    """
    original = logger.removeHandler

    def remove_handler(h: logging.Handler) -> None:
        if h is not handler:
            original(h)

    logger.removeHandler = remove_handler  # type: ignore[method-assign]
    logger.addHandler(handler)


def _child_main(target: Callable[..., Any], parent_pid: int, error_file: str | None, *args: Any,
                **kwargs: Any) -> Any:
    """Runs first in every engine process (see module docstring), then vLLM's own target."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody is left to serve
        os._exit(1)
    install(error_file)
    if not error_file:
        return target(*args, **kwargs)
    _attach_sticky(logging.getLogger("vllm"), _ErrorFileHandler(error_file))
    try:
        return target(*args, **kwargs)
    except BaseException as e:  # recorded for the parent, then vLLM's own handling goes on
        if not isinstance(e, SystemExit) or e.code not in (None, 0):
            _ErrorFileHandler(error_file).emit(logging.makeLogRecord(
                {"msg": "engine process exited: %s", "args": ("".join(traceback.format_exception(e)),),
                 "levelno": logging.ERROR, "levelname": "ERROR"}))
        raise


class _LifelineContext:
    """A multiprocessing context whose Process targets run under :func:`_child_main`."""

    def __init__(self, ctx, error_file: str | None):
        self._ctx, self._error_file = ctx, error_file

    def Process(self, *args: Any, target: Callable[..., Any] | None = None, **kwargs: Any):  # noqa: N802
        if target is not None:
            target = functools.partial(_child_main, target, os.getpid(), self._error_file)
        return self._ctx.Process(*args, target=target, **kwargs)

    def __getattr__(self, name: str) -> Any:  # Pipe, Queue, Event, ... unchanged
        return getattr(self._ctx, name)


def install(error_file: str | None = None) -> list[str]:
    """Route vLLM's engine-process starts through :func:`_child_main`; returns the patched modules.

    Idempotent; the latest ``error_file`` wins (one engine at a time per process). A module that
    does not exist or lacks ``get_mp_context`` (another vLLM version) is skipped: the caller warns.
    """
    import importlib

    patched = []
    for name in VLLM_PROCESS_STARTERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(mod, "get_mp_context", None)
        if original is None:
            continue
        original = getattr(original, "__wrapped_original__", original)

        def get_mp_context(_orig=original):
            return _LifelineContext(_orig(), error_file)

        get_mp_context.__wrapped_original__ = original  # type: ignore[attr-defined]
        mod.get_mp_context = get_mp_context
        patched.append(name)
    return patched


def read_error_file(path: str | os.PathLike | None, limit: int = 4000) -> str:
    """The engine processes' logged errors (last ``limit`` characters), or ''."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""
    return text[-limit:]


def root_error_line(text: str) -> str:
    """The most telling line of an engine error log: the last ``SomeError: message`` line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head and ":" in ln:
            return ln
    return lines[-1] if lines else ""
