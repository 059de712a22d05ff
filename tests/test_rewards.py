"""Reward functions on hand-made completions; values computed by hand in the comments."""

from __future__ import annotations

import math

import pytest

from grpo_lab.rewards import REWARDS, compute_rewards, extract_answer, format_solution, is_correct
from grpo_lab.tasks import TASKS, TaskItem


@pytest.fixture(scope="module")
def chain_item():
    t = TASKS.get("reasoning_gym")(
        name="chain_sum", dataset_kwargs=dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2),
        prompt_format="compact", train_size=1, dev_size=0, test_size=0,
    )
    item = t.splits["train"][0]
    assert (item.prompt, item.answer) == ("15-43=", "-28")
    return item


@pytest.fixture(scope="module")
def gsm_item():
    return TASKS.get("reasoning_gym")(name="gsm_symbolic", train_size=1, dev_size=0, test_size=0).splits["train"][0]


PLAIN = TaskItem(prompt="2+2=", answer="4", solution="4", fields={"answer_format": "plain"})


def test_registry_names():
    assert {"correctness", "correctness_binary", "math_verify", "format"} <= set(REWARDS.names())


def test_extract_answer_rules():
    assert extract_answer("  -28 \n", "plain") == "-28"
    assert extract_answer("   ", "plain") is None
    assert extract_answer("a\n#### 1\n#### 72 \nmore", "hash") == "72"  # after the LAST ####
    assert extract_answer("no marker 72", "hash") is None
    assert extract_answer("####   ", "hash") is None
    assert extract_answer("<answer>1</answer> x <answer> 2 </answer>", "tags") == "2"
    assert extract_answer("<answer>2", "tags") is None
    with pytest.raises(ValueError, match="valid choices: plain, hash, tags, boxed, boxed_or_last"):
        extract_answer("1", "latex")


def test_format_solution():
    assert format_solution("-28") == "-28"
    assert format_solution("8", "hash", "4*2 = 8.0\n#### 8.0") == "4*2 = 8.0\n#### 8"
    assert format_solution("8", "tags", "4*2") == "4*2\n<answer>8</answer>"
    with pytest.raises(ValueError, match="cannot carry worked steps"):
        format_solution("8", "plain", "steps")


def test_correctness_rg_chain_sum(chain_item):
    comps = ["-28", "  -28\n", "-28.0", "-280", "28", "-27", "", "abc"]
    r = REWARDS.get("correctness")(comps, answer=["-28"] * 8, answer_format=["plain"] * 8,
                                   rg_dataset=["chain_sum"] * 8, rg_config=[chain_item.fields["rg_config"]] * 8,
                                   rg_entry=[chain_item.fields["rg_entry"]] * 8)
    # reasoning-gym's chain_sum scorer: Decimal equality -> 1.0 ("-28.0" counts); otherwise partial
    # credit len(oracle)/len(answer) when the oracle is a substring: "-280" -> 3/4; "28" does not
    # contain "-28" -> 0.
    assert r == [1.0, 1.0, 1.0, 0.75, 0.0, 0.0, 0.0, 0.0]
    b = REWARDS.get("correctness_binary")(comps, answer=["-28"] * 8, rg_dataset=["chain_sum"] * 8,
                                          rg_config=[{}] * 8, rg_entry=[chain_item.fields["rg_entry"]] * 8)
    assert b == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_correctness_exact_match_without_rg_entry():
    comps = ["4", " 4\n", "4.0", "44", ""]
    r = REWARDS.get("correctness")(comps, answer=["4"] * 5, solution=["4"] * 5, answer_format=["plain"] * 5)
    assert r == [1.0, 1.0, 0.0, 0.0, 0.0]  # string equality after strip: "4.0" is wrong here


def test_math_verify():
    comps = ["4", "4.0", "8/2", "5", "", " 4 "]
    r = REWARDS.get("math_verify")(comps, answer=["4"] * 6, answer_format=["plain"] * 6)
    assert r == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    r = REWARDS.get("math_verify")(["steps\n#### 0.5", "#### 1/3", "0.5"], answer=["1/2"] * 3, answer_format=["hash"] * 3)
    assert r == [1.0, 0.0, 0.0]  # the last has no #### line


def test_worked_solution_rewards(gsm_item):
    ans = gsm_item.answer
    comps = [gsm_item.solution, f"reasoning\n#### {ans}\n", f"I think {ans}", f"#### {int(ans) + 1}", ""]
    items = [gsm_item] * len(comps)
    total, per = compute_rewards(comps, items, [("correctness", 1.0), ("format", 0.5)])
    # gsm_symbolic's scorer gives 0.01 (not 0) to a wrong but well-formed number
    assert per["correctness"] == [1.0, 1.0, 0.0, 0.01, 0.0]
    assert per["format"] == [1.0, 1.0, 0.0, 1.0, 0.0]
    # total = 1.0*correctness + 0.5*format
    assert total == pytest.approx([1.5, 1.5, 0.0, 0.51, 0.0])
    b = REWARDS.get("correctness_binary")(comps, **{"answer": [ans] * 5, **{k: [v] * 5 for k, v in gsm_item.fields.items()}})
    assert b == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_compute_rewards_weighted_sum(chain_item):
    comps = ["-28", "-280", " ", "-28 "]
    items = [chain_item, chain_item, chain_item, PLAIN]
    total, per = compute_rewards(comps, items, [("correctness", 2.0), ("format", -0.5), ("correctness_binary", 1.0)])
    assert per["correctness"] == [1.0, 0.75, 0.0, 0.0]  # PLAIN's answer is "4", not "-28"
    assert per["format"] == [1.0, 1.0, 0.0, 1.0]
    assert per["correctness_binary"] == [1.0, 0.0, 0.0, 0.0]
    # 2*1 - 0.5*1 + 1 = 2.5 | 2*0.75 - 0.5 + 0 = 1.0 | 0 | 2*0 - 0.5 + 0 = -0.5
    assert all(math.isclose(a, b) for a, b in zip(total, [2.5, 1.0, 0.0, -0.5]))


def test_compute_rewards_errors(chain_item):
    with pytest.raises(ValueError, match="2 completions but 1 items"):
        compute_rewards(["a", "b"], [chain_item], [("correctness", 1.0)])
    with pytest.raises(ValueError, match="more than once"):
        compute_rewards(["a"], [chain_item], [("format", 1.0), ("format", 2.0)])
    with pytest.raises(ValueError, match="valid choices"):
        compute_rewards(["a"], [chain_item], [("nope", 1.0)])
    with pytest.raises(ValueError, match="reserved"):
        compute_rewards(["a"], [TaskItem("p", "a", "a", {"answer": 1})], [("format", 1.0)])


def test_is_correct(chain_item):
    assert is_correct(" -28\n", chain_item)
    assert not is_correct("-280", chain_item)  # partial credit 0.75 is not correct
    assert is_correct("4", PLAIN) and not is_correct("4.0", PLAIN)
    assert is_correct(chain_item.solution, chain_item)
