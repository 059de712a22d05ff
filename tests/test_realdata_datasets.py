"""Task data from `datasets`: local JSONL / parquet / CSV / save_to_disk, hub names (offline error),
field mapping, split selection, GSM8K (`#### 42`) and MATH (`\\boxed{}`) answers, and the checks that
run when the task is built (before any model loads)."""

from __future__ import annotations

import json

import pytest

from grpo_lab.rewards import compute_rewards
from grpo_lab.tasks import TASKS

GSM = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many now?",
        "answer": f"He has {i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1}"}
       for i in range(1, 13)]
MATH = [{"problem": f"What is $\\frac{{1}}{{{2 * i}}} + \\frac{{1}}{{{2 * i}}}$?",
         "solution": f"Adding gives $\\frac{{2}}{{{2 * i}}} = \\boxed{{\\frac{{1}}{{{i}}}}}$."} for i in range(1, 9)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def local(**kw):
    return TASKS.get("local_dataset")(**kw)


def test_gsm8k_style_hash_answers(tmp_path):
    f = _jsonl(tmp_path / "gsm.jsonl", GSM)
    t = local(path=str(f), prompt_field="question", answer_field="answer", solution_field="answer",
              answer_format="boxed_or_last", dev_size=2, test_size=2)
    items = [it for s in t.splits.values() for it in s]
    assert sorted(int(it.answer) for it in items) == [2 * i + 1 for i in range(1, 13)]
    it = t.splits["test"][0]
    # The warm-up target keeps the worked steps and ends in the answer written for an instruct model.
    assert it.solution.endswith(f"The answer is \\boxed{{{it.answer}}}.") and "####" not in it.solution
    total, _ = compute_rewards([f"so {it.answer}", f"The answer is {it.answer}.", "#### 0"], [it] * 3,
                               [("math_verify", 1.0)])
    assert total == [1.0, 1.0, 0.0]


def test_math_style_boxed_answers_checked_by_math_verify(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(MATH)
    ds.to_parquet(str(tmp_path / "math.parquet"))
    t = local(path=str(tmp_path / "math.parquet"), prompt_field="problem", answer_field="solution",
              solution_field="solution", answer_format="boxed", dev_size=2, test_size=2, seed=1)
    it = next(x for s in t.splits.values() for x in s if x.answer == "\\frac{1}{3}")
    total, _ = compute_rewards(["\\boxed{1/3}", "\\boxed{0.3333}", "\\boxed{\\dfrac{1}{3}}", "1/3"], [it] * 4,
                               [("math_verify", 1.0)])
    assert total == [1.0, 0.0, 1.0, 0.0]  # equivalence, not string match; "boxed" needs the box


def test_csv_save_to_disk_and_split_selection(tmp_path):
    import datasets

    rows = [{"q": f"{i}+1", "a": str(i + 1)} for i in range(10)]
    (tmp_path / "d.csv").write_text("q,a\n" + "".join(f"{r['q']},{r['a']}\n" for r in rows))
    t = local(path=str(tmp_path / "d.csv"), prompt_field="q", answer_field="a", dev_size=2, test_size=3)
    assert {s: len(v) for s, v in t.splits.items()} == {"train": 5, "dev": 2, "test": 3}
    # A DatasetDict saved with save_to_disk, its splits named freely and chosen with `splits`.
    dd = datasets.DatasetDict({"fit": datasets.Dataset.from_list(rows[:6]),
                               "heldout": datasets.Dataset.from_list(rows[6:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    t = local(path=str(tmp_path / "saved"), prompt_field="q", answer_field="a",
              splits={"train": "fit", "test": "heldout"}, dev_size=1)
    assert len(t.splits["test"]) == 4 and len(t.splits["dev"]) == 1 and len(t.splits["train"]) == 5
    assert t.splits["test"][0].answer == "7"
    # A single saved Dataset is the train split.
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert len(local(path=str(tmp_path / "one"), prompt_field="q", answer_field="a", dev_size=1,
                     test_size=1).splits["train"]) == 8
    # Pre-split files named in task.splits alone (what conf's comment on task.splits promises).
    _jsonl(tmp_path / "tr.jsonl", [{"prompt": r["q"], "answer": r["a"]} for r in rows[:7]])
    _jsonl(tmp_path / "te.jsonl", [{"prompt": r["q"], "answer": r["a"]} for r in rows[7:]])
    t = local(splits={"train": str(tmp_path / "tr.jsonl"), "test": str(tmp_path / "te.jsonl")}, dev_size=1)
    assert [len(t.splits[s]) for s in ("train", "dev", "test")] == [6, 1, 3]


def test_build_time_errors_name_file_split_and_row(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no rows"):
        local(path=str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not valid JSON"):
        local(path=str(bad))
    lacking = _jsonl(tmp_path / "lack.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2"}])
    with pytest.raises(ValueError, match=r"lack.jsonl, line 2: lacks columns \['answer'\]"):
        local(path=str(lacking))
    none = _jsonl(tmp_path / "none.jsonl", [{"prompt": f"{i}", "answer": "None" if i == 3 else "1"} for i in range(6)])
    with pytest.raises(ValueError, match=r"split 'train', row 4: the reference answer .* is 'None'"):
        local(path=str(none), dev_size=1, test_size=1)
    hashless = _jsonl(tmp_path / "h.jsonl", [{"prompt": f"{i}", "answer": "steps\n####  "} for i in range(4)])
    with pytest.raises(ValueError, match=r"row 1: the reference answer .* is ''"):
        local(path=str(hashless), dev_size=1, test_size=1)
    # CSV: an empty cell is a missing answer, not the string "None".
    (tmp_path / "c.csv").write_text("prompt,answer\n1+1,2\n2+2,\n3+3,6\n")
    with pytest.raises(ValueError, match=r"split 'train', row 2: the 'answer' field is empty or missing"):
        local(path=str(tmp_path / "c.csv"), dev_size=1, test_size=1)
    # An empty given split.
    _jsonl(tmp_path / "tr.jsonl", [{"prompt": "1", "answer": "1"}] * 3)
    (tmp_path / "te.jsonl").write_text("")
    with pytest.raises(ValueError, match="te.jsonl holds no rows"):
        local(splits={"train": str(tmp_path / "tr.jsonl"), "test": str(tmp_path / "te.jsonl")}, dev_size=1)
    # A file datasets cannot parse is named.
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"could not read .*x.parquet as parquet"):
        local(path=str(tmp_path / "x.parquet"))


def test_hub_name_offline_says_what_to_do(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # instant, never waits on the network
    with pytest.raises(RuntimeError, match=r"could not load 'openai/gsm8k' \(config 'main'\).*task.path="):
        local(path="openai/gsm8k", hub_config="main", prompt_field="question")


def test_config_validation_names_the_keys(tmp_path):
    from grpo_lab.config import register_configs, validate
    from grpo_lab.schema import ConfigError
    from hydra import compose, initialize_config_dir

    register_configs()  # what every entry point does before Hydra composes

    conf = str((__import__("pathlib").Path(__file__).parents[1] / "conf").resolve())
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        def errors(*overrides):
            cfg = compose("config", overrides=list(overrides))
            try:
                validate(cfg)
            except ConfigError as e:
                return str(e)
            return ""

        assert "task.chat_template='x.jinja' is neither" in errors("task.chat_template=x.jinja")
        assert "task.system_prompt is set but task.chat_template=none" in errors("task.chat_template=none",
                                                                                  "task.system_prompt=hi")
        assert "task.answer_format='last'" in errors("task.answer_format=last")
        assert "task.source=local_dataset needs task.path" in errors("task.source=local_dataset")
        assert errors("task.answer_format=boxed_or_last") == ""
        judge = errors("reward=llm_judge", "reward.timeout_s=30", "reward.judge.template=no_placeholder",
                       "reward.judge.builder=pretrained", "reward.judge.engine=nope", "reward.judge.score_max=0",
                       "reward.judge.gpu_memory_utilization=2")
        for key in ("reward.timeout_s=30.0 is too short", "reward.judge.template must contain '{completion}'",
                    "reward.judge.builder=pretrained needs reward.judge.path", "reward.judge.engine='nope'",
                    "reward.judge.score_max=0.0", "reward.judge.gpu_memory_utilization=2.0"):
            assert key in judge, (key, judge)
        assert errors("reward=llm_judge") == ""



def test_the_arrow_conversion_is_cached_under_the_runs_cache_dir(tmp_path):
    """datasets converts a JSONL file to Arrow and keeps it; a run's conversion goes to <cache_dir>/datasets,
    as every other cache of the run does, not to ~/.cache/huggingface."""
    from omegaconf import OmegaConf

    from grpo_lab.tasks import build_task

    f = _jsonl(tmp_path / "gsm.jsonl", GSM)
    section = OmegaConf.create({"source": "local_dataset", "path": str(f), "prompt_field": "question",
                                "answer_field": "answer", "dev_size": 2, "test_size": 2})
    task = build_task(section, cache_dir=str(tmp_path / "cache"))
    assert len(task.splits["train"]) == len(GSM) - 4
    assert any(p.suffix == ".arrow" for p in (tmp_path / "cache" / "datasets").rglob("*"))
