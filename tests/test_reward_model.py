"""A reward model as a second model (grpo_lab/second_models/reward_model.py): it learns a known preference
on the tiny task's text well above chance on held-out pairs, ranks lists with Plackett-Luce, trains with
LoRA (adapters plus its head), and saves what transformers' AutoModelForSequenceClassification loads."""

import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.schema import LoRAConfig
from grpo_lab.second_models import RewardModel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=",
                                                   seed=0))


def pairs(n: int, seed: int):
    """(prompt, chosen, rejected): the right sum is preferred to the same digits with a trailing 0 (ten times
    too large): a preference on the completion's text that a labeller would hold."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"{a}+{b}=", str(a + b), f"{a + b}0"))
    return out


def parity_pairs(n: int, seed: int):
    """(prompt, chosen, rejected): two candidate answers to a sum, the labeller preferring the one ending in
    an even digit: a preference a random head ranks at about chance (the digits' order is random to it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        even, odd = rng.randrange(10, 200, 2), rng.randrange(11, 200, 2)
        out.append((f"{a}+{b}=", str(even), str(odd)))
    return out


def held_out_accuracy(rm: RewardModel, data) -> float:
    good = rm.scores([p for p, _, _ in data], [c for _, c, _ in data])
    bad = rm.scores([p for p, _, _ in data], [r for _, _, r in data])
    return sum(g > b for g, b in zip(good, bad)) / len(data)


def test_a_reward_model_learns_a_known_preference_above_chance_on_held_out_pairs(model_dir, one_thread):
    rm = RewardModel(model_dir, lr=3e-3, seed=0)
    train, held_out = parity_pairs(256, seed=1), parity_pairs(200, seed=2)
    before = held_out_accuracy(rm, held_out)
    rng = random.Random(0)
    for _ in range(60):
        batch = rng.sample(train, 32)
        metrics = rm.ranking_step([(p, [c, r]) for p, c, r in batch])
    assert set(metrics) == {"reward_model/loss", "reward_model/accuracy", "reward_model/margin",
                            "reward_model/grad_norm"}
    after = held_out_accuracy(rm, held_out)
    assert before < 0.75 and after >= 0.9, (before, after)


def test_plackett_luce_on_ranked_lists_and_bradley_terry_margins_train(model_dir, one_thread):
    rm = RewardModel(model_dir, lr=3e-3, seed=0)
    lists = [(p, [c, c + "0", c + "00"]) for p, c, _ in pairs(32, seed=3)]     # best first
    first = rm.ranking_step(lists, loss="plackett_luce")["reward_model/loss"]
    for _ in range(15):
        last = rm.ranking_step(lists, loss="plackett_luce")["reward_model/loss"]
    assert last < first
    m = rm.ranking_step([(p, [c, r]) for p, c, r in pairs(8, seed=4)], margins=[1.0] * 8)
    assert torch.isfinite(torch.tensor(m["reward_model/loss"]))


@pytest.mark.parametrize("loss, lists", [("bradley_terry", False), ("bradley_terry", True), ("plackett_luce", True)])
def test_a_micro_batched_ranking_step_equals_the_whole_batch_step(model_dir, one_thread, loss, lists):
    """Micro-batches of 3 groups (the last one shorter) accumulate exactly the whole batch's gradient: each
    is weighted by its share of the pairs (Bradley-Terry; ranked lists of different lengths have different
    numbers of pairs) or rows (Plackett-Luce) the loss averages over. Same weights after the step, same loss
    and metrics."""
    data = pairs(8, seed=6)
    if lists:   # lists of 2 to 4 completions, best first
        groups = [(p, [c, c + "0", c + "00", c + "000"][:2 + i % 3]) for i, (p, c, _) in enumerate(data)]
    else:
        groups = [(p, [c, r]) for p, c, r in data]
    grads = {}
    whole, micro = RewardModel(model_dir, lr=3e-3, seed=0), RewardModel(model_dir, lr=3e-3, seed=0)
    for name, rm in (("whole", whole), ("micro", micro)):
        step = rm.second.trainable.clip_and_step

        def record_then_step(rm=rm, step=step, name=name):   # the accumulated gradient, then the real step
            grads[name] = {n: p.grad.clone() for n, p in rm.model.named_parameters() if p.grad is not None}
            return step()
        rm.second.trainable.clip_and_step = record_then_step
    a = whole.ranking_step(groups, loss=loss)
    b = micro.ranking_step(groups, loss=loss, micro_batch_size=3)
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert grads["whole"].keys() == grads["micro"].keys() and grads["whole"]
    for n, g in grads["whole"].items():
        torch.testing.assert_close(grads["micro"][n], g, rtol=1e-4, atol=1e-7, msg=n)


def test_the_saved_reward_model_loads_as_a_sequence_classifier_with_the_same_scores(model_dir, tmp_path, one_thread):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    lora = OmegaConf.structured(LoRAConfig(rank=4, alpha=8.0))
    rm = RewardModel(model_dir, lr=3e-3, seed=0, lora=lora)
    trained = [n for n, p in rm.model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trained) and any("score" in n for n in trained)
    assert not any("embed_tokens" in n and "lora_" not in n for n in trained)       # the trunk stays frozen
    data = pairs(16, seed=5)
    rm.ranking_step([(p, [c, r]) for p, c, r in data])
    prompts, completions = [p for p, _, _ in data], [c for _, c, _ in data]
    ours = rm.scores(prompts, completions)
    rm.save(tmp_path / "rm")
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "rm"))
    rows = [rm.encode(p, c) for p, c in zip(prompts, completions)]
    with torch.no_grad():
        theirs = [float(loaded(input_ids=torch.tensor([r]), attention_mask=torch.ones(1, len(r))).logits[0, 0])
                  for r in rows]
    assert loaded.config.pad_token_id == tok.pad_token_id
    assert theirs == pytest.approx(ours, abs=1e-4)


def test_a_saved_reward_model_scores_in_bf16_with_half_the_weight_memory_and_near_fp32_scores(model_dir, tmp_path,
                                                                                            one_thread):
    """reward.reward_model.dtype=bf16: the frozen copy's weights are bf16 (2 bytes a parameter, what the memory
    plan counts), its scores differ from fp32's by bf16 rounding only, and it is a separate copy from the fp32
    one an online refresh trains (forget_reward_model drops both)."""
    from grpo_lab.second_models.reward_model import forget_reward_model, loaded_reward_model

    rm = RewardModel(model_dir, lr=3e-3, seed=0)
    data = parity_pairs(64, seed=3)
    for _ in range(5):
        rm.ranking_step([(p, [c, r]) for p, c, r in data])
    rm.save(tmp_path / "rm")
    fp32, bf16 = loaded_reward_model(tmp_path / "rm"), loaded_reward_model(tmp_path / "rm", "bf16")
    assert fp32 is not bf16 and loaded_reward_model(tmp_path / "rm", "bf16") is bf16
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    bytes_of = lambda m: sum(p.numel() * p.element_size() for p in m.model.parameters())   # noqa: E731
    assert bytes_of(bf16) * 2 == bytes_of(fp32)
    prompts, completions = [p for p, _, _ in data], [c for _, c, _ in data]
    exact, rounded = torch.tensor(fp32.scores(prompts, completions)), torch.tensor(bf16.scores(prompts, completions))
    assert exact.std() > 0 and not torch.equal(exact, rounded)
    torch.testing.assert_close(rounded, exact, rtol=0.05, atol=0.05 * float(exact.abs().max()))
    forget_reward_model(tmp_path / "rm")
    assert loaded_reward_model(tmp_path / "rm", "bf16") is not bf16 and loaded_reward_model(tmp_path / "rm") is not fp32
    forget_reward_model(tmp_path / "rm")
