"""The vLLM engine on question-form reasoning-gym prompts. One engine start.

Long prefills: on the CPU build, a step whose prefill exceeds vLLM's 4,096-token batch budget
crashes the engine ("CPU Generator does not use offset", then EngineDeadError) when the prefill is
chunked, since vLLM then rewinds each seeded request's generator. The engine turns chunked prefill
off on the CPU build; these tests run such a step and check that per-request seeds stay
reproducible.

Dead engine: when the engine processes die, the next call must fail fast with a clear error
instead of blocking forever (vLLM's client waits on a dead EngineCore for ever). The last test
kills the engine: keep it last.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace as NS

import pytest

from grpo_lab.learner.batch import encode_prompt
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.rewards import compute_rewards
from grpo_lab.rollout import rollout_section
from grpo_lab.tasks import TASKS
from helpers import VLLM_KV_CACHE_BYTES

pytestmark = pytest.mark.vllm

# Question-form generators with the kwargs of their conf/task files (small splits: fast to build).
GENERATORS = {
    "gcd": dict(min_numbers=2, max_numbers=2, min_value=1, max_value=1000),
    "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
    "simple_equations": dict(min_terms=2, max_terms=3, min_value=1, max_value=20),
}
MAX_MODEL_LEN = 256
ROLLOUT = rollout_section(engine="vllm", gpu_memory_utilization=0.1, max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                          dtype="float32", generate_timeout_s=300.0, sync_timeout_s=120.0,
                          kv_cache_bytes=VLLM_KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from grpo_lab.rollout import make_engine

    tasks = {name: TASKS.get("reasoning_gym")(name=name, dataset_kwargs=kw, train_size=40, dev_size=0,
                                                test_size=0, prompt_format="question")
             for name, kw in GENERATORS.items()}
    alphabet = "".join(sorted(set("".join(t.alphabet() for t in tasks.values()))))
    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet=alphabet, seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = make_engine(model_dir, ROLLOUT, seed=0)
    yield NS(engine=engine, tok=tok, tasks=tasks, model_dir=model_dir)
    engine.close()


@pytest.mark.slow
def test_step_with_prefill_over_4096_tokens_runs_and_is_reproducible(setup):
    # gcd's question prompts are ~106 tokens (character tokenizer): 8 prompts x G=8 is 6,700+
    # prefill tokens in one step, over the CPU build's 4,096-token budget (5 x 8 x 106 crashed before).
    items = setup.tasks["gcd"].splits["train"][:8]
    prompts = [encode_prompt(setup.tok, it.prompt) for it in items]
    assert sum(len(p) for p in prompts) * 8 > 4096
    kw = dict(n=8, temperature=1.0, top_p=1.0, max_new_tokens=8)
    first = setup.engine.generate(prompts, seed=123, **kw)
    again = setup.engine.generate(prompts, seed=123, **kw)
    other = setup.engine.generate(prompts, seed=124, **kw)
    assert len(first) == 64 and all(len(lp) == len(c) for lp, c in zip(first.sampler_logprobs, first.completion_ids))
    assert first.completion_ids == again.completion_ids  # per-request seeds survive the big step
    assert first.completion_ids != other.completion_ids


@pytest.mark.slow
def test_rollout_steps_on_several_generators(setup):
    for name, task in setup.tasks.items():
        items = task.splits["train"][:6]
        prompts = [encode_prompt(setup.tok, it.prompt) for it in items]
        out = setup.engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)
        assert len(out) == 24 and sorted(set(out.group_ids)) == list(range(6)), name
        seq_items = [items[g] for g in out.group_ids]
        total, per = compute_rewards(out.texts, seq_items, [("correctness", 1.0)])
        assert len(total) == 24 and all(0.0 <= r <= 1.0 for r in total), name
        greedy = setup.engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0,
                                       logprobs=False)
        assert len(greedy) == 6, name


@pytest.mark.slow
def test_prompt_longer_than_max_model_len_names_the_key(setup):
    long_prompt = [setup.tok.bos_token_id] + [5] * (MAX_MODEL_LEN - 4)
    with pytest.raises(ValueError, match="rollout.max_model_len"):
        setup.engine.generate([long_prompt], n=1, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)


@pytest.mark.slow
def test_weight_push_then_dead_engine_fails_fast(setup):
    """Last: kills the engine. A SIGINT to the engine's processes (as a Ctrl-C to the process group
    does) must not leave the next weight push blocked forever."""
    from safetensors.torch import load_file

    from grpo_lab.rollout import EngineDeadError

    engine = setup.engine
    weights = load_file(str(setup.model_dir / "model.safetensors"))
    engine.load_weights((k, v) for k, v in weights.items() if k != "lm_head.weight")  # healthy push works

    pids = engine.engine_pids()
    assert pids, "the engine's processes were not found"
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="weight sync") as err:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the processes take a moment to exit after SIGINT
            engine.load_weights((k, v) for k, v in weights.items() if k != "lm_head.weight")
            time.sleep(0.2)
    assert time.monotonic() - t0 < 30
    assert "engine" in str(err.value)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="generate"):
        engine.generate([[setup.tok.bos_token_id, 5]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert time.monotonic() - t0 < 2
