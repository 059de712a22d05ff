"""Weight sync, receiving side: the functions that run inside each vLLM worker process.

The learner's :class:`grpo_lab.rollout.weight_sync.WeightSync` calls them through
``LLM.collective_rpc``, bound in a ``functools.partial``: the partial pickles each function by
reference (module path and name), so they stay module-level here and the worker process imports
this module by that path (the spawned engine processes inherit the trainer's ``sys.path``). This
module imports nothing from the sending side, so a worker loads only what it runs: torch here, vLLM
inside the functions.

A bucket is one flat uint8 buffer holding several tensors at byte offsets (:class:`TensorMeta`);
:func:`open_bucket` gives the buffer a payload names (a shared-memory mapping, the pickled buffer,
a CUDA IPC handle or an NCCL broadcast) and :func:`unpack_bucket` views it as named tensors.

Per push (all transports but ``pickle``): ``begin`` (``initialize_layerwise_reload``), one
:func:`worker_load` per bucket (``model.load_weights`` on views), ``finish``
(``finalize_layerwise_reload``, then the tied lm_head re-pack); the first bucket's rpc opens the
reload and the last one's closes it. These are the same three phases as vLLM's own weight-transfer
engines (``vllm/distributed/weight_transfer/ipc_engine.py``: start/receive/finish_weight_update).
``pickle`` is :func:`worker_reload_pickled`: the runner's own ``reload_weights`` on copied tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's Llama/Qwen2/Mistral fusion (their `packed_modules_mapping`); :func:`worker_info` reports the
# loaded model's own mapping and falls back to this.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# --------------------------------------------------------------------------------- bucket layout
@dataclass
class TensorMeta:
    """Where one named tensor lies in a bucket; travels to the worker as a plain tuple of its fields."""

    name: str
    dtype: str       # "float32", ...
    shape: tuple
    offset: int      # bytes from the start of the bucket
    nbytes: int


def unpack_bucket(buf: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views (no copy) of a flat uint8 buffer as the named tensors it holds."""
    return [(m.name, buf[m.offset:m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
            for m in metas]


# --------------------------------------------------------------------------------- worker rpcs
def _model(worker):
    return worker.model_runner.get_model()


def worker_info(worker) -> dict:
    """What the sender needs to know about a worker: its packed-module mapping and GPU."""
    model = _model(worker)
    info = {"packed": dict(getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED), "gpu_uuid": None}
    if torch.cuda.is_available() and getattr(worker, "device", torch.device("cpu")).type == "cuda":
        info["gpu_uuid"] = str(torch.cuda.get_device_properties(worker.device).uuid)
    return info


def worker_begin(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(_model(worker))


def _retie_lm_head(model) -> None:
    lm_head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(model.config, "tie_word_embeddings", False):
        # A tied lm_head is the embedding matrix, but the layerwise reload only re-processes the
        # embedding: re-tie it and redo the lm_head's post-load step (on CPU: a re-pack of the
        # matrix for oneDNN; elsewhere a no-op), else logits keep using the old matrix.
        lm_head.weight = embed.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)


def worker_finish(worker, *, tied_changed: bool = True) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = _model(worker)
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    if tied_changed:
        _retie_lm_head(model)
    # What the runner's own reload_weights resets after a reload (v1/worker/gpu_model_runner.py).
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(worker.model_runner, reset, None)
        if fn is not None:
            fn()


def worker_load(worker, payload: dict) -> None:
    """Load one bucket: views of its buffer into the model's (layerwise-wrapped) loaders; the first
    bucket of a push opens the layerwise reload ("begin"), the last one closes it ("finish")."""
    # The buffer first: with NCCL the sender is already blocked in its broadcast, and a worker that
    # failed before its receive would leave the sender's stream waiting for ever.
    buf = open_bucket(payload, device=getattr(worker, "device", torch.device("cpu")),
                      shm_maps=worker.__dict__.setdefault("_grpo_lab_shm", {}),
                      nccl=getattr(worker, "_grpo_lab_nccl", None))
    if payload.get("begin"):
        worker_begin(worker)
    try:
        model = _model(worker)
        model.load_weights(unpack_bucket(buf, [TensorMeta(*m) for m in payload["metas"]]))
        _own_pending_views(model, buf)
        if payload["kind"] in ("cuda_ipc", "nccl"):
            del buf
            torch.cuda.synchronize()
    finally:
        if payload.get("finish"):
            worker_finish(worker, tied_changed=payload.get("tied_changed", True))


def open_bucket(payload: dict, *, device: torch.device, shm_maps: dict | None = None,
                nccl=None) -> torch.Tensor:
    """The flat uint8 buffer one bucket payload names, as the receiving process sees it: a mapping of
    the sender's shared-memory file (opened once and kept in `shm_maps`: the sender unlinks the file
    after the first push, so it never outlives the two processes), the pickled buffer itself, the
    sender's GPU buffer opened through its CUDA IPC handle on `device`, or a buffer on `device` that
    the NCCL broadcast from the sender fills (`nccl`: the receiver's communicator)."""
    kind = payload["kind"]
    if kind == "shm":
        path, nbytes = payload["path"], payload["file_bytes"]
        maps = shm_maps if shm_maps is not None else {}
        if path not in maps:
            maps.clear()  # a new (larger) file replaces the old mapping
            maps[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return maps[path]
    if kind == "inline":
        return payload["buffer"]
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uid = str(torch.cuda.get_device_properties(device).uuid)
        args = list(payload["handles"][uid])
        # Index 6 of reduce_tensor's args is the device index in the *sender's* numbering; the
        # receiver may see the same GPU under another index (its own CUDA_VISIBLE_DEVICES), so it
        # names its own (vLLM's rlhf_colocate.py / IPC weight-transfer engine do the same).
        args[6] = device.index
        return rebuild_cuda_tensor(*args)
    if kind == "nccl":
        buf = torch.empty(payload["nbytes"], dtype=torch.uint8, device=device)
        nccl.broadcast(buf, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        return buf
    raise ValueError(f"unknown weight-sync payload {kind!r}")


def _own_pending_views(model, buf: torch.Tensor) -> None:
    """Clone the tensors of layers the reload is still holding back, so the sender may reuse the bucket.

    A layer is processed when all its elements have arrived; one with padding (e.g. a vocabulary
    rounded up by VocabParallelEmbedding) never gets there and waits for ``finalize`` with the
    loaded tensors buffered as given (``reload/layerwise.py``, Limitations 4) — here, views of a
    bucket that the next bucket overwrites.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    base = buf.untyped_storage().data_ptr()
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in list(bound.arguments.items()):
                if (key != "param" and isinstance(value, torch.Tensor) and value.device == buf.device
                        and value.untyped_storage().data_ptr() == base):
                    bound.arguments[key] = value.clone()


def worker_nccl_init(worker, host: str, port: int, world_size: int, rank_offset: int) -> None:
    """Join the learner's NCCL group (vLLM's rlhf.py pattern): rank = rank_offset + worker rank."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=host, port=port, rank=rank_offset + worker.rank, world_size=world_size)
    worker._grpo_lab_nccl = PyNcclCommunicator(pg, device=worker.device)


def worker_reload_pickled(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """The previous protocol (the benchmark's baseline): all tensors, pickled, one reload_weights."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    _retie_lm_head(_model(worker))
