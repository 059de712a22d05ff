"""Weight sync: the learner's new weights into the running vLLM engine, as a protocol with transports.

The loop calls one ``engine.load_weights(named_tensors)``; the transport is config
(``rollout.sync_transport``):

* ``cpu`` — the CPU build. The changed tensors are flattened into a few large byte buffers
  ("buckets", ``rollout.sync_bucket_mb`` each) in a shared-memory file that the engine's worker
  maps once (``torch.from_file(..., shared=True)``); ``collective_rpc`` then carries only names,
  dtypes, shapes and offsets, and the worker hands views of the mapping to vLLM's layerwise reload.
  Where no shared memory exists (no ``/dev/shm``) the bucket itself travels through the rpc: one
  flat buffer per bucket, pickled as a single contiguous block instead of hundreds of tensors.
* ``cuda_ipc`` — CUDA, learner and engine on the same GPU: the bucket lives on the GPU and the
  worker opens it through a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor`` /
  ``rebuild_cuda_tensor``), as vLLM's ``examples/offline_inference/rlhf_colocate.py`` does.
* ``nccl`` — CUDA, engine on its own GPUs: a NCCL group between learner rank 0 and every engine
  worker (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, as in
  ``examples/offline_inference/rlhf.py``); the learner broadcasts each bucket, workers receive
  into a GPU buffer and reload from it.
* ``pickle`` — the previous protocol, kept as the benchmark's baseline: every tensor copied,
  pickled and sent through ``collective_rpc`` in one call to the worker's ``reload_weights``.
* ``auto`` — ``cpu`` unless learner and engine are both on CUDA; then ``cuda_ipc`` when every
  engine worker is on the learner's GPU, ``nccl`` when none is, and ``cpu`` (host staging) for a
  tensor-parallel engine that shares only some of its GPUs with the learner, where neither CUDA
  path can work (:func:`choose_transport`).

Only what changed travels (``rollout.sync_changed_only``): a tensor is resent when its storage
(the same live storage object, ``data_ptr``), shape, dtype or autograd version counter (``_version``,
bumped by every in-place op such as the optimizer's ``add_``) differs from the last push. Caveat: writes through
``param.data`` do not bump the counter; code that does that must turn this off. vLLM reloads a
*fused* layer (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up, with biases) only as a whole —
a partly loaded one is processed with uninitialised slices (``reload/layerwise.py``: "Delayed
processing") — so a tensor is resent with every other tensor of its vLLM layer
(:func:`layer_key`), and a bucket never splits a layer (its views must stay valid until the layer
is processed, which happens as soon as its last tensor arrives).

The receiving side, which runs inside the vLLM worker processes (opening a bucket, the layerwise
reload around ``model.load_weights``), is :mod:`grpo_lab.rollout.weight_sync_worker`; this module
ships its functions to the workers by reference.

The ``cuda_ipc`` transport is exercised across two processes on a GPU (tests/test_gpu.py); the
``nccl`` one needs vLLM's CUDA build and runs in no test. Transport selection, bucketing, the
unbucketing round trip and changed-tensor detection are unit-tested without CUDA
(tests/test_speed_weight_sync.py); the ``cpu`` and ``pickle`` transports run against the real CPU
engine (tests/test_vllm_sync.py, tests/test_speed_weight_sync.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from grpo_lab.rollout.weight_sync_worker import (DEFAULT_PACKED, TensorMeta, worker_finish, worker_load,
                                                 worker_nccl_init, worker_reload_pickled)

TRANSPORTS = ("auto", "cpu", "cuda_ipc", "nccl", "pickle")
# Byte alignment of every tensor inside a bucket: a multiple of every dtype's element size, so each
# slice can be viewed as its dtype, and of a cache line.
ALIGN = 64


# --------------------------------------------------------------------------------- selection
def choose_transport(requested: str, *, engine_on_cuda: bool, learner_device: str,
                     learner_gpu_uuid: str | None = None, worker_gpu_uuids: Iterable[str] = ()) -> str:
    """The transport to use (module docstring); an impossible explicit choice raises with the fix.

    engine_on_cuda: the engine is the CUDA build (its workers hold weights on GPUs).
    learner_device: "cpu" or "cuda" (the learner's weights' device type).
    learner_gpu_uuid / worker_gpu_uuids: physical GPU ids (``torch.cuda.get_device_properties(i).uuid``),
    which see through differing CUDA_VISIBLE_DEVICES of the two processes.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"rollout.sync_transport={requested!r} is not one of {', '.join(TRANSPORTS)}")
    workers = {str(u) for u in worker_gpu_uuids}
    learner = str(learner_gpu_uuid) if learner_gpu_uuid is not None else None
    # CUDA IPC opens a handle on the GPU that holds the memory, so every worker must be on the
    # learner's GPU (vLLM's rlhf_colocate.py: one learner rank per engine GPU, each handing its own
    # GPU's handle). NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    # detected"), so the learner's GPU must be none of the workers'. A tensor-parallel engine that
    # shares only some of its GPUs with the learner gets neither: the host path works everywhere.
    all_on_learner_gpu = learner is not None and workers == {learner}
    shares_learner_gpu = learner is not None and learner in workers
    both_cuda = engine_on_cuda and learner_device == "cuda"
    if requested == "auto":
        if not both_cuda:
            return "cpu"
        if all_on_learner_gpu:
            return "cuda_ipc"
        return "cpu" if shares_learner_gpu else "nccl"
    if requested in ("cuda_ipc", "nccl") and not both_cuda:
        raise ValueError(f"rollout.sync_transport={requested} needs the learner and the vLLM engine on CUDA "
                         f"(learner on {learner_device}, engine on {'cuda' if engine_on_cuda else 'cpu'}); "
                         "set rollout.sync_transport=auto or cpu")
    if requested == "cuda_ipc" and not all_on_learner_gpu:
        raise ValueError("rollout.sync_transport=cuda_ipc needs every engine GPU to be the learner's GPU (a CUDA "
                         f"IPC handle opens on the GPU that holds the memory; the engine's workers are on "
                         f"{len(workers)} GPU(s)); set rollout.sync_transport=nccl (engine on GPUs of its own), "
                         "cpu, or auto")
    if requested == "nccl" and shares_learner_gpu:
        raise ValueError("rollout.sync_transport=nccl needs the engine on GPUs other than the learner's (NCCL "
                         "refuses two ranks on one GPU); set rollout.sync_transport=cuda_ipc (engine on the "
                         "learner's GPU only), cpu, or auto")
    return requested


# --------------------------------------------------------------------------------- what changed
def layer_key(name: str, packed: dict[str, list[str]] | None = None) -> str:
    """The vLLM layer an HF tensor name loads into: "model.layers.3.self_attn.k_proj.bias" ->
    "model.layers.3.self_attn.qkv_proj" (packed mapping), "model.norm.weight" -> "model.norm"."""
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in (packed if packed is not None else DEFAULT_PACKED).items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)


class ChangeTracker:
    """Which of the named tensors changed since the last push (module docstring), whole vLLM layers.

    Cheap: no tensor data is read, only storage identity, pointer, version counter, shape, dtype and
    device. A tensor counts as unchanged only while the very storage it was pushed from is still alive
    (a weak reference to it, so the tracker holds no memory): tensors made afresh for each push (LoRA's
    merged W + BA, FSDP2's gathered full state dict, copies out of Ray's object store) are freed after
    the push, and the allocator hands their addresses, at version 0, to the next push's tensors of the
    same sizes, which pointer and version alone would take for the old, unchanged ones (this happens in
    practice: such tensors routinely land at their predecessors' addresses).
    """

    def __init__(self, packed: dict[str, list[str]] | None = None):
        self.packed = packed
        self._seen: dict[str, tuple[tuple, weakref.ref]] = {}

    def _unchanged(self, name: str, t: torch.Tensor) -> bool:
        seen = self._seen.get(name)
        if seen is None:
            return False
        signature, storage = seen
        return storage() is t.untyped_storage() and signature == _signature(t)

    def changed(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        dirty = {layer_key(n, self.packed) for n, t in named if not self._unchanged(n, t)}
        return [(n, t) for n, t in named if layer_key(n, self.packed) in dirty]

    def commit(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Record what the engine now holds (called after a successful push only)."""
        for n, t in named:
            self._seen[n] = (_signature(t), weakref.ref(t.untyped_storage()))

    def reset(self) -> None:
        self._seen.clear()


# --------------------------------------------------------------------------------- buckets
@dataclass
class Bucket:
    metas: list[TensorMeta] = field(default_factory=list)
    nbytes: int = 0


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int,
                 packed: dict[str, list[str]] | None = None) -> list[Bucket]:
    """Split tensors into buckets of at most `bucket_bytes` (a single layer larger than that gets a
    bucket of its own), in the given order, never splitting one vLLM layer across two buckets."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    index: dict[str, int] = {}
    for n, t in named:
        key = layer_key(n, packed)
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        groups[index[key]].append((n, t))
    buckets: list[Bucket] = []
    cur = Bucket()
    for group in groups:
        size = sum(_aligned(t.numel() * t.element_size()) for _, t in group)
        if cur.metas and cur.nbytes + size > bucket_bytes:
            buckets.append(cur)
            cur = Bucket()
        for n, t in group:
            nb = t.numel() * t.element_size()
            cur.metas.append(TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), cur.nbytes, nb))
            cur.nbytes += _aligned(nb)
    if cur.metas:
        buckets.append(cur)
    return buckets


@torch.no_grad()
def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
    """Copy the bucket's tensors into the flat uint8 buffer `buf` (any device; cross-device copies ok)."""
    for m in bucket.metas:
        src = tensors[m.name].detach()
        dst = buf[m.offset:m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)
        dst.copy_(src)


# --------------------------------------------------------------------------------- the sender
# (fn) -> one result per worker. Arguments travel bound in a functools.partial, which vLLM pickles
# whole (VLLM_ALLOW_INSECURE_SERIALIZATION): its msgpack path would hand untyped tensors and tuples
# to the worker as plain lists. Only metadata and handles are pickled, except in `pickle` (the old
# protocol) and the no-/dev/shm fallback (one flat buffer per bucket).
RPC = Callable[..., list]


class WeightSync:
    """Sender side of the protocol, one per engine: ``push(named_tensors)``.

    rpc: calls a module-level function on every engine worker (``LLM.collective_rpc`` with a
    timeout bound to it). worker_infos: :func:`grpo_lab.rollout.weight_sync_worker.worker_info` of
    each worker.
    """

    def __init__(self, rpc: RPC, *, transport: str, bucket_mb: float = 256, changed_only: bool = True,
                 worker_infos: list[dict] | None = None, learner_device: str = "cpu"):
        infos = worker_infos or [{}]
        self.rpc, self.transport = rpc, transport
        self.packed = infos[0].get("packed") or DEFAULT_PACKED
        self.bucket_bytes = max(int(bucket_mb * 2**20), ALIGN)
        self.tracker = ChangeTracker(self.packed) if changed_only else None
        self.learner_device = learner_device
        self.num_workers = len(infos)
        self._shm_path: str | None = None
        self._shm_buf: torch.Tensor | None = None
        self._shm_bytes = 0
        self._unlink_pending = False
        self._gpu_buf: torch.Tensor | None = None
        self._nccl = None
        # The learner's GPU, read now: CUDA's current device is per host thread, and pushes run in the
        # engine's call-timeout thread (vllm_engine._call), where it would read device 0.
        self.gpu = torch.device("cuda", torch.cuda.current_device()) if transport in ("cuda_ipc", "nccl") else None
        self.last: dict = {}

    # ------------------------------------------------------------------ public
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Send what changed; returns {"tensors", "bytes", "buckets"} of this push (also in `.last`)."""
        named = list(named_tensors)
        send = self.tracker.changed(named) if self.tracker is not None else named
        if self.transport == "pickle":
            weights = [(n, t.detach().to("cpu", copy=True)) for n, t in send]
            if weights:
                self.rpc(functools.partial(worker_reload_pickled, weights=weights))
            self.last = {"tensors": len(send), "bytes": sum(t.numel() * t.element_size() for _, t in send),
                         "buckets": 1 if send else 0}
        else:
            with torch.cuda.device(self.gpu) if self.gpu is not None else contextlib.nullcontext():
                self.last = self._push_buckets(send)
        if self.tracker is not None:
            self.tracker.commit(named)
        return self.last

    def close(self) -> None:
        self._drop_shm()
        self._gpu_buf = None
        self._nccl = None

    # ------------------------------------------------------------------ bucketed transports
    def _push_buckets(self, send: list[tuple[str, torch.Tensor]]) -> dict:
        # pack_s: flattening into buckets (sender); load_s: the workers' rpcs (reload, incl. the tied
        # lm_head re-pack at the end).
        stats = {"tensors": len(send), "bytes": 0, "buckets": 0, "pack_s": 0.0, "load_s": 0.0}
        if not send:
            return stats
        buckets = plan_buckets(send, self.bucket_bytes, self.packed)
        tensors = dict(send)
        tied = any(n.endswith("embed_tokens.weight") for n, _ in send)
        # The reload opens with the first bucket's rpc and closes with the last one's, so a push that
        # fits one bucket is one rpc round trip (each costs milliseconds through two process hops).
        done = 0
        try:
            for i, b in enumerate(buckets):
                flags = {"begin": i == 0, "finish": i == len(buckets) - 1, "tied_changed": tied}
                t0 = time.perf_counter()
                if self.transport == "nccl":
                    self._nccl_bucket(b, tensors, flags)
                else:
                    payload = {**self._send_bucket(b, tensors), **flags}
                    t1 = time.perf_counter()
                    stats["pack_s"] += t1 - t0
                    t0 = t1
                    self.rpc(functools.partial(worker_load, payload=payload))
                stats["load_s"] += time.perf_counter() - t0
                stats["bytes"] += b.nbytes
                stats["buckets"] += 1
                done = i + 1
        finally:
            if 0 < len(buckets) and done < len(buckets):
                # A failed push must still close the reload, or layers stay on the meta device.
                try:
                    self.rpc(functools.partial(worker_finish, tied_changed=tied))
                except Exception:
                    pass
        if self._unlink_pending:
            # Every worker has mapped the file now: unlink it, so it cannot outlive the processes
            # (the mappings stay valid; a killed trainer leaves nothing behind in /dev/shm).
            _unlink(self._shm_path)
            self._unlink_pending = False
        return stats

    def _send_bucket(self, b: Bucket, tensors: dict[str, torch.Tensor]) -> dict:
        metas = [(m.name, m.dtype, m.shape, m.offset, m.nbytes) for m in b.metas]
        if self.transport == "cpu":
            buf = self._host_buffer(b.nbytes)
            pack_bucket(b, tensors, buf)
            if self._shm_path is not None:
                payload = {"kind": "shm", "path": self._shm_path, "file_bytes": self._shm_bytes, "metas": metas}
                return payload
            # A pickled view carries its whole storage: send exactly this bucket's bytes.
            part = buf if buf.numel() == b.nbytes else buf[:b.nbytes].clone()
            return {"kind": "inline", "buffer": part, "metas": metas}
        if self.transport == "cuda_ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            buf = self._device_buffer(b.nbytes)
            pack_bucket(b, tensors, buf)
            torch.cuda.current_stream(buf.device).synchronize()  # the copy must land before a worker reads it
            uid = str(torch.cuda.get_device_properties(buf.device).uuid)
            _, args = reduce_tensor(buf)
            return {"kind": "cuda_ipc", "handles": {uid: args}, "metas": metas}
        raise ValueError(f"unknown transport {self.transport!r}")

    def _nccl_bucket(self, b: Bucket, tensors: dict[str, torch.Tensor], flags: dict) -> None:
        """Broadcast one bucket from rank 0 while the workers receive it inside their rpc (both sides
        rendezvous in the same NCCL call, hence the rpc in a thread: vLLM's rlhf.py / nccl_engine.py)."""
        if self._nccl is None:
            self._nccl_init()
        buf = self._device_buffer(b.nbytes)
        pack_bucket(b, tensors, buf)
        metas = [(m.name, m.dtype, m.shape, m.offset, m.nbytes) for m in b.metas]
        box: dict = {}

        def receive():
            try:
                self.rpc(functools.partial(worker_load, payload={"kind": "nccl", "nbytes": b.nbytes, "metas": metas,
                                                                     **flags}))
            except BaseException as e:  # handed to the sending thread
                box["error"] = e

        t = threading.Thread(target=receive, name="weight-sync-nccl", daemon=True)
        t.start()
        self._nccl.broadcast(buf[:b.nbytes], src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        t.join()
        if "error" in box:
            raise box["error"]

    def _nccl_init(self) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        host, port = "127.0.0.1", _free_port()
        world = 1 + self.num_workers
        box: dict = {}

        def join():
            try:
                self.rpc(functools.partial(worker_nccl_init, host=host, port=port, world_size=world, rank_offset=1))
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=join, name="weight-sync-nccl-init", daemon=True)
        t.start()
        pg = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world)
        self._nccl = PyNcclCommunicator(pg, device=self.gpu)
        t.join()
        if "error" in box:
            raise box["error"]

    # ------------------------------------------------------------------ buffers
    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `nbytes`, reused across pushes: a shared-memory file when
        /dev/shm exists (grown when a bucket needs more), else plain memory."""
        if self._shm_buf is not None and self._shm_bytes >= nbytes:
            return self._shm_buf
        self._drop_shm()
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        if shm_dir is None:
            self._shm_buf, self._shm_bytes = torch.empty(nbytes, dtype=torch.uint8), nbytes
            return self._shm_buf
        fd, path = tempfile.mkstemp(prefix=f"grpo_lab_sync_{uuid.uuid4().hex[:8]}_", dir=shm_dir)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        self._shm_path, self._shm_bytes = path, nbytes
        self._shm_buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._unlink_pending = True
        return self._shm_buf

    def _drop_shm(self) -> None:
        if self._shm_path is not None:
            _unlink(self._shm_path)
        self._shm_path, self._shm_buf, self._shm_bytes = None, None, 0
        self._unlink_pending = False

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        if self._gpu_buf is None or self._gpu_buf.numel() < nbytes:
            self._gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.gpu)
        return self._gpu_buf


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
