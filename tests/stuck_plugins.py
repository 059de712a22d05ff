"""Reward functions that get a run stuck where Python's SIGTERM handler cannot run: imported by path
from config ("stuck_plugins.in_c_call"). Each touches the file $STUCK_MARKER first, so a test knows the
run is mid-step. Used by tests/test_run_safety.py."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path


def _block_in_c() -> None:
    # system() waits for its child in C and retries when a signal interrupts the wait, so the
    # interpreter gets no chance to run a Python signal handler until the child ends (longer than any
    # test waits; bounded, so a child the run leaves behind does not linger).
    ctypes.CDLL(None).system(b"sleep 90")


def in_c_call(completions: list[str], **_) -> list[float]:
    Path(os.environ["STUCK_MARKER"]).touch()
    _block_in_c()
    return [0.0] * len(completions)


def in_thread_join(completions: list[str], **_) -> list[float]:
    """The main thread joins a thread stuck in C: the run must still end, recorded as failed, though
    the thread it waits for never finishes."""
    Path(os.environ["STUCK_MARKER"]).touch()
    worker = threading.Thread(target=_block_in_c)
    worker.start()
    worker.join()
    return [0.0] * len(completions)
