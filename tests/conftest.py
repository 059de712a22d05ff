"""Shared test settings: never touch the network, keep wandb offline and quiet."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


import pytest


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """A cache dir holding the tiny model and its brief warm-up, built once per session: a zero-step run of
    the CLI builds both and stops. Under pytest-xdist (make test runs two workers) the first worker to ask
    builds it in the session's shared temporary root while the others wait on a file lock, then all use it."""
    import shutil

    from filelock import FileLock
    from helpers import TINY_RUN, run_train

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # each worker's base is a folder of the session's root
    cache, built = root / "warm_cache", root / "warm_cache.built"
    with FileLock(str(root / "warm_cache.lock")):
        if not built.is_file():
            shutil.rmtree(cache, ignore_errors=True)   # what a failed build left
            proc = run_train([*TINY_RUN, "rollout=hf", "trainer.total_steps=0", "trainer.save_checkpoint=false"],
                             cache / "_warmup_run", cache)
            assert proc.returncode == 0, proc.stderr[-3000:]
            built.touch()
    return cache


@pytest.fixture
def one_thread():
    """Two shared cores: torch's default thread pool only oversubscribes them for a 0.5M model."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
