"""The hf engine's shared-prefill sampler (rollout.sampler=shared_prefill): each distinct
prompt's forward once, its n samples decoding from copies of its KV cache. It must be the same
sampler as transformers `generate`: the same greedy tokens and stop rule, logprobs the learner
recomputes, and draws from the model's (temperature, top-p) distribution."""

from pathlib import Path

import pytest
import torch

from grpo_lab.learner.batch import collate, completion_stats
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.rollout.hf_engine import HFEngine
from helpers import ragged_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=", seed=0)


def engines(model_dir, eos_id=None):
    out = HFEngine.from_dir(model_dir, sampler="generate"), HFEngine.from_dir(model_dir, sampler="shared_prefill")
    if eos_id is not None:     # a token this model writes often, so that rows stop at different steps
        for e in out:
            e.eos_id = eos_id
    return out


def test_greedy_rows_equal_generates_with_the_same_stops(model_dir):
    ref, shared = engines(model_dir)
    args = dict(n=3, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0)
    first = ref.generate(ragged_prompts(), **args)
    # Stop on a token the greedy rows write, somewhere in the middle of some rows and not in others.
    counts = torch.bincount(torch.tensor([t for c in first.completion_ids for t in c[1:]]))
    ref, shared = engines(model_dir, eos_id=int(counts.argmax()))
    a, b = ref.generate(ragged_prompts(), **args), shared.generate(ragged_prompts(), **args)
    assert any(a.truncated) and not all(a.truncated)
    assert len({len(c) for c in a.completion_ids}) > 1
    assert b.completion_ids == a.completion_ids and b.truncated == a.truncated
    assert b.group_ids == a.group_ids and b.prompt_ids == a.prompt_ids and b.texts == a.texts
    for x, y in zip(a.sampler_logprobs, b.sampler_logprobs):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_logprobs_are_the_learners_and_tokens_lie_in_the_nucleus(model_dir, top_p):
    _, shared = engines(model_dir, eos_id=5)
    roll = shared.generate(ragged_prompts(), n=4, temperature=0.7, top_p=top_p, max_new_tokens=8, seed=1)
    batch = collate(roll.prompt_ids, roll.completion_ids, shared.pad_id, roll.sampler_logprobs)
    with torch.no_grad():
        learner, _ = completion_stats(shared.model, batch, 0.7)          # logits / T, as the sampler's logprobs
        logits = shared.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"]).logits
    mask = batch["response_mask"].bool()
    assert torch.allclose(learner[mask], batch["sampler_logprobs"][mask], atol=1e-5)
    # A token is in the top-p nucleus when the tokens more probable than it hold < top_p of the mass.
    P, T = batch.prompt_width, mask.shape[1]
    probs = torch.softmax(logits[:, P - 1:P - 1 + T] / 0.7, -1)
    chosen = probs.gather(-1, batch["completion_ids"].unsqueeze(-1))
    above = (probs * (probs > chosen)).sum(-1)
    assert (above[mask] < top_p + 1e-6).all()


@pytest.mark.parametrize("sampler", ["generate", "shared_prefill"])
def test_first_tokens_follow_the_models_distribution(model_dir, sampler):
    """4,000 draws of one prompt's first token against softmax(logits / T): every frequency within
    4.5 binomial standard deviations (a false alarm about once in 10^5 runs per token)."""
    engine = HFEngine.from_dir(model_dir, sampler=sampler)
    prompt = ragged_prompts(1)
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor(prompt)).logits[0, -1]
    p = torch.softmax(logits / 1.5, -1)
    n = 4000
    roll = engine.generate(prompt, n=n, temperature=1.5, top_p=1.0, max_new_tokens=1, seed=2)
    freq = torch.bincount(torch.tensor([c[0] for c in roll.completion_ids]), minlength=len(p)).float() / n
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / n).sqrt() + 1 / n).all()


def test_an_unknown_sampler_is_refused(model_dir):
    with pytest.raises(ValueError, match="rollout.sampler='beam' is not one of generate, shared_prefill"):
        HFEngine.from_dir(model_dir, sampler="beam")


def test_the_config_key_reaches_the_engine(model_dir):
    from hydra import compose, initialize_config_dir

    from grpo_lab.config import finalize, register_configs, validate
    from grpo_lab.rollout import make_engine

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=["rollout=hf", "rollout.sampler=shared_prefill"]))
    validate(cfg)
    assert make_engine(model_dir, cfg.rollout, seed=0).sampler == "shared_prefill"
