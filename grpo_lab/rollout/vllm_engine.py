"""vLLM rollout engine: the real inference engine (CPU build here, CUDA build on GPU machines).

The engine core runs in its own process; the learner pushes new weights into it in memory after
every update (vLLM's in-place layerwise reload, which knows its fused qkv / gate_up layouts and
re-packs CPU kernels), through a transport chosen by `rollout.sync_transport`: shared-memory
buckets on CPU, CUDA IPC or NCCL on GPUs (grpo_lab/rollout/weight_sync.py, its worker side in
grpo_lab/rollout/weight_sync_worker.py). Only changed tensors travel. Nothing is re-read from disk.

Robustness:

* **No chunked prefill on the CPU build.** With one seeded request per prompt, vLLM 0.32 crashed
  with ``RuntimeError: CPU Generator does not use offset`` (then EngineDeadError) as soon as one
  step's prefill exceeded the scheduler's token budget (CPU default ``max_num_batched_tokens`` =
  4096, ``engine/arg_utils.py: get_batch_defaults``). The scheduler then prefills a request in
  chunks; the runner still samples a token for a partial chunk, discards it and rewinds that
  request's generator so its random stream stays reproducible:
  ``gen.set_offset(gen.get_offset() - 4)`` in ``v1/worker/gpu_model_runner.py:_bookkeeping_sync``
  (inherited by ``CPUModelRunner``). Offsets exist only for the Philox generators of CUDA; a CPU
  generator (Mersenne Twister) raises. On the CPU build we therefore turn chunked prefill off
  (``enable_chunked_prefill=False``): the scheduler then admits a request only when its whole
  prompt fits the step's budget (``v1/core/sched/scheduler.py``: "If chunked_prefill is disabled,
  we can stop the scheduling here"), so no sample is ever discarded, no generator is rewound, and
  per-request seeds stay reproducible. The budget must hold one full prompt, so it is
  ``max(max_model_len, 4096)``. The CUDA build keeps vLLM's defaults (chunking on).
* **Timeouts and fail-fast.** ``generate`` and the weight push run in a helper thread that the
  caller waits on in short slices: past ``generate_timeout_s`` / ``sync_timeout_s`` it raises
  :class:`EngineTimeoutError` naming the phase; if an engine process has died it raises
  :class:`EngineDeadError` at once, carrying the engine's own last error (logged by the engine
  processes into a file, see :mod:`grpo_lab.rollout.lifeline`). After either, the engine is
  broken: its processes are killed and every later call fails fast.
* **No orphans.** Engine processes get a parent-death signal (:mod:`grpo_lab.rollout.lifeline`).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable

import torch

from grpo_lab.rollout import lifeline, weight_sync, weight_sync_worker
from grpo_lab.rollout.data_parallel import environment, placement_env
from grpo_lab.rollout.base import Rollout
from grpo_lab.rollout.errors import EngineDeadError, EngineTimeoutError, RolloutEngineError

log = logging.getLogger(__name__)


def chunked_prefill_settings(max_model_len: int, *, is_cpu: bool) -> dict:
    """Scheduler arguments for `vllm.LLM`: on the CPU build, never chunk a prefill (module docstring).

    ``max_num_batched_tokens`` must hold one whole prompt when chunking is off (vLLM rejects a
    smaller budget); 4096 is vLLM's CPU default for the offline ``LLM`` class.
    """
    if not is_cpu:
        return {}  # CUDA: vLLM's defaults (chunked prefill; Philox generators can be rewound)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(int(max_model_len), 4096)}


# Seconds between liveness checks of the engine processes while a call is in flight.
_POLL_S = 0.25


class VLLMEngine:
    def __init__(self, model_dir: str | Path, *, gpu_memory_utilization: float, max_model_len: int,
                 enforce_eager: bool, dtype: str, seed: int, kv_cache_bytes: int | None = None,
                 generate_timeout_s: float | None = None,
                 sync_timeout_s: float | None = None, start_timeout_s: float | None = None,
                 sync_transport: str = "auto", sync_bucket_mb: float = 256, sync_changed_only: bool = True,
                 learner_device: str = "cpu", tensor_parallel_size: int = 1, placement: tuple[int, int] = (0, 1)):
        """placement = (replica, replicas): this engine's share of the machine's devices or cores when
        several engines run side by side (rollout.data_parallel_size; data_parallel.placement_env).
        kv_cache_bytes: the KV cache's size (vLLM's kv_cache_memory_bytes, which then ignores
        gpu_memory_utilization); None = gpu_memory_utilization of the device (CPU: of RAM) decides."""
        # apply_model ships a pickled function (and the weights) to the engine process.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # Layerwise reload warns on every push about modules without weights (rotary, tied lm_head).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import psutil
        from vllm import LLM
        from vllm.platforms import current_platform

        self.max_model_len = int(max_model_len)
        self.generate_timeout_s, self.sync_timeout_s = generate_timeout_s, sync_timeout_s
        self._broken: RolloutEngineError | None = None
        self._closed = False
        fd, self.error_file = tempfile.mkstemp(prefix="grpo_lab_engine_", suffix=".log")
        os.close(fd)
        if not lifeline.install(self.error_file):
            log.warning("this vLLM version starts its processes elsewhere: engine processes get no "
                        "parent-death signal and may outlive a killed trainer")
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        replica, replicas = placement
        env = {}
        if replicas > 1 or tensor_parallel_size > 1:
            # Replicas and tensor-parallel ranks on hardware of their own (inherited when vLLM spawns them).
            env = placement_env(replica, replicas, per_replica_devices=tensor_parallel_size,
                                on_cuda=not current_platform.is_cpu(), cpu_cores=sorted(os.sched_getaffinity(0)))
        with environment(env):
            self.llm = LLM(
                model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                # vLLM picks its Ray executor whenever it runs inside a Ray placement group (our Ray
                # backend's engine actor), and that executor refuses bundles of more than one GPU: the
                # ranks are processes of this engine, on the devices it was given (placement_env).
                distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
                # Logprobs of the distribution actually sampled from (after temperature), which is what
                # the learner computes as π_old; the default "raw_logprobs" ignores temperature.
                logprobs_mode="processed_logprobs",
                # Its checkpoint-loading bar follows its log level (quiet unless `-v`, grpo_lab.launch).
                use_tqdm_on_load=os.environ["VLLM_LOGGING_LEVEL"].upper() in ("DEBUG", "INFO"),
                **chunked_prefill_settings(max_model_len, is_cpu=current_platform.is_cpu()),
                **({} if kv_cache_bytes is None else {"kv_cache_memory_bytes": int(kv_cache_bytes)}),
            )
        # The engine's processes: everything started under us while the LLM was built, except the
        # multiprocessing resource tracker (shared by the whole trainer; it exits on its own).
        self.processes = [p for p in me.children(recursive=True) if p.pid not in before
                          and "resource_tracker" not in " ".join(_cmdline(p))]
        # The weight-sync transport (grpo_lab/rollout/weight_sync.py), chosen once the workers can
        # say which GPU (if any) they hold the weights on.
        infos = self._rpc(weight_sync_worker.worker_info)
        learner_uuid = None
        if learner_device == "cuda" and torch.cuda.is_available():
            learner_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self.sync_transport = weight_sync.choose_transport(
            sync_transport, engine_on_cuda=not current_platform.is_cpu(), learner_device=learner_device,
            learner_gpu_uuid=learner_uuid, worker_gpu_uuids=[i["gpu_uuid"] for i in infos if i["gpu_uuid"]])
        self._sync = weight_sync.WeightSync(self._rpc, transport=self.sync_transport, bucket_mb=sync_bucket_mb,
                                            changed_only=sync_changed_only, worker_infos=infos,
                                            learner_device=learner_device)

    def _rpc(self, fn) -> list:
        # vLLM's own `timeout` bounds the worker side; `_call` around the whole push also covers a
        # dead EngineCore, which vLLM's client would wait on forever.
        return self.llm.collective_rpc(fn, timeout=self.sync_timeout_s)

    # ----------------------------------------------------------------------------- health
    def engine_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _dead_processes(self) -> list[str]:
        import psutil

        dead = []
        for p in self.processes:
            try:
                if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                    dead.append(f"pid {p.pid}")
            except psutil.Error:
                dead.append(f"pid {p.pid}")
        return dead

    def engine_error(self) -> str:
        """What the engine processes logged as errors (traceback included), or ''."""
        return lifeline.read_error_file(self.error_file)

    def _fail(self, cls, phase: str, what: str, cause: BaseException | None = None) -> RolloutEngineError:
        text = lifeline.read_error_file(self.error_file, limit=200_000)
        root = lifeline.root_error_line(text)
        # The root line first, then the end of the log (vLLM's fatal-error records also dump the
        # whole scheduler state, which would push the traceback out of a short excerpt).
        text = f"{root}\n\n{text[-3000:]}" if text else ""
        if cause is not None and not root:
            root = f"{type(cause).__name__}: {cause}"
        msg = f"rollout engine (vLLM), phase {phase!r}: {what}"
        if root:
            msg += f". Engine's root error: {root}"
        err = cls(msg, phase=phase, engine_error=text)
        self._broken = err
        self._kill_processes()
        return err

    def _call(self, phase: str, timeout_s: float | None, timeout_key: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with a timeout and fail-fast on engine death (module docstring).

        The call runs in a daemon thread (a thread that never returns must not block interpreter
        exit); this thread waits in short slices and checks the engine processes between them.
        """
        if self._closed:
            raise EngineDeadError(f"rollout engine (vLLM), phase {phase!r}: the engine was closed",
                                  phase=phase)
        if self._broken is not None:
            raise EngineDeadError(f"rollout engine (vLLM), phase {phase!r}: the engine failed earlier "
                                  f"and cannot be used ({self._broken})", phase=phase,
                                  engine_error=self._broken.engine_error) from self._broken
        dead = self._dead_processes()
        if dead:
            raise self._fail(EngineDeadError, phase, f"engine process(es) {', '.join(dead)} are gone")
        box: dict = {}

        def run():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        worker = threading.Thread(target=run, name=f"vllm-{phase}", daemon=True)
        start = time.monotonic()
        worker.start()
        while True:
            worker.join(_POLL_S)
            if not worker.is_alive():
                break
            dead = self._dead_processes()
            if dead:
                raise self._fail(EngineDeadError, phase, f"engine process(es) {', '.join(dead)} died "
                                 "while the call was in flight")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise self._fail(EngineTimeoutError, phase,
                                 f"no result within {timeout_s:g} s ({timeout_key}={timeout_s:g}); "
                                 f"the engine is stuck or too slow for this batch: raise {timeout_key} "
                                 "or shrink the batch (trainer.prompts_per_step, rollout.group_size)")
        if "error" in box:
            e = box["error"]
            if type(e).__name__ == "EngineDeadError" or self._dead_processes():
                time.sleep(_POLL_S)  # let the engine finish writing its error log
                raise self._fail(EngineDeadError, phase, f"the engine died ({type(e).__name__}: {e})",
                                 e) from e
            raise e
        return box["value"]

    # ----------------------------------------------------------------------------- protocol
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        longest = max((len(p) for p in prompt_ids), default=0)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens plus rollout.max_new_tokens={max_new_tokens} exceeds "
                f"rollout.max_model_len={self.max_model_len}: raise rollout.max_model_len to at least "
                f"{longest + max_new_tokens} (and the model's max_position_embeddings with it), or "
                "shorten the prompts (task.prompt_format=compact, task.prompt_template)")
        greedy = temperature == 0.0
        # One seeded request per prompt: reproducible given the seed, independent across prompts.
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                                 max_tokens=max_new_tokens, logprobs=0 if logprobs else None,
                                 seed=None if seed is None else seed + i)
                  for i in range(len(prompt_ids))]
        outputs = self._call("generate", self.generate_timeout_s, "rollout.generate_timeout_s",
                             self.llm.generate, [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                             params, use_tqdm=False)
        out = Rollout([], [], [], [], [], [])
        for i, request in enumerate(outputs):
            for c in request.outputs:
                ids = list(c.token_ids)
                out.prompt_ids.append(list(prompt_ids[i]))
                out.completion_ids.append(ids)
                # c.logprobs[t] maps token id -> Logprob for the sampled token (logprobs=0).
                out.sampler_logprobs.append(
                    [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)] if logprobs else [])
                out.texts.append(c.text)
                out.group_ids.append(i)
                out.truncated.append(c.finish_reason == "length")
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the learner's tensors into the running engine (only what changed; see weight_sync).

        The worker re-initialises each layer, loads the checkpoint-format tensors with the model's own
        loader (fused qkv / gate_up), then re-runs the post-load processing. On the CPU backend that
        processing pre-packs linear weights for oneDNN and drops the original Parameters, so a bare
        `model.load_weights` after start-up fails: hence vLLM's layerwise reload.
        """
        named = [(name, t.detach()) for name, t in named_tensors]
        self.last_sync = self._call("weight sync", self.sync_timeout_s, "rollout.sync_timeout_s",
                                    self._sync.push, named)
        if self.last_sync["tensors"]:
            # Cached prefix KV blocks were computed with the old weights.
            self._call("weight sync", self.sync_timeout_s, "rollout.sync_timeout_s", self.llm.reset_prefix_cache)

    def _kill_processes(self) -> None:
        import psutil

        for p in self.processes:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(self.processes, timeout=5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_sync", None) is not None:
            self._sync.close()
        engine = getattr(self, "llm", None)
        try:
            if engine is not None and self._broken is None and not self._dead_processes():
                shutdown = getattr(engine.llm_engine, "shutdown", None) or getattr(
                    getattr(engine.llm_engine, "engine_core", None), "shutdown", None)
                if shutdown is not None:
                    # vLLM's shutdown waits on the engine; a stuck one must not hang the exit path.
                    t = threading.Thread(target=shutdown, name="vllm-shutdown", daemon=True)
                    t.start()
                    t.join(30)
        finally:
            self._kill_processes()  # whatever is still alive (a no-op after a clean shutdown)
            self.llm = None
            try:
                os.unlink(self.error_file)
            except OSError:
                pass


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []
