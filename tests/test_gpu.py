"""The paths only a CUDA device exercises (marker `gpu`; skipped where torch sees no GPU, so CI and
`make test` skip them): the learner's update on the GPU against the same update on the CPU, bf16
autocast there, the `cuda_ipc` weight-sync transport across two processes, whole runs with the learner
and the HF engine on the GPU (the engine in a child process too, so CUDA tensors cross processes), and
FSDP2 under torchrun on the "cpu:gloo,cuda:nccl" group.

Run them with `make test-gpu` on a machine with a GPU and the project's venv, or on the lent device
machine with `scripts/device_check.sh` (README, "GPU checks"). Not covered (vLLM is not on the lent
machine and its CUDA wheel is too large to carry there): the vLLM CUDA engine, the `nccl` transport
(vLLM's PyNcclCommunicator), tensor parallelism on GPUs."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from fsdp_common import ADAM_SETTINGS, SGD_LR, SGD_SETTINGS, grouped_batch, make_learner, silent_batches, toy_batch
from helpers import TINY_RUN, assert_finite_metrics, max_param_change, read_metrics, run_train, start_model_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")]

# A GPU-vs-CPU difference from a device bug (a mask on the wrong device, rows misaligned, a missed
# sync) is of the order of the update itself; fp32 kernels of the two devices differ near 1e-6.
ATOL = 1e-4


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """TF32 would round fp32 products at ~1e-3 on Ampere and later: off, so fp32 means fp32 here."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpo_lab.models import MODEL_BUILDERS

    return MODEL_BUILDERS.call("tiny_llama", tmp_path_factory.mktemp("gpu") / "model", alphabet="0123456789+-=", seed=0)


def sgd_update(model_dir, batches, **settings):
    """(weights before, weights after, last update's metrics) of plain SGD on `batches`, on the CPU."""
    learner = make_learner(model_dir, **settings)
    learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
    before = {k: v.detach().cpu().clone() for k, v in learner.weights_for_sync()}
    for batch in batches:
        learner.score(batch)
        metrics = learner.update(batch)
    return before, {k: v.detach().cpu() for k, v in learner.weights_for_sync()}, metrics


def assert_close_weights(got: dict, want: dict, before: dict) -> None:
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=0, msg=k)
    assert max(float((want[k] - before[k]).abs().max()) for k in want) > 10 * ATOL   # the update did something


@pytest.mark.parametrize("case", ["kl_entropy_2_epochs", "shared_prompt_forward", "skip_rows_without_gradient"])
def test_learner_update_on_cuda_equals_the_cpu_update(model_dir, case):
    """The same SGD update (change = -lr × gradient) on the GPU and on the CPU, weights to 1e-4: KL to
    a reference and an entropy bonus over 2 epochs × 2 minibatches; the shared-prompt forward (KV cache
    on the autograd graph); rows without gradient left out."""
    settings, batches = {   # fresh batches for each learner: score and update write into a batch
        "kl_entropy_2_epochs": (SGD_SETTINGS, lambda: [toy_batch(n=9)]),
        "shared_prompt_forward": ({"shared_prompt_forward": True}, lambda: [grouped_batch(seed=3)]),
        "skip_rows_without_gradient": ({"skip_rows_without_gradient": True, **ADAM_SETTINGS}, silent_batches),
    }[case]
    before, on_cpu, cpu_metrics = sgd_update(model_dir, batches(), **settings)
    _, on_cuda, cuda_metrics = sgd_update(model_dir, batches(), device="cuda", **settings)
    assert_close_weights(on_cuda, on_cpu, before)
    assert cuda_metrics["actor/grad_norm"] == pytest.approx(cpu_metrics["actor/grad_norm"], rel=1e-4, abs=1e-6)


def test_adamw_and_bf16_autocast_on_cuda(model_dir):
    """AdamW on the GPU reports the CPU's loss and gradient norm; bf16 autocast over fp32 master weights
    keeps the weights fp32 and finite, and its loss stays within bf16 rounding of the fp32 loss."""
    results = {}
    for name, settings in {"cpu": {}, "cuda": {"device": "cuda"}, "bf16": {"device": "cuda", "dtype": "bf16"}}.items():
        learner = make_learner(model_dir, **ADAM_SETTINGS, **settings)
        batch = toy_batch(n=10)
        learner.score(batch)
        results[name] = (learner.update(batch), dict(learner.weights_for_sync()))
    (cpu, _), (cuda, _), (bf16, bf16_weights) = results["cpu"], results["cuda"], results["bf16"]
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert cuda[key] == pytest.approx(cpu[key], rel=1e-4, abs=1e-6), key
    assert bf16["actor/grad_norm"] == pytest.approx(cpu["actor/grad_norm"], rel=5e-2)
    assert all(t.dtype == torch.float32 and t.is_cuda and bool(torch.isfinite(t).all()) for t in bf16_weights.values())


def _open_buckets(requests, replies):
    """Child process: open each bucket payload through its CUDA IPC handle on this process's GPU and
    send back its tensors, copied to the host; None ends it."""
    import torch

    from grpo_lab.rollout.weight_sync_worker import TensorMeta, open_bucket, unpack_bucket

    device = torch.device("cuda", torch.cuda.current_device())
    while (payload := requests.get()) is not None:
        buf = open_bucket(payload, device=device)
        replies.put({name: t.cpu() for name, t in unpack_bucket(buf, [TensorMeta(*m) for m in payload["metas"]])})
        del buf
        torch.cuda.synchronize()


def test_cuda_ipc_push_opens_in_another_process():
    """`WeightSync(transport="cuda_ipc")`: every bucket of a push (fp32 and bf16 tensors, one reused GPU
    buffer, 3 buckets) arrives intact in another process that opens the sender's GPU memory through
    the IPC handle, as an engine worker on the learner's GPU does (its vLLM reload is not run here)."""
    from grpo_lab.rollout.weight_sync import WeightSync

    ctx = torch.multiprocessing.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_open_buckets, args=(requests, replies), daemon=True)
    child.start()
    received: dict[str, torch.Tensor] = {}

    def rpc(fn):   # stands in for collective_rpc: hands the payload to the other process, waits for it
        assert isinstance(fn, functools.partial)
        requests.put(fn.keywords["payload"])
        received.update(replies.get(timeout=120))
        return [None]

    g = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(256, 512, generator=g)) for i in range(3)]
    named.append(("model.norm.weight", torch.randn(256, generator=g).to(torch.bfloat16)))
    named = [(n, t.cuda()) for n, t in named]
    sync = WeightSync(rpc, transport="cuda_ipc", bucket_mb=0.6, changed_only=False)
    try:
        stats = sync.push(named)
    finally:
        requests.put(None)
        child.join(timeout=60)
    assert stats["buckets"] == 3
    assert received.keys() == dict(named).keys()
    for name, t in named:
        assert received[name].dtype == t.dtype and torch.equal(received[name], t.cpu()), name


@pytest.mark.parametrize("overrides", [
    [],
    ["learner.dtype=bf16"],
    ["learner.shared_prompt_forward=true", "learner.skip_rows_without_gradient=true"],
    # CUDA tensors to the engine's child process as IPC handles; the engine samples a step ahead.
    ["trainer.backend=engine_process", "trainer.max_staleness=1"],
], ids=["fp32", "bf16", "shared_prompts_skip_rows", "engine_process_stale1"])
def test_two_step_run_on_cuda(overrides, tmp_path, warm_cache):
    """`python -m grpo_lab.train rollout=hf learner.device=cuda` (learner and HF engine on the GPU) for
    2 steps: completed, finite metrics, the policy moved; on-policy fp32 runs sample what the learner
    scores (engine and learner logprobs agree)."""
    run_dir = tmp_path / "run"
    proc = run_train(["rollout=hf", "learner.device=cuda", *TINY_RUN, *overrides], run_dir, warm_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    lines = read_metrics(run_dir)
    assert_finite_metrics(lines)
    assert max_param_change(start_model_dir(warm_cache), run_dir / "checkpoints" / "final") > 0
    if not overrides:
        assert lines[1]["rollout/logprob_abs_diff_max"] < 1e-3


def test_fsdp2_over_nccl_runs_two_steps_and_checkpoints(tmp_path):
    """`torchrun -m grpo_lab.train learner.strategy=fsdp2 learner.device=cuda` on one rank per GPU (at
    most 2): FSDP2's collectives over NCCL, object broadcasts over gloo, the full state dict gathered for
    the engine, a DCP checkpoint written by every rank."""
    from grpo_lab.learner import distributed
    from test_fsdp import torchrun

    run_dir = tmp_path / "run"
    nproc = min(2, torch.cuda.device_count())
    proc = torchrun(["-m", "grpo_lab.train", "learner.strategy=fsdp2", "learner.device=cuda", "rollout=hf",
                     f"learner.num_devices={nproc}", "logger=none", "warmup.max_steps=0", "trainer.total_steps=2",
                     "trainer.prompts_per_step=4", "rollout.group_size=4", "trainer.eval_every=0",
                     "task.train_size=200", "task.dev_size=20", "task.test_size=20", "trainer.checkpoint_every=2",
                     f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}"], timeout=600, nproc=nproc)
    lines = read_metrics(run_dir)
    assert [line["step"] for line in lines] == [0, 1, 2, 2], proc.stdout[-2000:]
    assert_finite_metrics(lines)
    assert (run_dir / "checkpoints" / "step_2" / distributed.DCP_DIR / ".metadata").is_file()
