"""One evaluate and one SFT loop: hand-computed accuracy and lengths from a scripted engine, and the
SFT loop's stopping rules (steps, training time, a callback's target) on the tiny model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lab.evaluation import evaluate
from grpo_lab.learner.trainable import TrainableModel
from grpo_lab.warmup import SFTProgress, sft_loop
from grpo_lab.models import MODEL_BUILDERS
from grpo_lab.tasks.base import TaskItem


class ScriptedEngine:
    """Returns fixed completions (n per prompt, next to each other) and records how it was called."""

    def __init__(self, texts: list[str], lengths: list[int]):
        self.texts, self.lengths, self.calls = texts, lengths, []

    def generate(self, prompts, *, n, temperature, top_p, max_new_tokens, seed, logprobs):
        self.calls.append({"n_prompts": len(prompts), "n": n, "temperature": temperature, "seed": seed,
                           "max_new_tokens": max_new_tokens, "logprobs": logprobs})
        return SimpleNamespace(texts=self.texts, completion_ids=[[0] * k for k in self.lengths])


TOKENIZER = SimpleNamespace(encode=lambda text, add_special_tokens=False: [ord(c) for c in text], bos_token_id=1)
ITEMS = [TaskItem("1+1=", "2", "2"), TaskItem("2+2=", "4", "4"), TaskItem("3+3=", "6", "6")]


def test_greedy_accuracy_and_lengths_by_hand():
    # Completions: "2" right (3 tokens), "5" wrong (4 tokens), "6" right (2 tokens).
    engine = ScriptedEngine(["2", "5", "6"], [3, 4, 2])
    out = evaluate(engine, TOKENIZER, ITEMS, max_new_tokens=8)
    # accuracy = 2 right / 3 = 0.6667; mean length = (3 + 4 + 2) / 3 = 3.0; wrong length = 4 / 1 = 4.0
    assert out == {"eval/accuracy": pytest.approx(2 / 3), "eval/completion_len_mean": 3.0,
                   "eval/wrong_len_mean": 4.0, "eval/n": 3.0}
    assert engine.calls == [{"n_prompts": 3, "n": 1, "temperature": 0.0, "seed": 0, "max_new_tokens": 8,
                             "logprobs": False}]


def test_sampled_with_several_completions_per_item():
    # n=2: completions [item0: "2","3"], [item1: "4","4"], [item2: "1","0"] -> right: 1 + 2 + 0 = 3 of 6.
    engine = ScriptedEngine(["2", "3", "4", "4", "1", "0"], [1, 2, 3, 4, 5, 6])
    out = evaluate(engine, TOKENIZER, ITEMS, max_new_tokens=8, temperature=1.0, n=2, seed=7)
    # accuracy = 3 / 6 = 0.5; mean length = 21 / 6 = 3.5; wrong lengths 2, 5, 6 -> 13 / 3
    assert out["eval/accuracy"] == 0.5 and out["eval/completion_len_mean"] == 3.5
    assert out["eval/wrong_len_mean"] == pytest.approx(13 / 3) and out["eval/n"] == 3.0
    assert engine.calls[0]["temperature"] == 1.0 and engine.calls[0]["seed"] == 7 and engine.calls[0]["n"] == 2


def test_all_right_has_zero_wrong_length():
    out = evaluate(ScriptedEngine(["2", "4", "6"], [1, 1, 1]), TOKENIZER, ITEMS, max_new_tokens=4)
    assert out["eval/accuracy"] == 1.0 and out["eval/wrong_len_mean"] == 0.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = Path(MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+=",
                                                 seed=0))
    return AutoModelForCausalLM.from_pretrained(str(d)), AutoTokenizer.from_pretrained(str(d))


def run_loop(tiny, stop_at: int | None = None, **stop):
    model, tok = tiny
    trainable = TrainableModel(model, lr=1e-3, weight_decay=0.01)
    seen = []
    last = sft_loop(trainable, tok, ITEMS, batch_size=2, seed=0, device="cpu",
                    on_step=lambda p: seen.append(p) or p.step == stop_at, **stop)
    return last, seen


def test_sft_loop_stops_after_max_steps(tiny):
    last, seen = run_loop(tiny, max_steps=3)
    assert [p.step for p in seen] == [1, 2, 3] and last.step == 3 and last.samples == 6
    assert all(isinstance(p, SFTProgress) and p.loss > 0 for p in seen)
    assert last.trained_s == pytest.approx(sum(p.step_time_s for p in seen))


def test_sft_loop_stops_on_training_time_and_on_the_callback(tiny):
    last, _ = run_loop(tiny, max_train_s=1e-9)   # any step takes longer than a nanosecond
    assert last.step == 1
    last, _ = run_loop(tiny, max_steps=10, stop_at=2)   # e.g. a periodic evaluation reached its target
    assert last.step == 2
    with pytest.raises(ValueError, match="stopping rule"):
        run_loop(tiny)


def test_held_out_eval_adds_sampled_mean_at_k():
    """trainer.eval_sampled_k=2: a second, sampled pass at the rollout temperature; its accuracy is the
    mean over the k samples of every item (mean@k), next to the greedy accuracy."""
    from omegaconf import OmegaConf

    from grpo_lab.evaluation import Evaluator
    from grpo_lab.train import evaluate_and_log_samples

    class TwoPassEngine(ScriptedEngine):
        def generate(self, prompts, *, n, **kw):
            self.texts, self.lengths = (["2", "5", "6"], [1, 1, 1]) if n == 1 else (
                ["2", "3", "4", "4", "1", "0"], [1] * 6)
            return super().generate(prompts, n=n, **kw)

    cfg = OmegaConf.create({"seed": 1, "rollout": {"max_new_tokens": 8, "temperature": 0.7, "max_model_len": 64},
                            "trainer": {"samples_per_log": 0, "eval_sampled_k": 2}, "interaction": {"max_turns": 1}})
    engine, logged = TwoPassEngine([], []), []
    recorder = SimpleNamespace(log_samples=lambda rows, step, kind: logged.append(kind))
    evaluator = Evaluator.of(engine, TOKENIZER, ITEMS, rollout=cfg.rollout, trainer=cfg.trainer,
                             interaction=cfg.interaction, seed=cfg.seed)
    out = evaluate_and_log_samples(evaluator, recorder, step=10, samples_per_log=cfg.trainer.samples_per_log)
    # greedy: 2 of 3 right; sampled: item0 "2","3" (1), item1 "4","4" (2), item2 "1","0" (0) -> 3 / 6
    assert out["eval/accuracy"] == pytest.approx(2 / 3) and out["eval/sampled_accuracy"] == 0.5
    assert [c["n"] for c in engine.calls] == [1, 2] and engine.calls[1]["temperature"] == 0.7
    assert engine.calls[1]["seed"] == 1 * 1_000_003 + 10 and logged == ["eval"]
    cfg.trainer.eval_sampled_k = 0
    evaluator = Evaluator.of(engine, TOKENIZER, ITEMS, rollout=cfg.rollout, trainer=cfg.trainer,
                             interaction=cfg.interaction, seed=cfg.seed)
    assert "eval/sampled_accuracy" not in evaluate_and_log_samples(evaluator, recorder, step=10, samples_per_log=0)
