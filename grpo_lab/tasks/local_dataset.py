"""Task source ``local_dataset``: a JSONL/JSON/parquet/CSV file (or files), a ``save_to_disk``
directory, or a HF hub dataset.

Files load with ``datasets.load_dataset("json" | "parquet" | "csv", data_files=...)``; a directory
written by ``Dataset(Dict).save_to_disk`` with ``datasets.load_from_disk``; any other directory
with ``load_dataset(dir)``; anything that is not an existing path is treated as a hub name
(``load_dataset(name, hub_config)``, e.g. ``task.path=openai/gsm8k task.hub_config=main``), which
fails here without network: the error then says to download the file and pass its local path.

Splits: ``path`` may be one file, or a mapping of split name -> file; ``splits`` may also map our
splits straight to files (``splits={train: a.jsonl, test: b.jsonl}`` with no ``path``). Each of our
splits (train/dev/test) is taken from the source split named in ``splits`` (default: train <- "train",
dev <- "dev" or "validation", test <- "test", where present). A split the source lacks is carved
from the source's train split after a seeded shuffle (test first, then dev), ``test_size`` /
``dev_size`` items each. For a split the source has, the size caps it (first N rows; ``None``
keeps all). Train rows whose prompt is also a dev/test prompt are removed (before carving, so
carved splits stay disjoint from given ones too), as for reasoning-gym.

Reference answers (:func:`reference_answer`): GSM8K-style fields holding worked steps that end
in ``#### 72`` give ``72``; MATH-style fields holding ``\\boxed{...}`` give the boxed content; any
other value is the answer as written (stripped). So GSM8K needs only
``prompt_field=question answer_field=answer solution_field=answer`` (the worked steps become the
warm-up target, ending in the answer written in ``answer_format``), e.g.
``task.source=local_dataset task.path=/data/gsm8k_train.jsonl task.prompt_field=question
task.solution_field=answer task.answer_format=boxed_or_last task.max_completion_tokens=256
model=smollm2_135m rollout.max_model_len=1024 reward=math_verify`` (or, where the hub is reachable,
``task.path=openai/gsm8k task.hub_config=main``); and MATH
``prompt_field=problem answer_field=solution solution_field=solution``. Answers are checked by
``reward=math_verify`` (equivalence, e.g. ``1/2`` = ``\\frac{1}{2}``) or ``correctness`` (exact).

Checked when the task is built, before any model loads (every split, every row): an empty split,
a malformed or non-UTF-8 JSONL line (file and line named), a file ``datasets`` cannot read (file named), a row
without the prompt or answer field (split and row named), and an answer that comes out empty or
``None``/``nan`` are errors, never a silent reference answer of ``"None"``. One prompt given with
different answers is a warning (file and count named), logged once per load.
"""

from __future__ import annotations

import functools
import json
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_lab.rewards.answers import check_answer_format, extract_answer, format_solution

# Reference answers that mean "no answer": a null written out by str(), pandas' NaN, an empty cell.
_NO_ANSWER = {"", "none", "nan", "null"}

from .base import SPLITS, TASKS, Task, TaskItem, remove_train_overlap

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
log = logging.getLogger(__name__)

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


def read_jsonl(path: str | Path, required: Sequence[str] = (), *, key: str = "task.path",
               fix: str = "name the field that holds it (task.prompt_field / task.answer_field / "
                          "task.solution_field)") -> list[dict]:
    """The rows of a JSON-lines file, read line by line so every problem names the file and line
    (``datasets`` reports an empty file as a bare StopIteration and a malformed line with neither).
    ``required`` fields must be present and non-null on every row; ``key`` is the config key that
    named the file and ``fix`` says what to do about a missing field."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode_line(raw, path, lineno)
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
            for field_name in required:
                if row.get(field_name) is None:
                    raise ValueError(f"{path}, line {lineno}: lacks columns [{field_name!r}] (no {field_name!r} field; "
                                     f"its fields: {sorted(row)}). Add it, or {fix}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows (the file is empty): point {key} at a JSONL file with "
                         "one JSON object per line")
    return rows


def _decode_line(raw: bytes, path: str | Path, lineno: int) -> str:
    """One line of a data file as UTF-8 text; else an error naming the file, the line and the fix."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                         f"{e.start + 1}); re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > "
                         "fixed.jsonl` (with the file's real encoding for latin1)") from None


def check_jsonl(path: str | Path, required: Sequence[str] = ()) -> int:
    """Number of rows of a JSON-lines task file (errors as :func:`read_jsonl`)."""
    return len(read_jsonl(path, required))


def reference_answer(raw: Any, answer_format: str) -> str:
    """The reference answer in a dataset field: after the last ``####`` (GSM8K), else inside the last
    ``\\boxed{}`` (MATH), else as the answer format reads it, else the value stripped. ``""`` when none."""
    if raw is None or (isinstance(raw, float) and raw != raw):  # None, NaN (an empty CSV/parquet cell)
        return ""
    text = str(raw)
    for fmt in ("hash", "boxed"):
        marked = ("####" in text) if fmt == "hash" else ("\\boxed{" in text or "\\fbox{" in text)
        if marked:
            return extract_answer(text, fmt) or ""
    return (extract_answer(text, answer_format) if answer_format in ("tags",) else None) or text.strip()


def warn_conflicting_duplicates(path: Any, tables: Sequence[Any], prompt_field: str, answer_field: str,
                                answer_format: str) -> int:
    """Warn once, naming the data, when one prompt appears with different reference answers: the reward
    of such a prompt then depends on which row was drawn, and no policy can be right on all of them.
    Returns the number of such prompts (0: nothing is logged)."""
    answers: dict[str, set[str]] = {}
    for table in tables:
        for r in table:
            answers.setdefault(str(r[prompt_field]), set()).add(reference_answer(r[answer_field], answer_format))
    conflicting = {p: a for p, a in answers.items() if len(a) > 1}
    if conflicting:
        prompt, seen = next(iter(conflicting.items()))
        where = dict(path) if isinstance(path, Mapping) else str(path)
        log.warning("%s: %d prompt(s) appear more than once with different reference answers (e.g. %r -> %s); "
                    "their reward depends on which row is drawn: keep one answer per prompt in the file",
                    where, len(conflicting), prompt[:80], sorted(seen)[:4])
    return len(conflicting)


def _is_save_to_disk_dir(p: Path) -> bool:
    # Dataset.save_to_disk writes state.json + dataset_info.json; DatasetDict.save_to_disk writes
    # dataset_dict.json with one such directory per split (datasets/arrow_dataset.py, dataset_dict.py).
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _load_files(builder: str, data_files: dict[str, str], cache_dir: str | None = None) -> dict[str, Any]:
    import datasets

    try:
        return dict(datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir))
    except Exception as e:  # datasets' own messages rarely name the file (a bare StopIteration, ArrowInvalid)
        raise ValueError(f"could not read {', '.join(data_files.values())} as {builder} ({type(e).__name__}: "
                         f"{e}). Check the file's format and contents") from e


def load_source(path: str | Mapping[str, str], hub_config: str | None = None,
                cache_dir: str | None = None) -> dict[str, Any]:
    """``{source split name: datasets.Dataset}`` from local file(s), a ``save_to_disk`` directory,
    another local directory, or a hub name (``hub_config``: the hub dataset's configuration). ``cache_dir``:
    where ``datasets`` keeps its Arrow conversion (its default is ~/.cache/huggingface/datasets)."""
    import datasets

    if isinstance(path, Mapping):
        data_files = {str(k): str(Path(v).expanduser()) for k, v in path.items()}
        for f in data_files.values():
            if not Path(f).is_file():
                raise FileNotFoundError(f"data file {f!r} does not exist")
        return _load_files(_builder_for(list(data_files.values())), data_files, cache_dir)
    path = str(path)
    p = Path(path).expanduser()
    if p.is_file():
        return _load_files(_builder_for([str(p)]), {"train": str(p)}, cache_dir)
    if p.is_dir():
        if _is_save_to_disk_dir(p):
            loaded = datasets.load_from_disk(str(p))
            # A single saved Dataset is the train split; a DatasetDict keeps its own split names.
            return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        return dict(datasets.load_dataset(str(p), cache_dir=cache_dir))
    if _looks_like_file(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        return dict(datasets.load_dataset(path, hub_config, cache_dir=cache_dir))
    except Exception as e:  # offline: ConnectionError, LocalEntryNotFoundError, DatasetNotFoundError...
        raise RuntimeError(
            f"could not load {path!r}{f' (config {hub_config!r})' if hub_config else ''} from the Hugging Face "
            f"hub ({type(e).__name__}: {e}). If the hub is not reachable from this machine, download the dataset file "
            "(JSONL/parquet/CSV, or a save_to_disk directory) elsewhere and pass its local path, e.g. "
            "task.path=/data/gsm8k_train.jsonl"
        ) from e


def data_digest(files: Sequence[str]) -> str | None:
    """sha256 of the bytes of the local files (a directory: every file in it, by relative name) a dataset
    is read from; None when one of them is not local (a hub name). Caches built from the data (the
    warm-up) are keyed by it, so a file edited in place is not mistaken for the one a cache was built on."""
    digest = hashlib.sha256()
    for name in files:
        p = Path(str(name)).expanduser()
        if not p.exists():
            return None
        for f in sorted(q for q in ([p] if p.is_file() else p.rglob("*")) if q.is_file()):
            digest.update(f"{f.relative_to(p) if f != p else ''}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _split_files(splits: Mapping[str, str] | None) -> dict[str, str] | None:
    """``splits`` when every value names a data file (``{train: a.jsonl, test: b.jsonl}``), else None."""
    if not splits:
        return None
    vals = [str(v) for v in splits.values()]
    return dict(splits) if all(_looks_like_file(v) or Path(v).expanduser().is_file() for v in vals) else None


def check_local_dataset(t: Any, errors: list[str]) -> None:
    """task.source=local_dataset settings (the data itself is checked when the task is built, which
    is still before any model loads)."""
    from omegaconf import OmegaConf

    if t.splits is not None and not (OmegaConf.is_dict(t.splits) or isinstance(t.splits, Mapping)):
        errors.append(f"task.splits={t.splits!r} must map split names to source splits or files, written with "
                      "braces, e.g. task.splits={train: a.jsonl, test: b.jsonl}, or null")
        return
    if not t.path and not _split_files(t.splits):
        errors.append("task.source=local_dataset needs task.path=/path/to/data.jsonl (or .parquet/.csv, a "
                      "save_to_disk directory, or a hub name such as openai/gsm8k with task.hub_config=main), or "
                      "task.splits={train: a.jsonl, test: b.jsonl} for pre-split files")
    for key in ("prompt_field", "answer_field"):
        if not t[key]:
            errors.append(f"task.{key} is empty: name the dataset column that holds the {key.split('_')[0]}")


def local_dataset_label(t: Any) -> str:
    """The data's name for run names and tags: the stem of task.path (a hub name's last part), else of
    the train file in task.splits; the default task's name would call every local dataset chain_sum."""
    path = t.path or _split_files(t.splits) or "local_dataset"
    if isinstance(path, Mapping):
        path = path.get("train") or next(iter(path.values()))
    name = Path(str(path).rstrip("/")).name
    return next((name[: -len(ext)] for ext in FILE_BUILDERS if name.endswith(ext)), name) or "local_dataset"


def _resolve_path(path: Any, splits: Mapping[str, str] | None) -> tuple[Any, Mapping[str, str] | None]:
    """``(path, splits)`` with files named in ``splits`` moved to ``path`` (their keys are then our
    split names); the files come from one of the two, never both."""
    if path is None:
        path = _split_files(splits)
        if path is None:
            raise ValueError("local_dataset needs path=<file, directory or hub name>, or splits={train: a.jsonl, "
                             "...} naming files")
        splits = None  # the files' keys are our split names
    elif _split_files(splits) is not None:
        raise ValueError(f"give the files either in path or in splits, not both (path={path!r}, splits={dict(splits)})")
    return path, splits


def _check_local_files(path: Any, needed: list[str]) -> dict[str, str]:
    """The data files named by ``path`` (key: our split name, or "" for one file), each local JSONL
    file checked line by line for the ``needed`` fields."""
    files = dict(path) if isinstance(path, Mapping) else {"": str(path)}
    for f in files.values():
        if str(f).endswith(".jsonl") and Path(str(f)).expanduser().is_file():
            check_jsonl(Path(str(f)).expanduser(), needed)
    return files


def _split_mapping(source: Any, splits: Mapping[str, str] | None, path: Any) -> dict[str, str]:
    """Our split name -> the source's split: ``splits`` as given, the others found by their usual
    names (``DEFAULT_SOURCE_SPLITS``); a train split is required."""
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
    return mapping


def _check_split_rows(ds: Any, path: Any, ours: str, s_name: str, needed: list[str], prompt_field: str,
                      answer_field: str, answer_format: str) -> None:
    """ValueError naming the row and the fix when source split ``s_name`` is empty, lacks a needed
    column, has a row with a needed field empty, or a row whose reference answer reads as none."""
    if len(ds) == 0:
        raise ValueError(f"{path!r}: the {s_name!r} split (our {ours} split) has no rows; every split must hold "
                         "data (or leave dev/test out of task.splits to carve them from train)")
    columns = set(ds.column_names)
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"{path!r}, split {s_name!r}, lacks columns {missing}; its columns are "
                         f"{sorted(columns)}. Set task.prompt_field / task.answer_field / task.solution_field "
                         "to the right names")
    for i, r in enumerate(ds):
        for c in needed:
            v = r.get(c)
            if v is None or (isinstance(v, float) and v != v) or (c == prompt_field and not str(v).strip()):
                raise ValueError(f"{path!r}, split {s_name!r}, row {i + 1}: the {c!r} field is empty or "
                                 "missing; every row needs it")
        ans = reference_answer(r[answer_field], answer_format)
        if ans.strip().lower() in _NO_ANSWER:
            raise ValueError(f"{path!r}, split {s_name!r}, row {i + 1}: the reference answer read from "
                             f"{answer_field!r} ({str(r[answer_field])[-80:]!r}) is {ans!r}; fix the row, or "
                             "point task.answer_field at the column holding the answer")


def _rows(ds: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in ds]


def _carve_splits(source: Any, mapping: dict[str, str], sizes: dict[str, int | None], prompt_field: str,
                  seed: int) -> tuple[dict[str, list[dict[str, Any]]], int, list[str]]:
    """The rows of each split (train not yet cut to train_size), how many source-train rows repeated a
    given dev/test prompt, and the splits carved from train."""
    train_rows = _rows(source[mapping["train"]])
    raw: dict[str, list[dict[str, Any]]] = {}
    for s in ("dev", "test"):
        if s in mapping:
            raw[s] = _rows(source[mapping[s]])
            if sizes[s] is not None:
                raw[s] = raw[s][: int(sizes[s])]
    # Source-train rows that repeat a given dev/test prompt are dropped BEFORE carving, so a carved
    # dev split cannot pick up a test prompt either.
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
    raw["train"] = train_rows
    return raw, removed_before_carving, carved


def _task_item(r: dict[str, Any], *, prompt_field: str, answer_field: str, solution_field: str | None,
               answer_format: str, prompt_template: str, extra_fields: Sequence[str]) -> TaskItem:
    answer = reference_answer(r[answer_field], answer_format)
    if solution_field:
        sol_raw = str(r[solution_field])
        solution = sol_raw if answer_format == "plain" else format_solution(answer, answer_format, sol_raw)
    else:
        solution = format_solution(answer, answer_format)
    fields = {"answer_format": answer_format, **{k: r[k] for k in extra_fields}}
    return TaskItem(prompt=prompt_template.replace("{prompt}", str(r[prompt_field])), answer=answer,
                    solution=solution, fields=fields)


@TASKS.register("local_dataset", check=check_local_dataset, run_label=local_dataset_label)
def local_dataset_task(
    *,
    path: str | Mapping[str, str] | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str | None = None,
    splits: Mapping[str, str] | None = None,
    train_size: int | None = None,
    dev_size: int | None = 200,
    test_size: int | None = 200,
    seed: int = 0,
    answer_format: str | None = None,
    prompt_template: str = "{prompt}",
    extra_fields: Sequence[str] = (),
    name: str | None = None,
    hub_config: str | None = None,
    cache_dir: str | None = None,
) -> Task:
    """Build a Task from tabular data; see the module docstring for split handling and checks.
    ``cache_dir``: the run's cache; datasets' Arrow conversion goes to ``<cache_dir>/datasets``.

    ``solution_field`` defaults to the answer. ``extra_fields`` columns are copied into
    ``TaskItem.fields`` (so reward functions receive them). ``answer_format`` None means ``plain``
    (switched to ``boxed_or_last`` for chat models by grpo_lab.prompts.adapt_answer_format).
    """
    defaulted = answer_format is None
    answer_format = check_answer_format(answer_format or "plain")
    path, splits = _resolve_path(path, splits)
    if "{prompt}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
    needed = [prompt_field, answer_field, *([solution_field] if solution_field else []), *extra_fields]
    files = _check_local_files(path, needed)
    source = load_source(path, hub_config, cache_dir=str(Path(cache_dir) / "datasets") if cache_dir else None)
    mapping = _split_mapping(source, splits, path)
    # Every source split we use, every row: before any model loads (module docstring).
    for ours in ("train", "dev", "test"):
        if ours in mapping:
            _check_split_rows(source[mapping[ours]], path, ours, mapping[ours], needed, prompt_field,
                              answer_field, answer_format)
    # Every source split we use, once each (two of ours may read the same one).
    warn_conflicting_duplicates(path, [source[n] for n in dict.fromkeys(mapping.values())], prompt_field,
                                answer_field, answer_format)
    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    raw, removed_before_carving, carved = _carve_splits(source, mapping, sizes, prompt_field, seed)
    if train_size is not None:
        raw["train"] = raw["train"][: int(train_size)]
    item = functools.partial(_task_item, prompt_field=prompt_field, answer_field=answer_field,
                             solution_field=solution_field, answer_format=answer_format,
                             prompt_template=prompt_template, extra_fields=extra_fields)
    out = {s: [item(r) for r in raw[s]] for s in SPLITS}
    task_name = name or (Path(str(path)).stem if not isinstance(path, Mapping) else "local_dataset")
    overlap = remove_train_overlap(out, task_name)
    overlap["train_removed_overlap"] += removed_before_carving
    info = {
        "source": "local_dataset",
        "path": str(path) if not isinstance(path, Mapping) else dict(path),
        "data_sha256": data_digest(list(files.values())),
        "split_map": mapping,
        "answer_format": answer_format,
        # Left to the source (plain): read with boxed_or_last for chat models (grpo_lab.prompts).
        "answer_format_defaulted": defaulted,
        "carved": carved,
        "sizes": {s: len(v) for s, v in out.items()},
        **overlap,
    }
    return Task(name=task_name, splits=out, info=info)

