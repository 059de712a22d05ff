"""The one training piece (grpo_lab/learner/trainable.py): its SFT step is the warm-up's as it was written
by hand, a non-finite gradient never reaches the weights, clipping clips, and its state round-trips."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.learner.batch import collate, completion_logits, encode_prompt, encode_target, token_logprobs
from grpo_lab.learner.trainable import TrainableModel
from grpo_lab.models import MODEL_BUILDERS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=",
                                                   seed=0))


def batch_of(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = [("12+3=", "15"), ("4-9=", "-5"), ("7+7=", "14")]
    return collate([encode_prompt(tok, p) for p, _ in pairs], [encode_target(tok, t) for _, t in pairs],
                   tok.pad_token_id)


def test_sft_step_is_the_hand_written_supervised_step_bit_for_bit(model_dir):
    batch = batch_of(model_dir)
    ours = AutoModelForCausalLM.from_pretrained(str(model_dir))
    theirs = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trainable = TrainableModel(ours, lr=1e-3, weight_decay=0.01)
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-3)       # the warm-up's optimizer as it was
    for _ in range(3):
        loss = trainable.sft_step(batch)
        logp = token_logprobs(completion_logits(theirs, batch), batch["completion_ids"])
        mask = batch["response_mask"]
        expected = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        expected.backward()
        optimizer.step()
        assert loss == expected.item()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name


def test_a_non_finite_gradient_is_not_applied(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trainable = TrainableModel(model, lr=1e-2, grad_clip=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, norm, _ = trainable.train_step(lambda: (sum(p.sum() for p in model.parameters()) * float("nan"), {}))
    assert norm != norm                                                # NaN: reported ...
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())   # ... and not applied
    assert not trainable.optimizer.state and all(p.grad is None for p in model.parameters())


def test_clipping_scales_the_step_to_the_clip_norm(model_dir):
    # AdamW's first step is scale-free, so read the gradient the optimizer step sees instead of the update:
    # clipping at 1e-3 scales a gradient of norm g by 1e-3 / g, so the step sees norm 1e-3.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trainable = TrainableModel(model, lr=1e-3, grad_clip=1e-3)
    batch = batch_of(model_dir)
    seen = {}
    step = trainable.optimizer.step

    def record_then_step(*a, **k):
        seen["norm"] = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
        return step(*a, **k)
    trainable.optimizer.step = record_then_step
    trainable.sft_step(batch)
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-4)


def test_state_round_trips_optimizer_and_schedule(model_dir):
    def make():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        return TrainableModel(model, lr=1e-3, lr_lambda=lambda s: 1.0 / (1 + s))
    a, batch = make(), batch_of(model_dir)
    a.sft_step(batch)
    a.scheduler.step()
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.lr == a.lr == pytest.approx(0.5e-3) and b.scheduler.last_epoch == 1
    assert b.optimizer.state_dict()["state"][0]["step"] == a.optimizer.state_dict()["state"][0]["step"]
    assert "optimizer" not in a.state_dict(optimizer=False)
