"""vLLM rollout engine: the real inference engine (CPU build here, CUDA build on GPU machines).

The engine core runs in its own process; the learner pushes new weights into it in memory after
every update through `collective_rpc("reload_weights", weights_iterator=...)` (vLLM's in-place
layerwise reload, which knows its fused qkv / gate_up layouts and re-packs CPU kernels). Nothing is
re-read from disk.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterable

import torch

from grpo_lab.rollout.base import Rollout


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (module level, so it pickles)."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(model.config, "tie_word_embeddings", False):
        # A tied lm_head is the embedding matrix, but the layerwise reload only re-processes the
        # embedding: re-tie it and redo the lm_head's post-load step (on CPU: a re-pack of the
        # matrix for oneDNN; elsewhere a no-op), else logits keep using the old matrix.
        lm_head.weight = embed.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)


class VLLMEngine:
    def __init__(self, model_dir: str | Path, *, gpu_memory_utilization: float, max_model_len: int,
                 enforce_eager: bool, dtype: str, seed: int):
        # apply_model ships a pickled function (and the weights) to the engine process.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # Layerwise reload warns on every push about modules without weights (rotary, tied lm_head).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            # Logprobs of the distribution actually sampled from (after temperature), which is what
            # the learner computes as π_old; the default "raw_logprobs" ignores temperature.
            logprobs_mode="processed_logprobs",
        )

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, logprobs: bool = True) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = temperature == 0.0
        # One seeded request per prompt: reproducible given the seed, independent across prompts.
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                                 max_tokens=max_new_tokens, logprobs=0 if logprobs else None,
                                 seed=None if seed is None else seed + i)
                  for i in range(len(prompt_ids))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                    use_tqdm=False)
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
        weights = [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]
        # The worker's `reload_weights` re-initialises each layer, loads the checkpoint-format tensors
        # with the model's own loader (fused qkv / gate_up), then re-runs the post-load processing.
        # On the CPU backend that processing pre-packs linear weights for oneDNN and drops the
        # original Parameters, so a bare `model.load_weights` after start-up fails.
        # The function travels pickled (with the tensors) to each worker, as with `apply_model`.
        self.llm.collective_rpc(functools.partial(_reload_weights, weights=weights))
        # Cached prefix KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        engine = getattr(self, "llm", None)
        if engine is None:
            return
        shutdown = getattr(engine.llm_engine, "shutdown", None) or getattr(
            getattr(engine.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del self.llm
