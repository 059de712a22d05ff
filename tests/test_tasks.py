"""Task sources: reasoning_gym and local_dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lab.tasks import TASKS, Task, TaskItem

CALIB = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)


def rg(**kw):
    return TASKS.get("reasoning_gym")(**kw)


@pytest.fixture(scope="module")
def chain_sum():
    return rg(name="chain_sum", dataset_kwargs=CALIB, prompt_format="compact", train_size=3000, dev_size=200, test_size=200)


def test_registry_names():
    assert {"reasoning_gym", "local_dataset"} <= set(TASKS.names())


def test_chain_sum_compact_format(chain_sum):
    first = chain_sum.splits["train"][0]
    # train_seed=0, item 0 is the example the docstrings use ("15-43=" -> "-28")
    assert (first.prompt, first.answer, first.solution) == ("15-43=", "-28", "-28")
    assert first.fields["answer_format"] == "plain"
    assert first.fields["rg_dataset"] == "chain_sum"
    assert first.fields["rg_entry"]["metadata"]["expression"] == "15 - 43"
    for it in chain_sum.splits["dev"] + chain_sum.splits["test"]:
        assert " " not in it.prompt and it.prompt.endswith("=")
        a, op, b = it.prompt[:2], it.prompt[2], it.prompt[3:5]
        assert len(it.prompt) == 6 and op in "+-"
        assert int(it.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert chain_sum.alphabet() == "+-0123456789="


def test_split_sizes_and_dedupe(chain_sum):
    info = chain_sum.info
    assert len(chain_sum.splits["dev"]) == 200 and len(chain_sum.splits["test"]) == 200
    held_out = {it.prompt for s in ("dev", "test") for it in chain_sum.splits[s]}
    assert not any(it.prompt in held_out for it in chain_sum.splits["train"])
    # 2-digit pairs with +/-: 90*90*2 = 16,200 distinct prompts; 3,000 train draws against ~400
    # held-out prompts collide about 3000*400/16200 ~ 74 times, so some items must be removed.
    assert info["train_removed_overlap"] > 0
    assert len(chain_sum.splits["train"]) == 3000 - info["train_removed_overlap"]
    assert info["sizes"]["train"] == len(chain_sum.splits["train"])


def test_deterministic():
    a = rg(name="chain_sum", dataset_kwargs=CALIB, prompt_format="compact", train_size=50, dev_size=5, test_size=5)
    b = rg(name="chain_sum", dataset_kwargs=CALIB, prompt_format="compact", train_size=50, dev_size=5, test_size=5)
    assert [i.prompt for i in a.splits["train"]] == [i.prompt for i in b.splits["train"]]


def test_question_format():
    t = rg(name="chain_sum", dataset_kwargs=CALIB, train_size=5, dev_size=2, test_size=2)
    assert t.splits["train"][0].prompt == "State the final answer to the following arithmetic problem: 15 - 43 ="
    t = rg(name="chain_sum", dataset_kwargs=CALIB, train_size=2, dev_size=0, test_size=1, prompt_template="Q: {prompt}\nA:")
    assert t.splits["train"][0].prompt.startswith("Q: State") and t.splits["dev"] == []


def test_seed_separation_error():
    with pytest.raises(ValueError, match="too close"):
        rg(name="chain_sum", train_size=100, dev_size=10, test_size=10, dev_seed=50)
    # exactly adjacent ranges are fine: train [0, 100), dev [100, 110), test [110, 120)
    t = rg(name="chain_sum", train_size=100, dev_size=10, test_size=10, dev_seed=100, test_seed=110)
    assert len(t.splits["dev"]) == 10


def test_unknown_generator_error():
    with pytest.raises(ValueError, match="unknown reasoning-gym generator 'chainsum'.*chain_sum"):
        rg(name="chainsum")


def test_compact_undefined_error():
    with pytest.raises(ValueError, match="'compact' is not defined for generator 'gsm_symbolic'"):
        rg(name="gsm_symbolic", prompt_format="compact")


def test_running_sums_by_hand():
    from grpo_lab.tasks.reasoning_gym_source import running_sums

    assert running_sums("12 + 34 - 5") == "46,41"
    assert running_sums("3 - -8 + -1") == "11,10"     # negative terms (allow_negation)
    assert running_sums("15 - 43") == "-28"            # two terms: chain_sum's own answer


def test_partial_sums_long_answers_scored_by_exact_match():
    from omegaconf import OmegaConf

    from grpo_lab.rewards import is_correct
    from grpo_lab.tasks import build_task

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "task" / "partial_sums.yaml")
    cfg.train_size, cfg.dev_size, cfg.test_size = 300, 20, 300
    t = build_task(cfg)
    item = t.splits["test"][0]
    assert item.answer.split(",")[-1] == str(eval(item.prompt.rstrip("=")))   # last total = the sum
    assert len(item.answer.split(",")) == item.prompt.count("+") + item.prompt.count("-")
    lengths = {len(it.answer) for it in t.splits["test"]}
    assert min(lengths) <= 5 and max(lengths) >= 14          # variable length, up to the 16-token budget
    assert "rg_entry" not in item.fields                      # not chain_sum's scorer (final sum only)
    assert is_correct(item.answer, item) and not is_correct(item.answer.split(",")[-1], item)
    assert "," in t.alphabet()


def test_partial_sums_is_defined_only_for_chain_sum():
    with pytest.raises(ValueError, match="'partial_sums' is defined only for chain_sum"):
        rg(name="basic_arithmetic", prompt_format="partial_sums", train_size=5, dev_size=1, test_size=1)


def test_bad_dataset_kwargs_error():
    with pytest.raises(ValueError, match="Valid dataset_kwargs for chain_sum: min_terms"):
        rg(name="chain_sum", dataset_kwargs={"min_term": 2}, train_size=2, dev_size=1, test_size=1)
    with pytest.raises(ValueError, match="must not set"):
        rg(name="chain_sum", dataset_kwargs={"seed": 1})


def test_gsm_symbolic_worked_solutions():
    t = rg(name="gsm_symbolic", train_size=40, dev_size=2, test_size=2)
    for it in t.splits["train"]:
        assert it.fields["answer_format"] == "hash"
        assert it.solution.endswith(f"\n#### {it.answer}")  # answer_cot sometimes says "#### 8.0"
        assert it.solution.count("####") == 1


def test_basic_arithmetic_compact():
    t = rg(name="basic_arithmetic", prompt_format="compact", train_size=5, dev_size=1, test_size=1)
    it = t.splits["train"][0]
    assert it.prompt == it.fields["rg_entry"]["metadata"]["expression"].replace(" ", "") + "="


def test_alphabet_covers_everything():
    t = Task("x", {"train": [TaskItem("ab", "c", "d\n", {})], "dev": [TaskItem("e", "f", "f", {})], "test": []})
    assert t.alphabet() == "\nabcdef"
    with pytest.raises(ValueError, match="lacks splits"):
        Task("x", {"train": []})


# --- local_dataset -----------------------------------------------------------------------------


@pytest.fixture()
def jsonl(tmp_path):
    rows = [
        {"question": f"{a}+{b}=", "answer": f"{a}+{b} is {a + b}\n#### {a + b}", "id": 10 * a + b}
        for a in range(10)
        for b in range(10)
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_local_jsonl_carves_splits(jsonl):
    t = TASKS.get("local_dataset")(
        path=str(jsonl), prompt_field="question", answer_field="answer", solution_field="answer",
        answer_format="hash", dev_size=10, test_size=20, extra_fields=["id"],
    )
    assert [len(t.splits[s]) for s in ("train", "dev", "test")] == [70, 10, 20]
    it = t.splits["train"][0]
    a, b = divmod(it.fields["id"], 10)
    assert it.prompt == f"{a}+{b}=" and it.answer == str(a + b)  # extracted from "#### n"
    assert it.solution == f"{a}+{b} is {a + b}\n#### {a + b}"
    all_prompts = [i.prompt for s in t.splits.values() for i in s]
    assert len(set(all_prompts)) == 100  # disjoint
    t2 = TASKS.get("local_dataset")(path=jsonl, prompt_field="question", answer_field="answer",
                                     answer_format="hash", dev_size=10, test_size=20)
    assert [i.prompt for i in t2.splits["test"]] == [i.prompt for i in t.splits["test"]]  # seeded
    assert t2.splits["train"][0].solution == f"#### {t2.splits['train'][0].answer}"


def test_local_split_files_and_dedupe(tmp_path):
    train = [{"prompt": p, "answer": "1"} for p in ("a", "b", "c", "d")]
    test = [{"prompt": p, "answer": "1"} for p in ("c", "x")]
    for name, rows in (("tr.jsonl", train), ("te.jsonl", test)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = TASKS.get("local_dataset")(
        path={"train": str(tmp_path / "tr.jsonl"), "test": str(tmp_path / "te.jsonl")}, dev_size=1, test_size=None
    )
    assert [i.prompt for i in t.splits["test"]] == ["c", "x"]
    assert len(t.splits["dev"]) == 1
    assert "c" not in [i.prompt for i in t.splits["train"]]
    assert t.info["train_removed_overlap"] == 1
    assert len(t.splits["train"]) == 2


def test_local_errors(tmp_path, jsonl, monkeypatch):
    import datasets

    with pytest.raises(FileNotFoundError, match="does not exist"):
        TASKS.get("local_dataset")(path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="lacks columns"):
        TASKS.get("local_dataset")(path=str(jsonl), prompt_field="prompt")
    # a hub name: fails offline, message says to pass a local file (offline mode keeps it instant)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="download the dataset file"):
        TASKS.get("local_dataset")(path="openai/gsm8k")
