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
    """A cache dir holding the tiny model and its brief warm-up, built once per session:
    a zero-step run of the CLI builds both and stops."""
    from helpers import TINY_RUN, run_train

    cache = tmp_path_factory.mktemp("warm_cache")
    proc = run_train([*TINY_RUN, "rollout=hf", "trainer.total_steps=0", "trainer.save_checkpoint=false"],
                     cache / "_warmup_run", cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cache


@pytest.fixture
def one_thread():
    """Two shared cores: torch's default thread pool only oversubscribes them for a 0.5M model."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
