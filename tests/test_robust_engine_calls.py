"""The vLLM engine's call guard without starting vLLM: a call past its timeout
raises an error naming the phase and the config key; a dead engine process makes the call fail
fast, carrying the engine's logged root error; after either, every call fails fast."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from grpo_lab.rollout import EngineDeadError, EngineTimeoutError
from grpo_lab.rollout.lifeline import root_error_line
from grpo_lab.rollout.vllm_engine import VLLMEngine, chunked_prefill_settings


def fake_engine(tmp_path, processes):
    eng = object.__new__(VLLMEngine)  # the guard only needs these attributes
    eng.processes, eng._broken, eng._closed = processes, None, False
    eng.error_file = str(tmp_path / "engine.log")
    return eng


def test_a_call_past_its_timeout_names_phase_and_key(tmp_path):
    eng = fake_engine(tmp_path, [])
    t0 = time.monotonic()
    with pytest.raises(EngineTimeoutError, match=r"phase 'weight sync': no result within 0.5 s \(rollout.sync_timeout_s=0.5\)"):
        eng._call("weight sync", 0.5, "rollout.sync_timeout_s", time.sleep, 30)
    assert time.monotonic() - t0 < 3
    with pytest.raises(EngineDeadError, match="failed earlier"):
        eng._call("generate", None, "rollout.generate_timeout_s", lambda: 1)


def test_a_dead_engine_process_fails_the_call_fast_with_its_root_error(tmp_path):
    child = psutil.Popen(["sleep", "60"])
    eng = fake_engine(tmp_path, [child])
    (tmp_path / "engine.log").write_text(
        "[EngineCore pid=1] EngineCore encountered a fatal error.\nTraceback (most recent call last):\n"
        "  ...\nRuntimeError: Worker failed with error 'CPU Generator does not use offset'\n")
    assert eng._call("generate", None, "rollout.generate_timeout_s", lambda: 7) == 7
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        def blocked():
            time.sleep(0.3)
            child.kill()  # the engine dies while the call is blocked (as a Ctrl-C to the group does)
            time.sleep(60)
        eng._call("weight sync", None, "rollout.sync_timeout_s", blocked)
    assert time.monotonic() - t0 < 3
    assert "phase 'weight sync'" in str(err.value) and "CPU Generator does not use offset" in str(err.value)
    assert "CPU Generator does not use offset" in err.value.engine_error
    child.wait()


def test_root_error_line_and_scheduler_settings():
    assert root_error_line("x\nValueError: bad\nmore text\n") == "ValueError: bad"
    assert chunked_prefill_settings(256, is_cpu=True) == {"enable_chunked_prefill": False,
                                                          "max_num_batched_tokens": 4096}
    assert chunked_prefill_settings(8192, is_cpu=True)["max_num_batched_tokens"] == 8192
    assert chunked_prefill_settings(256, is_cpu=False) == {}  # CUDA keeps vLLM's defaults
