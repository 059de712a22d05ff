"""Child script of tests/test_robust_orphans.py: start a vLLM engine on a tiny model, report the
pids, then wait to be killed. Not a test module (no test_ prefix)."""

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    from grpo_lab.models import MODEL_BUILDERS
    from grpo_lab.rollout import make_engine, rollout_section
    from helpers import VLLM_KV_CACHE_BYTES

    model_dir = MODEL_BUILDERS.get("tiny_llama")(Path(sys.argv[1]) / "model", alphabet="0123456789+-=", seed=0)
    engine = make_engine(model_dir, rollout_section(engine="vllm", gpu_memory_utilization=0.1, max_model_len=64,
                                                    enforce_eager=True, dtype="float32",
                                                    kv_cache_bytes=VLLM_KV_CACHE_BYTES),
                         seed=0)
    print("READY", os.getpid(), *engine.engine_pids(), flush=True)
    time.sleep(600)
