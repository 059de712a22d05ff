"""FSDP2 learner (learner.strategy=fsdp2) over 2 CPU processes (gloo, torchrun) against one process:
the same update to 1e-5, a DCP checkpoint that loads into a single-process learner, and a 2-step run
of `python -m grpo_lab.train` under torchrun."""

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_lab.learner import distributed
from grpo_lab.models import MODEL_BUILDERS
from fsdp_common import ADAM_SETTINGS, SGD_LR, SGD_SETTINGS, grouped_batch, make_learner, silent_batches, toy_batch
from helpers import REPO, assert_finite_metrics, read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], timeout: int, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node <nproc> ...`, one thread per rank, this checkout first on the path and
    the caller's PYTHONPATH after it (where packages may live outside site-packages, as on a machine that
    installs carried wheels into a folder of their own)."""
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model_dir = MODEL_BUILDERS.call("tiny_llama", root / "model", alphabet="0123456789+-=", seed=0)
    torchrun([str(REPO / "tests" / "fsdp_child.py"), str(model_dir), str(root)], timeout=300)
    return Path(model_dir), root, torch.load(root / "fsdp.pt", weights_only=False)


def single_update(model_dir, settings, batch, sgd=False):
    learner = make_learner(model_dir, **settings)
    if sgd:
        learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
    before = {k: v.clone() for k, v in learner.weights_for_sync()}
    learner.score(batch)
    metrics = learner.update(batch)
    return learner, before, dict(learner.weights_for_sync()), metrics


def assert_same_weights(fsdp: dict, single: dict, before: dict) -> None:
    assert fsdp.keys() == single.keys() and fsdp
    for k in single:
        torch.testing.assert_close(fsdp[k], single[k], atol=1e-5, rtol=0, msg=k)
    assert max(float((single[k] - before[k]).abs().max()) for k in single) > 1e-4   # the update did something


def test_fsdp_sgd_update_equals_single_process(fsdp_result):
    """Plain SGD: the change is -lr × the summed gradient (an average over ranks would halve it);
    2 epochs × 2 minibatches, uneven shards and padded micro-batches, KL to a sharded reference."""
    model_dir, _, res = fsdp_result
    assert res["world_size"] == 2
    _, before, after, metrics = single_update(model_dir, SGD_SETTINGS, toy_batch(n=9), sgd=True)
    assert_same_weights(res["sgd"], after, before)
    assert res["sgd_metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    # (Per-micro-batch metric means such as actor/kl depend on the micro-batch split, here as in one process.)


def test_fsdp_skipping_rows_without_gradient_equals_the_full_single_process_update(fsdp_result):
    """Both ranks leave the same silent rows out (and both run only the zero-weight pass when every
    row is silent, so their collectives still match); the weights equal one process training on all rows."""
    model_dir, _, res = fsdp_result
    learner = make_learner(model_dir, **ADAM_SETTINGS)
    learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
    before = {k: v.clone() for k, v in learner.weights_for_sync()}
    for batch in silent_batches():
        learner.score(batch)
        learner.update(batch)
    assert_same_weights(res["skipped"], dict(learner.weights_for_sync()), before)


def test_fsdp_with_shared_prompt_forwards_equals_the_unshared_single_process_update(fsdp_result):
    """Each rank runs the prompt and completion forwards of the sharded model before one backward;
    the SGD change equals one process's that forwards every row whole."""
    model_dir, _, res = fsdp_result
    _, before, after, _ = single_update(model_dir, SGD_SETTINGS, grouped_batch(seed=3), sgd=True)
    assert_same_weights(res["shared"], after, before)


def test_fsdp_adamw_update_equals_single_process(fsdp_result):
    model_dir, _, res = fsdp_result
    _, before, after, metrics = single_update(model_dir, ADAM_SETTINGS, toy_batch(n=10))
    assert_same_weights(res["adam"], after, before)
    assert res["adam_metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)


def test_dcp_checkpoint_of_2_ranks_loads_into_one_process(fsdp_result):
    """Resume on another world size: the 2-rank DCP checkpoint (model + AdamW shards) loads into a
    single-process learner, which then holds the same weights and the same optimizer moments as a
    single-process learner that made the update itself, and its next update matches too."""
    model_dir, root, res = fsdp_result
    ckpt = root / "ckpt"
    assert (ckpt / distributed.DCP_DIR / ".metadata").is_file() and (ckpt / "policy" / "model.safetensors").is_file()
    assert "optimizer" not in res["state"]
    resumed = make_learner(model_dir, **ADAM_SETTINGS)
    resumed.load_state(ckpt / "policy", res["state"])
    reference, before, after, _ = single_update(model_dir, ADAM_SETTINGS, toy_batch(n=10))
    assert_same_weights(dict(resumed.weights_for_sync()), after, before)
    ref_state, got_state = reference.optimizer.state_dict(), resumed.optimizer.state_dict()
    for i, s in ref_state["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got_state["state"][i][k], s[k], atol=1e-6, rtol=1e-5)
    assert resumed.step == reference.step == 1
    for learner in (resumed, reference):
        batch = toy_batch(seed=1, n=10)
        learner.score(batch)
        learner.update(batch)
    assert_same_weights(dict(resumed.weights_for_sync()), dict(reference.weights_for_sync()), before)


@pytest.mark.slow
def test_fsdp_train_run_two_steps(tmp_path):
    """`torchrun --nproc_per_node 2 -m grpo_lab.train learner.strategy=fsdp2` for 2 steps: rank 0
    writes the run (finite metrics, a checkpoint with its DCP shards); nothing else writes. About 50 s
    here (not marked slow: under a minute)."""
    run_dir = tmp_path / "run"
    proc = torchrun(["-m", "grpo_lab.train", "learner.strategy=fsdp2", "learner.num_devices=2", "rollout=hf",
                     "logger=none", "warmup.max_steps=0", "trainer.total_steps=2", "trainer.prompts_per_step=4",
                     "rollout.group_size=4", "trainer.eval_every=0", "task.train_size=200", "task.dev_size=20",
                     "task.test_size=20", "trainer.checkpoint_every=2", f"hydra.run.dir={run_dir}",
                     f"cache_dir={tmp_path / 'cache'}"], timeout=600)
    lines = read_metrics(run_dir)
    assert [line["step"] for line in lines] == [0, 1, 2, 2], proc.stdout[-2000:]
    assert_finite_metrics(lines)
    assert (run_dir / "checkpoints" / "step_2" / distributed.DCP_DIR / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "run"]
