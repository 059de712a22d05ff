"""Rewards on what instruct models write, the per-sample info side channel, and llm_judge's parsing.
The judge itself runs (SmolLM2-135M on vLLM) in the last test, marked vllm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grpo_lab.rewards import REWARDS, RewardValues, compute_rewards, extract_answer
from grpo_lab.rewards.llm_judge import parse_score, render_judge_prompt
from grpo_lab.tasks import TaskItem

ITEM = TaskItem(prompt="State the final answer to the following arithmetic problem: 15 - 43 =", answer="-28",
                solution="-28", fields={"answer_format": "boxed_or_last"})
RIGHT = ["The answer is -28.", "15 - 43 = -28", "\\boxed{-28}", "**-28**", "-28.", "-28",
         "15 - 43 = -28. So the answer is **-28**.", "The final answer is $\\boxed{-28}$.", "Answer: -28",
         "15 - 43 = -28, which is the difference between 15 and 43."]
WRONG = ["280", "The answer is 28.", "-280", "15 - 43", "The answer is -27. Not -28 as I first thought? no: -27", "",
         "15 - 43 = 1, not -28"]


@pytest.mark.parametrize("reward", ["correctness_binary", "math_verify"])
def test_instruct_style_answers(reward):
    total, _ = compute_rewards(RIGHT + WRONG, [ITEM] * (len(RIGHT) + len(WRONG)), [(reward, 1.0)])
    assert total == [1.0] * len(RIGHT) + [0.0] * len(WRONG), list(zip(RIGHT + WRONG, total))


def test_extraction_rules_by_hand():
    e = lambda c: extract_answer(c, "boxed_or_last")  # noqa: E731
    assert e("15-43=-28") == "-28"            # '-' after a digit is subtraction, '=' then a signed number
    assert e("The answer is -28 because 43 > 15.") == "-28"   # first number after the LAST "answer is"
    assert e("So there are 1,000 apples.") == "1000"          # thousands separator dropped
    # The last equation's result, not a number in the explanation after it (SmolLM2-135M's habit):
    assert e("4 + 1 = 5, which is the sum of 4 and 1.") == "5"
    assert e("a = 2, b = 3, so 2 + 3 = 5 apples in 2 bags") == "5"
    assert e("The answer is 7, since 3 + 4 = 7 and not 8") == "7"   # an explicit marker still wins
    assert e("\\boxed{\\frac{1}{2}} and more text 7") == "\\frac{1}{2}"  # a box beats a later number
    assert e("Answer: cat.") == "cat" and e("cat") == "cat"   # non-numeric answers still read
    assert extract_answer("x \\boxed{4", "boxed") is None     # unclosed box: no answer


def test_format_reward_wants_an_explicit_answer():
    comps = ["The answer is -28.", "\\boxed{-28}", "#### -28", "<answer>-28</answer>", "15 - 43 = -28", "-28", "**-28**"]
    vals = REWARDS.get("format")(comps, answer_format=["boxed_or_last"] * len(comps))
    assert vals == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_info_side_channel_and_settings(monkeypatch):
    """A reward returning RewardValues(values, info=...) gets its extras into RewardResult.info, also
    when the batch call fails and each sample is scored alone (failed samples: None); settings reach
    functions that name them."""
    seen = {}

    def noisy(completions, *, prompt, judge=None, **_):
        seen["judge"], seen["prompt"] = judge, prompt
        if len(completions) > 1:
            raise RuntimeError("batch path fails")
        if completions[0] == "boom":
            raise ValueError("bad sample")
        return RewardValues([0.5], info={"note": [f"read {completions[0]!r}"]})

    monkeypatch.setitem(REWARDS._entries, "_test_noisy", noisy)  # registered for this test only
    monkeypatch.setitem(REWARDS._facts, "_test_noisy", dict(REWARDS.defaults))
    res = compute_rewards(["a", "boom", "c"], [ITEM] * 3, [("_test_noisy", 1.0)], max_error_frac=0.5,
                          settings={"judge": {"x": 1}})
    assert res.total == [0.5, 0.0, 0.5] and res.metrics["reward/errors"] == 1.0
    assert res.info == {"_test_noisy/note": ["read 'a'", None, "read 'c'"]}
    assert res.sample_info(2) == {"_test_noisy/note": "read 'c'"}
    assert seen["judge"] == {"x": 1} and seen["prompt"] == [ITEM.prompt]
    with pytest.raises(ValueError, match="settings .* names of per-sample fields"):
        compute_rewards(["a"], [ITEM], [("format", 1.0)], settings={"answer": 1})


def test_parse_score_and_render():
    assert parse_score("Score: 7/10. Good.") == pytest.approx(0.7)
    assert parse_score("score = 3 out of 4") == 0.75
    assert parse_score("Score: **8**\nThe answer is right.") == pytest.approx(0.8)  # out of score_max=10
    assert parse_score("Score: 1", score_max=1) == 1.0
    assert parse_score("Score: 12/10") is None and parse_score("I think it is fine") is None
    text = render_judge_prompt("Q {prompt} A {answer} C {completion} \\boxed{}", prompt="p", answer="a",
                               completion="x{answer}" * 3, max_chars=6)
    assert text == "Q p A a C x{answ [...] \\boxed{}"  # one pass: {answer} inside a completion stays as written


def test_config_default_template_is_the_modules():
    from grpo_lab.schema import JudgeConfig
    from grpo_lab.rewards.llm_judge import DEFAULT_TEMPLATE

    assert JudgeConfig().template == DEFAULT_TEMPLATE


def test_judge_unparseable_is_a_contained_error(monkeypatch):
    """Unparseable judge text -> NaN -> reward.on_error and counted, with the text kept as feedback."""
    import grpo_lab.rewards.llm_judge as lj
    from grpo_lab.rollout import Rollout
    from grpo_lab.schema import JudgeConfig

    class FakeEngine:
        def generate(self, prompt_ids, **kw):
            texts = [" 9/10 correct.", " hmm, no idea"]
            return Rollout([], [[1]] * 2, [[]] * 2, texts[: len(prompt_ids)], [0, 1], [False] * 2)

    class FakeTok:
        chat_template = None
        bos_token, bos_token_id = None, None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 50 for c in text]

    monkeypatch.setattr(lj, "start_judge", lambda judge: (FakeEngine(), FakeTok()))
    res = compute_rewards(["-28", "banana"], [ITEM] * 2, [("llm_judge", 1.0)], max_error_frac=0.5,
                          settings={"judge": {**JudgeConfig().__dict__, "template": "{completion}",
                                              "response_prefix": "Score:"}})
    assert res.per_reward["llm_judge"] == [pytest.approx(0.9), 0.0] and res.metrics["reward/errors"] == 1.0
    assert res.info["llm_judge/feedback"] == ["Score: 9/10 correct.", "Score: hmm, no idea"]


SMOLLM2_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "grpo_lab" / "models" / "smollm2_135m"


@pytest.mark.slow  # a vLLM start-up plus 5 judged samples
@pytest.mark.vllm
def test_smollm2_judge_on_vllm():
    """SmolLM2-135M-Instruct as the judge on its own vLLM engine, a handful of samples: every sample
    gets a score in [0, 1] or a counted contained error, and its written feedback; the engine starts
    once per process (the second call reuses it)."""
    pytest.importorskip("vllm")
    import grpo_lab.rewards.llm_judge as lj
    from grpo_lab.schema import JudgeConfig
    from grpo_lab.models import MODEL_BUILDERS

    model_dir = MODEL_BUILDERS.call("smollm2_135m", SMOLLM2_CACHE)
    judge = {**JudgeConfig().__dict__, "builder": "pretrained", "path": str(model_dir), "cache_dir": str(SMOLLM2_CACHE.parent),
             "max_new_tokens": 24, "max_model_len": 1024}
    comps = ["The answer is -28.", "15 - 43 = 58", "\\boxed{-28}", "I don't know."]
    try:
        res = compute_rewards(comps, [ITEM] * 4, [("llm_judge", 1.0)], max_error_frac=1.0, settings={"judge": judge})
        assert len(lj._ENGINES) == 1
        engine = next(iter(lj._ENGINES.values()))[0]
        again = compute_rewards(comps[:1], [ITEM], [("llm_judge", 1.0)], max_error_frac=1.0, settings={"judge": judge})
        assert next(iter(lj._ENGINES.values()))[0] is engine and len(lj._ENGINES) == 1
    finally:
        lj.close_judges()
    feedback = res.info["llm_judge/feedback"]
    print("\n".join(f"{c!r} -> {v:.2f} | {f!r}" for c, v, f in zip(comps, res.per_reward["llm_judge"], feedback)))
    assert len(feedback) == 4 and all(f.startswith("Score:") and len(f) > len("Score:") for f in feedback)
    vals = res.per_reward["llm_judge"]
    assert all(0.0 <= v <= 1.0 for v in vals)
    parsed = sum(parse_score(f) is not None for f in feedback)
    assert res.metrics["reward/errors"] == 4 - parsed
    assert again.info["llm_judge/feedback"][0] == feedback[0]  # greedy: same text for the same sample
    assert math.isfinite(sum(vals))
