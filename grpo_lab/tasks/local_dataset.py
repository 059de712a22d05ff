"""Task source ``local_dataset``: a JSONL/JSON/parquet/CSV file (or files), or a HF hub dataset.

Files load with ``datasets.load_dataset("json" | "parquet" | "csv", data_files=...)``; anything
that is not an existing path is treated as a hub name (``load_dataset(name)``), which fails here
without network: the error then says to download the file and pass its local path.

Splits: ``path`` may be one file, or a mapping of split name -> file. Each of our splits
(train/dev/test) is taken from the source split named in ``splits`` (default: train <- "train",
dev <- "dev" or "validation", test <- "test", where present). A split the source lacks is carved
from the source's train split after a seeded shuffle (test first, then dev), ``test_size`` /
``dev_size`` items each. For a split the source has, the size caps it (first N rows; ``None``
keeps all). Train rows whose prompt is also a dev/test prompt are removed (before carving, so
carved splits stay disjoint from given ones too), as for reasoning-gym.

GSM8K-style data (``answer`` holds worked steps ending in ``#### 72``): pass
``answer_field="answer", solution_field="answer", answer_format="hash"``; the reference answer
is then extracted from the field with the format's rule (here: ``72``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_lab.rewards.answers import check_answer_format, extract_answer, format_solution

from .base import SPLITS, TASKS, Task, TaskItem, remove_train_overlap

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
DEFAULT_SOURCE_SPLITS = {"train": ("train",), "dev": ("dev", "validation", "valid"), "test": ("test",)}


def _builder_for(files: Sequence[str]) -> str:
    kinds = set()
    for f in files:
        suffixes = Path(f).suffixes
        ext = next((s for s in reversed(suffixes) if s in FILE_BUILDERS), None)
        if ext is None:
            raise ValueError(
                f"cannot tell the format of {f!r} from its extension; use one of {', '.join(FILE_BUILDERS)}"
            )
        kinds.add(FILE_BUILDERS[ext])
    if len(kinds) != 1:
        raise ValueError(f"all data files must have one format, got {sorted(kinds)} for {list(files)}")
    return kinds.pop()


def _looks_like_file(p: str) -> bool:
    return any(p.endswith(ext) for ext in FILE_BUILDERS) or p.startswith(("/", "./", "../", "~"))


def check_jsonl(path: str | Path, required: Sequence[str] = ()) -> int:
    """Read a JSON-lines file line by line; raise naming the file and line for what ``datasets``
    reports badly (an empty file: a bare StopIteration; a malformed line: no file or line number).
    Returns the number of rows. ``required`` fields must be present and non-null on every row."""
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}): "
                                 f"{line.strip()[:120]!r}. Each line of a .jsonl file must be one JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {lineno}: a JSON {type(row).__name__}, not an object "
                                 "with named fields")
            for key in required:
                if row.get(key) is None:
                    raise ValueError(
                        f"{path}, line {lineno}: lacks columns [{key!r}] (no {key!r} field; its fields: {sorted(row)}). Add it, or name "
                        f"the field that holds it (task.prompt_field / task.answer_field / task.solution_field)")
            n += 1
    if n == 0:
        raise ValueError(f"{path} holds no rows (the file is empty): point task.path at a JSONL file with "
                         "one JSON object per line")
    return n


def load_source(path: str | Mapping[str, str]) -> dict[str, Any]:
    """``{source split name: datasets.Dataset}`` from local file(s) or a hub name."""
    import datasets

    if isinstance(path, Mapping):
        data_files = {str(k): str(Path(v).expanduser()) for k, v in path.items()}
        for f in data_files.values():
            if not Path(f).is_file():
                raise FileNotFoundError(f"data file {f!r} does not exist")
        return dict(datasets.load_dataset(_builder_for(list(data_files.values())), data_files=data_files))
    path = str(path)
    p = Path(path).expanduser()
    if p.is_file():
        return dict(datasets.load_dataset(_builder_for([str(p)]), data_files={"train": str(p)}))
    if p.is_dir():
        return dict(datasets.load_dataset(str(p)))
    if _looks_like_file(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        return dict(datasets.load_dataset(path))
    except Exception as e:  # offline: ConnectionError, LocalEntryNotFoundError, DatasetNotFoundError...
        raise RuntimeError(
            f"could not load {path!r} from the Hugging Face hub ({type(e).__name__}: {e}). The hub is not "
            "reachable from this machine: download the dataset file (JSONL/parquet/CSV) elsewhere and pass "
            "its local path, e.g. task.path=/data/gsm8k_train.jsonl"
        ) from e


def check_local_dataset(t: Any, errors: list[str]) -> None:
    """task.source=local_dataset settings."""
    if not t.path and not t.splits:
        errors.append("task.source=local_dataset needs task.path=/path/to/data.jsonl (or .parquet/.csv; a "
                      "mapping task.splits={train: a.jsonl, test: b.jsonl} for pre-split data)")


@TASKS.register("local_dataset", check=check_local_dataset)
def local_dataset_task(
    *,
    path: str | Mapping[str, str],
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str | None = None,
    splits: Mapping[str, str] | None = None,
    train_size: int | None = None,
    dev_size: int | None = 200,
    test_size: int | None = 200,
    seed: int = 0,
    answer_format: str = "plain",
    prompt_template: str = "{prompt}",
    extra_fields: Sequence[str] = (),
    name: str | None = None,
) -> Task:
    """Build a Task from tabular data; see the module docstring for split handling.

    ``solution_field`` defaults to the answer. ``extra_fields`` columns are copied into
    ``TaskItem.fields`` (so reward functions receive them).
    """
    check_answer_format(answer_format)
    if "{prompt}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
    needed = [prompt_field, answer_field, *([solution_field] if solution_field else []), *extra_fields]
    files = dict(path) if isinstance(path, Mapping) else {"": str(path)}
    for f in files.values():
        if str(f).endswith(".jsonl") and Path(str(f)).expanduser().is_file():
            check_jsonl(Path(str(f)).expanduser(), needed)
    source = load_source(path)
    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    mapping = dict(splits) if splits is not None else {}
    for ours in SPLITS:
        if ours not in mapping:
            found = next((s for s in DEFAULT_SOURCE_SPLITS[ours] if s in source), None)
            if found is not None:
                mapping[ours] = found
    for ours, src in mapping.items():
        if ours not in SPLITS:
            raise ValueError(f"splits keys must be among {SPLITS}, got {ours!r}")
        if src not in source:
            raise ValueError(f"splits[{ours!r}]={src!r} is not a split of {path!r}; it has {sorted(source)}")
    if "train" not in mapping:
        raise ValueError(f"{path!r} has no train split (splits: {sorted(source)}); set splits.train=<name>")

    def rows(ds: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in ds]

    train_rows = rows(source[mapping["train"]])
    if not train_rows:
        raise ValueError(f"{path!r}: the train split {mapping['train']!r} has no rows; task.path must hold data")
    columns = set(train_rows[0])
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"{path!r} lacks columns {missing}; its columns are {sorted(columns)}. Set "
                         "task.prompt_field / task.answer_field / task.solution_field to the right names")
    for s_name in {mapping[s] for s in mapping}:
        for i, r in enumerate(rows(source[s_name])):
            for c in needed:
                if r.get(c) is None:
                    raise ValueError(f"{path!r}, split {s_name!r}, row {i + 1}: the {c!r} field is empty or "
                                     "missing; every row needs it")

    raw: dict[str, list[dict[str, Any]]] = {}
    for s in ("dev", "test"):
        if s in mapping:
            raw[s] = rows(source[mapping[s]])
            if sizes[s] is not None:
                raw[s] = raw[s][: int(sizes[s])]
    # Drop source-train rows that repeat a given dev/test prompt BEFORE carving, so a carved dev
    # split cannot pick up a test prompt either.
    given = {str(r[prompt_field]) for s in raw for r in raw[s]}
    n_source = len(train_rows)
    train_rows = [r for r in train_rows if str(r[prompt_field]) not in given]
    removed_before_carving = n_source - len(train_rows)
    carved = [s for s in ("test", "dev") if s not in mapping]
    if carved:
        random.Random(seed).shuffle(train_rows)
        for s in carved:
            n = sizes[s]
            if n is None:
                raise ValueError(f"{s}_size must be set: the {s} split is carved from the train split")
            if n >= len(train_rows):
                raise ValueError(f"cannot carve {s}_size={n} items from {len(train_rows)} train rows")
            raw[s], train_rows = train_rows[:n], train_rows[n:]
    raw["train"] = train_rows if train_size is None else train_rows[: int(train_size)]

    def item(r: dict[str, Any]) -> TaskItem:
        ans_raw = str(r[answer_field])
        answer = extract_answer(ans_raw, answer_format) or ans_raw.strip()
        if solution_field:
            sol_raw = str(r[solution_field])
            solution = sol_raw if answer_format == "plain" else format_solution(answer, answer_format, sol_raw)
        else:
            solution = format_solution(answer, answer_format)
        fields = {"answer_format": answer_format, **{k: r[k] for k in extra_fields}}
        return TaskItem(prompt=prompt_template.replace("{prompt}", str(r[prompt_field])), answer=answer,
                        solution=solution, fields=fields)

    out = {s: [item(r) for r in raw[s]] for s in SPLITS}
    task_name = name or (Path(str(path)).stem if not isinstance(path, Mapping) else "local_dataset")
    overlap = remove_train_overlap(out, task_name)
    overlap["train_removed_overlap"] += removed_before_carving
    info = {
        "source": "local_dataset",
        "path": str(path) if not isinstance(path, Mapping) else dict(path),
        "split_map": mapping,
        "carved": carved,
        "sizes": {s: len(v) for s, v in out.items()},
        **overlap,
    }
    return Task(name=task_name, splits=out, info=info)

