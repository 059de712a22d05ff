"""kill -9 of the trainer must not orphan the vLLM processes.

Left alone, EngineCore, its worker and a multiprocessing resource tracker stay alive indefinitely,
holding gigabytes of memory. The engine processes therefore carry a parent-death signal
(grpo_lab/rollout/lifeline.py), and the resource tracker exits once every holder of its pipe is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.vllm


def test_sigkill_of_the_trainer_leaves_no_engine_processes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "robust_engine_child.py"), str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"engine script exited with {proc.returncode} before it was ready")
        assert line.startswith("READY"), "engine did not start within 240 s"
        engine_pids = [int(x) for x in line.split()[2:]]
        assert engine_pids, line
        # Everything the script started: EngineCore, its worker, the resource tracker.
        children = psutil.Process(proc.pid).children(recursive=True)
        assert {p.pid for p in children} >= set(engine_pids)
        assert len(children) >= 3, [p.cmdline() for p in children]

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=30)  # bounded: polls until gone or 30 s
        assert not alive, f"orphaned after kill -9 of their parent: {[(p.pid, p.name()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
