"""Reward calls in a worker process that can be killed: the only way to end every hang.

Why a process: a timeout inside this process can only raise an exception in the thread that runs
the reward, and only between Python bytecodes (a signal reaches the main thread alone; an async
exception waits for the next bytecode). A reward stuck inside one C call (a catastrophic regex such
as ``re.match(r"(a+)+$", "a" * 40 + "b")``, a huge integer power) or sleeping in a background
thread (``trainer.max_staleness=1`` samples in one) is never stopped that way. A worker process is
stopped by SIGKILL, whatever it runs.

One long-lived worker per trainer process (:func:`main` in a fresh interpreter, started on
first use; it imports grpo_lab.rewards, not torch), serving one call at a time over two pipes:

* the function travels by reference (``pickle`` of a module-level function: its module and name),
  so plug-ins named by import path and entries registered at module level both load in the worker,
  whose ``sys.path`` is this process's; a function that pickles only by value (a lambda, a closure)
  cannot be sent and is an error naming ``reward.isolation=thread``;
* loading a function (its module's import) is not timed; the call is, by ``timeout_s``: past it the
  worker is killed and replaced on the next call, and the caller gets :class:`RewardTimeout`;
* an exception raised by the reward comes back as that exception (as text if it does not pickle),
  so failures read the same as in-process ones;
* the worker dies with the thread that started it (``PR_SET_PDEATHSIG``) and when this process
  closes its pipe, so no hung worker outlives the run;
* :func:`stop_reward_worker` (called when a run ends, also by SIGTERM or an error) kills the worker;
  a call in flight then raises :class:`RewardWorkerStopped` (a BaseException: a stopping run, not a
  failed sample), which also unblocks a sampling thread that waits on a hung reward.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

# Seconds a worker may take to start, or to import a reward's module (not part of reward.timeout_s).
LOAD_TIMEOUT_S = 300.0


class RewardTimeout(BaseException):
    """Raised inside (or, for a worker, on behalf of) a reward function that ran past ``reward.timeout_s``.

    A BaseException (like KeyboardInterrupt), so a reward function's ``except Exception`` cannot
    swallow it.
    """


class RewardWorkerStopped(BaseException):
    """The reward worker was stopped (the run is ending) while a call waited on it."""


class RewardWorker:
    """One worker process and its two pipes; :meth:`call` runs one reward call in it."""

    def __init__(self) -> None:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import main; main()", str(to_worker_r),
                                      str(from_worker_w), str(os.getpid())],
                                     pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL, env=env)
        os.close(to_worker_r)
        os.close(from_worker_w)
        self.requests = Connection(to_worker_w, readable=False)
        self.replies = Connection(from_worker_r, writable=False)
        self.loaded: set[bytes] = set()
        self.stopping = False
        self._reply(LOAD_TIMEOUT_S, "starting")

    def alive(self) -> bool:
        return not self.stopping and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a hung C call ignores everything else) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process always ends
            pass

    def stop(self) -> None:
        self.stopping = True
        self.kill()

    def _reply(self, timeout_s: float | None, doing: str) -> Any:
        """The worker's next answer within ``timeout_s`` (None: no limit); on any interruption (a
        signal's exception, SIGTERM included) the worker is killed, since it may be hung."""
        try:
            ready = self.replies.poll(timeout_s)
            if not ready:
                self.kill()
                raise RewardTimeout()
            status, value = pickle.loads(self.replies.recv_bytes())
        except (EOFError, OSError):
            if self.stopping:
                raise RewardWorkerStopped() from None
            self.kill()
            raise RuntimeError(f"the reward worker process ended while {doing} (exit code "
                               f"{self.proc.returncode})") from None
        except BaseException:
            self.kill()
            raise
        if status == "error":
            raise value
        return value

    def call(self, fn_ref: bytes, completions: list[str], kwargs: dict[str, Any], timeout_s: float | None) -> Any:
        if fn_ref not in self.loaded:
            self.requests.send(("load", fn_ref))
            self._reply(LOAD_TIMEOUT_S, "importing the reward function")
            self.loaded.add(fn_ref)
        self.requests.send(("call", fn_ref, completions, kwargs))
        return self._reply(timeout_s, "running the reward function")


_lock = threading.Lock()
_worker: RewardWorker | None = None


def function_ref(fn: Callable, name: str) -> bytes:
    """``fn`` pickled by reference, or a ValueError saying why it cannot go to a worker."""
    try:
        ref = pickle.dumps(fn)
        if len(ref) > 4096:  # by value (e.g. a callable object holding data): not what a worker should get
            raise pickle.PicklingError(f"it pickles to {len(ref)} bytes, not a reference")
        return ref
    except Exception as e:
        raise ValueError(f"reward {name!r} cannot run in a worker process ({type(e).__name__}: {e}); define it "
                         "at module level in an importable module, or run it in this process with "
                         "reward.isolation=thread (where a hang inside C code cannot be interrupted)") from None


def call_in_worker(fn_ref: bytes, completions: list[str], kwargs: dict[str, Any], timeout_s: float | None) -> Any:
    """``fn(completions, **kwargs)`` in the worker (started or replaced as needed), within ``timeout_s``
    seconds (None: no limit): its result, its exception, or :class:`RewardTimeout` (the worker killed)."""
    global _worker
    with _lock:
        if _worker is None or not _worker.alive():
            _worker = RewardWorker()
        worker = _worker
        try:
            return worker.call(fn_ref, completions, kwargs, timeout_s)
        finally:
            if not worker.alive() and _worker is worker:
                _worker = None


def stop_reward_worker() -> None:
    """Kill the worker now (a run ends); a call waiting on it raises :class:`RewardWorkerStopped`.
    Takes no lock, so it also ends a call that hangs; the next call starts a fresh worker."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None:
        worker.stop()


def worker_pid() -> int | None:
    """The running worker's pid (None: none running)."""
    worker = _worker
    return worker.proc.pid if worker is not None and worker.alive() else None


atexit.register(stop_reward_worker)


def _serve(requests: Connection, replies: Connection) -> None:
    """The worker's loop: load or call, answer ``(status, value)``; ends when the parent's pipe closes."""
    functions: dict[bytes, Callable] = {}
    replies.send_bytes(pickle.dumps(("ok", os.getpid())))
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        try:
            if request[0] == "load":
                functions[request[1]] = pickle.loads(request[1])
                value = None
            else:
                _, ref, completions, kwargs = request
                value = functions[ref](completions, **kwargs)
            answer = pickle.dumps(("ok", value))
        except Exception as e:
            try:
                answer = pickle.dumps(("error", e))
                pickle.loads(answer)
            except Exception:
                answer = pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        replies.send_bytes(answer)


def main() -> None:
    """The worker process's entry point: ``argv[1:]`` are the fds of its request and reply pipes and
    the parent's pid."""
    from grpo_lab.parent_death import set_parent_death_signal

    set_parent_death_signal()
    if os.getppid() != int(sys.argv[3]):  # the parent died before prctl ran
        sys.exit(0)
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
