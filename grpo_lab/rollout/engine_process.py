"""`trainer.backend=engine_process`: the rollout engine, its client included, in a child process.

Why: with `trainer.max_staleness=1` the engine samples step k+1 while the learner trains on step k.
vLLM's `LLM` object is a client that runs in the process that calls it: it fans each prompt out into
G requests, decodes the engine's msgpack replies and builds per-token logprobs and text, besides the
EngineCore's own process. In the learner's process that client shares one interpreter with the
learner, so the two phases mostly take turns instead of overlapping (README, Speed: the overlap rows of
scripts/bench.py). This backend is the split a Ray actor gives, without Ray: the learner, rewards and
the loop stay here, the engine lives in one spawned child, and calls travel over a pipe.

    trainer process (loop, learner, rewards) ── pipe ──▶ engine process (make_engine(...): vLLM's
                                                          client; vLLM's EngineCore under it)

Weights go to the child through torch.multiprocessing's pickler: a CPU tensor's storage is moved to
shared memory once and the child maps it, so a push copies no tensor data through the pipe (CUDA
tensors travel as CUDA IPC handles; that path is written, not run here: no GPU).

The child dies with the trainer (PR_SET_PDEATHSIG, as vLLM's own processes do: rollout/lifeline.py),
its errors come back as the same exception types (RolloutEngineError keeps its phase and the engine's
root error), and a child that dies mid-call raises EngineDeadError instead of hanging the loop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import traceback
from pathlib import Path
from typing import Iterable

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory tensor reductions with the pickler)
from omegaconf import OmegaConf

from grpo_lab.rollout.errors import EngineDeadError, RolloutEngineError
from grpo_lab.schema import as_dict

_SPAWN = mp.get_context("spawn")   # no fork: the parent holds torch and OpenMP thread pools
_POLL_S = 0.25                     # how often a waiting call checks that the child is still alive


def _portable(err: BaseException):
    """An exception the parent can unpickle: itself when it round-trips, else its type and text."""
    if isinstance(err, RolloutEngineError):
        return ("engine", type(err).__name__, str(err), err.phase, err.engine_error)
    try:
        pickle.loads(pickle.dumps(err))
        return ("plain", err)
    except Exception:
        return ("text", f"{type(err).__name__}: {err}\n{''.join(traceback.format_exception(err))}")


def _rebuild(payload) -> BaseException:
    kind = payload[0]
    if kind == "engine":
        from grpo_lab.rollout import errors

        _, name, message, phase, engine_error = payload
        cls = getattr(errors, name, RolloutEngineError)
        return cls(f"{message} (in the engine process)", phase=phase, engine_error=engine_error)
    if kind == "plain":
        return payload[1]
    return RuntimeError(f"the engine process raised {payload[1]}")


def _serve(conn, model_dir: str, rollout_cfg: dict, seed: int, device: str, num_threads: int, parent: int):
    """The child: build the engine, then answer (method, args, kwargs) requests until close or EOF."""
    from grpo_lab.rollout import lifeline, make_engine

    lifeline.set_parent_death_signal()
    if os.getppid() != parent:   # the trainer died before prctl ran
        os._exit(1)
    torch.set_num_threads(num_threads)   # the learner's budget (EngineProcess: >= 1)
    try:
        engine = make_engine(Path(model_dir), OmegaConf.create(rollout_cfg), seed=seed, device=device)
    except BaseException as err:   # noqa: BLE001  (handed to the parent, which raises it)
        conn.send(("error", _portable(err)))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:   # the parent is gone
            engine.close()
            return
        try:
            result = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as err:   # noqa: BLE001
            conn.send(("error", _portable(err)))
        if method == "close":
            return


class EngineProcess:
    """The rollout-engine protocol (generate, load_weights, close) served by an engine in a child process.

    Calls are serialised (one request on the pipe at a time); the train loop already never overlaps two
    engine calls (RolloutPipeline.wait_idle before every push and evaluation)."""

    def __init__(self, model_dir: Path, rollout_cfg, *, seed: int, device: str = "cpu", num_threads: int = 1):
        config = as_dict(rollout_cfg)
        # The engine's changed-only filter keys tensors by storage address and version counter. Tensors
        # that arrive through shared memory are new objects at version 0, and torch maps a storage it has
        # seen before at the same address: after the first push every tensor would look unchanged and
        # the engine would keep its old weights (the sampler's logprobs drift from the learner's and the
        # policy stops learning). Send everything.
        config["sync_changed_only"] = False
        self._conn, child = _SPAWN.Pipe()
        # Not a daemon: the engine starts processes of its own (vLLM's EngineCore), which daemons may not.
        self._proc = _SPAWN.Process(target=_serve, name="grpo_lab-engine", daemon=False,
                                    args=(child, str(model_dir), config, seed, device, num_threads, os.getpid()))
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._closed = False
        self._receive("start")

    def _died(self, phase: str, when: str = "during") -> EngineDeadError:
        self._closed = True
        self._proc.join(timeout=5)   # reap it, for its exit code
        return EngineDeadError(f"the engine process (pid {self._proc.pid}) exited with code {self._proc.exitcode} "
                               f"{when} {phase!r}", phase=phase)

    def _receive(self, phase: str):
        while not self._conn.poll(_POLL_S):
            if not self._proc.is_alive():
                raise self._died(phase)
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError) as err:   # it died with the pipe open
            raise self._died(phase) from err
        if status == "error":
            raise _rebuild(value)
        return value

    def _request(self, method: str, *args, **kwargs):
        if self._closed:
            raise EngineDeadError(f"rollout engine process, phase {method!r}: the engine was closed", phase=method)
        with self._lock:
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, ConnectionResetError) as err:
                raise self._died(method, "before") from err
            return self._receive(method)

    def generate(self, prompt_ids, **kwargs):
        return self._request("generate", prompt_ids, **kwargs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # detach(): a tensor that requires grad cannot be shared; the storage is the learner's own.
        self._request("load_weights", [(name, t.detach()) for name, t in named_tensors])

    def close(self) -> None:
        """Ask the child to close its engine, then reap it (killing it if it does not leave in 30 s)."""
        if self._conn.closed:
            return
        try:
            if not self._closed and self._proc.is_alive():
                self._request("close")
        finally:
            self._closed = True
            self._conn.close()
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
