"""Preference-label noise and its remedies: cDPO and rDPO by hand, flips on formed pairs (seeded by run
seed and step) and on a pairs file (once, at load)."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.algos import PREFERENCE_LOSSES
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.objectives.preference import PairFileSampler, label_noise_generator
from grpo_lab.schema import AlgorithmConfig

# One pair with h = β·(Δc − Δr) = log 3, so σ(h) = 3/4 and σ(−h) = 1/4.
LOGPS = [torch.tensor([math.log(3.0)]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0])]


def test_cdpo_by_hand():
    # −(1−ε) log σ(h) − ε log σ(−h) = 0.9·0.287682 + 0.1·1.386294 = 0.397543
    loss, _ = PREFERENCE_LOSSES.call("dpo", *LOGPS, beta=1.0, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * -math.log(0.75) + 0.1 * -math.log(0.25), rel=1e-6)
    assert loss.item() == pytest.approx(0.397543, abs=1e-6)
    plain, _ = PREFERENCE_LOSSES.call("dpo", *LOGPS, beta=1.0)
    zero, _ = PREFERENCE_LOSSES.call("dpo", *LOGPS, beta=1.0, label_smoothing=0.0)
    assert torch.equal(plain, zero) and plain.item() == pytest.approx(-math.log(0.75))


def test_rdpo_by_hand_and_unbiased():
    # [(1−ε)·0.287682 − ε·1.386294] / (1 − 2ε) at ε = 0.1: (0.258914 − 0.138629) / 0.8 = 0.150356
    loss, _ = PREFERENCE_LOSSES.call("rdpo", *LOGPS, beta=1.0, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.150356, abs=1e-6)
    # Unbiased: averaged over the label noise (kept with 1−ε, swapped with ε) it is the clean DPO loss.
    swapped = [LOGPS[1], LOGPS[0], LOGPS[3], LOGPS[2]]
    flipped, _ = PREFERENCE_LOSSES.call("rdpo", *swapped, beta=1.0, label_smoothing=0.1)
    assert (0.9 * loss + 0.1 * flipped).item() == pytest.approx(-math.log(0.75), rel=1e-6)
    with pytest.raises(ValueError, match="0.5"):
        PREFERENCE_LOSSES.call("rdpo", *LOGPS, beta=1.0, label_smoothing=0.5)


def _scored_batch():
    # Two groups of 2: the better sample of each is row 0 and row 2.
    return {"rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]), "group_ids": torch.tensor([0, 0, 1, 1])}


def _prepare(flip, seed=0, step=1, monkeypatch=None):
    algo = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig),
                           {"objective": "preference", "preference": {"label_flip_prob": flip}})
    captured = {}
    import grpo_lab.objectives.preference as pref

    monkeypatch.setattr(pref, "pair_batch", lambda b, c, r, w: captured.update(chosen=c, rejected=r) or b)
    _, metrics = OBJECTIVES.get("preference").prepare(_scored_batch(), algo, normalizer=None, step=step, seed=seed)
    return captured["chosen"].tolist(), captured["rejected"].tolist(), metrics


def test_formed_pairs_flip_with_their_probability(monkeypatch):
    assert _prepare(0.0, monkeypatch=monkeypatch)[:2] == ([0, 2], [1, 3])
    c, r, m = _prepare(1.0, monkeypatch=monkeypatch)
    assert (c, r) == ([1, 3], [0, 2]) and m["reward/label_flipped_frac"] == 1.0
    # seeded by (seed, step): the same pairs flip again, another step draws anew
    draws = {s: _prepare(0.5, step=s, monkeypatch=monkeypatch)[:2] for s in range(12)}
    assert _prepare(0.5, step=3, monkeypatch=monkeypatch)[:2] == draws[3]
    assert len({str(v) for v in draws.values()}) > 1
    g1, g2 = label_noise_generator(0, 5), label_noise_generator(0, 5)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_a_pairs_file_is_flipped_once_at_load(tmp_path):
    from helpers import REPO  # noqa: F401  (tests/ on the path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3, "<s>": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]", pad_token="[UNK]")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" for _ in range(200)))
    clean = PairFileSampler(str(path), tokenizer, seed=0)
    assert all(row["chosen"] == "b" for *_, row in clean.pairs) and not clean.flipped.any()
    noisy = PairFileSampler(str(path), tokenizer, seed=0, label_flip_prob=0.3)
    swapped = [row["chosen"] == "c" for *_, row in noisy.pairs]
    assert swapped == noisy.flipped.tolist() and 0.3 - 0.15 < sum(swapped) / 200 < 0.3 + 0.15
    again = PairFileSampler(str(path), tokenizer, seed=0, label_flip_prob=0.3)
    assert torch.equal(again.flipped, noisy.flipped)        # the same noisy data set every time
    noisy.reset(group_size=2)
    scored = noisy(8)
    assert noisy.reward_metrics["reward/label_flipped_frac"] == pytest.approx(
        sum(t == "c" for t in scored.rollout.texts[::2]) / 8)
