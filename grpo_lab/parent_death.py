"""Child processes that die with the thread that started them (Linux ``prctl(PR_SET_PDEATHSIG)``,
man 2 prctl). Neutral ground, importing nothing of the lab, so a light child (the reward worker,
grpo_lab/rewards/isolation.py) can use it without importing torch as the rollout engines do."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits. Linux only."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
