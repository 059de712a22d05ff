"""Bad data fails (or is reported) when the task is built, before any training, warm-up included:
a non-UTF-8 JSONL line names the file, the line and the fix; one prompt given with different answers
is a warning with its count and file, logged once; and a run is named after its data, not after the
default task."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import derive_run_name, finalize, register_configs
from grpo_lab.logging.recorder import run_tags
from grpo_lab.tasks import TASKS, task_label

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def test_a_non_utf8_jsonl_line_names_the_file_the_line_and_the_fix(tmp_path):
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "caf\xe9 2+2", "answer": "4"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl, line 2: not UTF-8 .*re-encode the file as UTF-8"):
        TASKS.get("local_dataset")(path=str(bad), dev_size=1, test_size=1)


def test_conflicting_duplicate_rows_warn_once_with_count_and_file(tmp_path, caplog):
    rows = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)]
    rows += [{"prompt": "1+1", "answer": "3"}, {"prompt": "2+2", "answer": "5"}, {"prompt": "3+3", "answer": "6"}]
    path = _jsonl(tmp_path / "dups.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="grpo_lab.tasks.local_dataset"):
        TASKS.get("local_dataset")(path=str(path), dev_size=1, test_size=1)
    warned = [r.getMessage() for r in caplog.records if "different reference answers" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "dups.jsonl" in warned[0] and ": 2 prompt(s)" in warned[0]


def test_agreeing_duplicate_rows_do_not_warn(tmp_path, caplog):
    path = _jsonl(tmp_path / "same.jsonl", [{"prompt": f"{i % 4}+1", "answer": str(i % 4 + 1)} for i in range(8)])
    with caplog.at_level(logging.WARNING, logger="grpo_lab.tasks.local_dataset"):
        TASKS.get("local_dataset")(path=str(path), dev_size=1, test_size=1)
    assert not [r for r in caplog.records if "different reference answers" in r.getMessage()]


@pytest.mark.parametrize("overrides,label", [
    (["task.source=local_dataset", "task.path=/data/gsm8k_train.jsonl"], "gsm8k_train"),
    (["task.source=local_dataset", "task.path=openai/gsm8k"], "gsm8k"),
    (["task.source=local_dataset", "task.splits={train: /d/arith.parquet, test: /d/arith_test.parquet}"], "arith"),
    (["task.source=robust_plugins:make_task"], "make_task"),
    (["task=gcd"], "gcd"),
])
def test_runs_are_named_and_tagged_after_their_data(overrides, label):
    cfg = compose_cfg(overrides)
    assert task_label(cfg.task) == label
    assert derive_run_name(cfg).startswith(f"{label}_") and cfg.run_name.startswith(f"{label}_")
    assert f"task={label}" in run_tags(cfg, [], [])
