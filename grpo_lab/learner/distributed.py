"""The learner over several processes: FSDP2 (`torch.distributed.fsdp.fully_shard`) under `torchrun`
(learner.strategy=fsdp2).

Who does what:

* Rank 0 runs the whole loop (engine, sampling, rewards, logging, files). Its learner is wrapped in a
  `LearnerGroup` (grpo_lab/backends.py): every method call (score, update, weights_for_sync, save,
  ...) is first broadcast (`broadcast_object_list`, the batch included) to the other ranks, then run
  on rank 0 too, so every rank issues the same collectives in the same order. Ranks > 0 never enter
  Hydra or the loop: they receive the resolved config from rank 0, build the same learner and serve
  those calls (`backends.follow`). This module holds the torch.distributed helpers below the learner.
* Weights: the policy (and the frozen reference, when there is one) is sharded per decoder layer
  (the model's `_no_split_modules`, e.g. LlamaDecoderLayer) plus the root, so each rank holds 1/W of
  weights, gradients and AdamW state.
* Data: each minibatch's normalisers (num_tokens, num_seqs, max_len, the objective's own) are
  computed on the FULL minibatch (Learner.update does this before anything is split); rank r then
  computes the loss on rows `tensor_split(W)[r]` only. The loss is a sum over rows divided by global
  normalisers, so Σ_r ∇loss_r is exactly the single-process gradient.
* Reduction: FSDP2 divides the reduce-scattered gradient by W by default (it assumes each rank's
  loss is a mean). We set `set_gradient_divide_factor(1.0)`, so the reduction is a plain SUM: the
  loss values stay what a single process computes (metrics, NaN checks and bf16 rounding unchanged)
  and no ×W rescaling round-trips through the gradient.
* Equal collectives: FSDP2 all-gathers in every forward and reduce-scatters in every backward, so
  every rank must run the same number of micro-batches. A rank with fewer (uneven shards, token
  budgets) runs zero-weighted passes on one row (loss × 0) until all ranks match.
* Scoring (no-grad π_old / π_ref forwards) runs on the whole batch on every rank: identical results,
  no gather needed; it costs W× the scoring compute (a follow-up could shard and all-gather it).
* Engine weights: `get_model_state_dict(full_state_dict=True, cpu_offload=True)`: the full dict
  on rank 0, nothing on the others. Checkpoints: `torch.distributed.checkpoint` (DCP) of the sharded
  model and optimizer, which loads on any world size, a single process included (no process group).

CPU uses gloo; on a GPU machine the group is "cpu:gloo,cuda:nccl" (CUDA tensors over NCCL, host tensors
over gloo), one GPU per local rank (`LOCAL_RANK`). Only gloo on CPU has run in this repository; the NCCL
path is written to the torch documentation and checked by tests/test_gpu.py where a GPU is present.
Not supported with fsdp2 (validated): LoRA adapters and the PPO critic.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

# Checkpoint sub-directory (beside policy/) holding the DCP shards of model + optimizer.
DCP_DIR = "learner_dcp"
# Rank 0 builds the model and may run the supervised warm-up before the first collective: wait long.
INIT_TIMEOUT = datetime.timedelta(hours=2)


def launched_distributed() -> bool:
    """Whether this process was started by torchrun (or any launcher setting RANK/WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_follower() -> bool:
    """A rank > 0 of a torchrun launch: it serves rank 0's learner calls and runs nothing else."""
    return launched_distributed() and int(os.environ["RANK"]) > 0


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def init() -> None:
    """Join the process group torchrun describes (idempotent): NCCL on CUDA, gloo on CPU."""
    if active():
        return
    if not launched_distributed():
        raise RuntimeError("learner.strategy=fsdp2 needs a torchrun launch (RANK/WORLD_SIZE unset): run "
                           "`make run-fsdp NPROC=2 ARGS=...` or `torchrun --nproc_per_node 2 -m grpo_lab.train "
                           "learner.strategy=fsdp2 ...`, or set learner.strategy=single")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        # One group, a backend per device type: CUDA tensors (FSDP2's all-gathers and reduce-scatters
        # of a GPU learner) over NCCL, CPU tensors over gloo. The ranks call init() before they know
        # the config, so a CPU learner on a GPU machine must work too, and object collectives (the
        # broadcast config and batches, all on the host) then stay on the host instead of a round trip
        # through the GPU (torch's _get_object_coll_device picks "cpu" when it is among the pairs).
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=INIT_TIMEOUT)


def end_process() -> NoReturn:
    """Exit 0 from a torchrun rank that finished its work, skipping interpreter finalization.

    Why: gloo runs every collective on its own worker threads, and a worker drops its reference to a
    finished collective (and so to the tensors it moved) some time after `wait()` has returned in the
    main thread; dropping a tensor that Python has seen takes the GIL. If the main thread has begun
    finalizing by then, the worker's `take_gil` calls `pthread_exit`, whose forced unwind through a
    noexcept destructor calls std::terminate: SIGABRT ("terminate called without an active exception")
    after a run that completed, so torchrun reports it failed (about 1 in 10 two-rank CPU runs here; a
    core dump showed the worker in ~AsyncBroadcastWork -> gil_scoped_acquire -> PyThread_exit_thread;
    pytorch/pytorch PR 179291 describes the same race). gloo has no way to wait for its workers to let
    go, so the process does what finalization would (atexit handlers: engines, judges, wandb; logging
    and stdio flushed) and exits without it."""
    if active():
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------- sharding
def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embedding, final norm, lm_head; a tied lm_head
    stays one parameter). Gradients are SUMMED over ranks (divide factor 1, see the module doc)."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         "fsdp2 shards per decoder layer")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for m in [*layers, model]:
        m.set_gradient_divide_factor(1.0)
        # A custom factor becomes NCCL's PREMUL_SUM, which gloo lacks: plain SUM (×1 needs no scaling).
        m.set_force_sum_reduction_for_comms(True)
    return model


def _comm_device() -> torch.device:
    """Where the small tensors of our own collectives live: the host whenever gloo is in the group
    (init's "cpu:gloo,cuda:nccl"); a CUDA tensor only in a NCCL-only group."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_rows(n: int) -> torch.Tensor:
    """This rank's rows of an n-row minibatch: contiguous, sizes differ by at most one."""
    return torch.arange(n).tensor_split(world_size())[rank()]


def equalize(micros: list) -> list[tuple[object, bool]]:
    """(micro-batch, real) pairs, padded with zero-weight repeats of one row so that every rank runs
    as many forward/backward passes as the busiest one (FSDP2's collectives must match)."""
    count = torch.tensor([len(micros)], device=_comm_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [(m, True) for m in micros] + [(None, False)] * (int(count) - len(micros))


def merge_metric_means(mean) -> None:
    """Make a MetricMean hold the sums and weights of every rank (metrics of the whole minibatch)."""
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, (dict(mean.sums), dict(mean.weights)))
    mean.sums.clear()
    mean.weights.clear()
    for sums, weights in gathered:
        for k in sums:
            mean.sums[k] += sums[k]
            mean.weights[k] += weights[k]


# ---------------------------------------------------------------------------------------- state
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, on rank 0 only (others get {}); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_dcp(model, optimizer, path: str | Path) -> None:
    """Model + optimizer in DCP's sharded format (each rank writes its shards; reloads on any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_dcp(model, optimizer, path: str | Path) -> None:
    """Load a DCP checkpoint into this model + optimizer, whatever world size wrote it (1 process:
    no process group needed; DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
