"""An index of the registries' names, so that a launch naming no registered entry is refused before torch loads.

The registries live in the modules that define their entries, and those import torch and transformers: asking
a registry whether `algorithm.policy_loss=clipped_surogate` exists costs the seconds those imports take. The
full validation asks them anyway (grpo_lab.config.validate); each `check_registered` it makes is noted
(grpo_lab.registry: which config key names an entry of which registry), and once a launch's config has passed,
this module writes what was asked, with each registry's names as they then were, to
``<cache_dir>/name_index.json`` (a refused launch writes nothing). The next launch reads that file (JSON, no
heavy import) and refuses a value that names no entry, in the registry's own words, before anything heavy
loads.

The index is a cache of the registries, never a list kept by hand: it records the digest of the package's
source files (path, size and modification time of every ``grpo_lab/**/*.py``) and is ignored, then rewritten,
once any of them changes. It only refuses: a name it holds, an import path (a plug-in), and every key it has
not seen go on to the full validation, which has the last word. The keys accumulate over launches (a DPO
launch adds `algorithm.preference.loss`); a name no registry holds is refused under any key a check has read,
also where this run's objective would not read it (a setting nothing reads is refused by the unread-settings
rule anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_lab.registry import CHECKED_KEYS, is_import_path, unregistered_message

PACKAGE = Path(__file__).resolve().parent
INDEX_FILE = "name_index.json"


def source_digest(package: Path = PACKAGE) -> str:
    """sha256 (16 hex digits) of every module's path, size and modification time: the registries' names can
    only change when one of these does."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        st = path.stat()
        digest.update(f"{path.relative_to(package)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and isinstance(index.get("keys"), dict) else None


def write_index(cache_dir: str | Path) -> None:
    """Merge the keys this process's validation checked, and their registries' names, into the index (a new
    one when the sources changed). Best effort: an index that cannot be written only keeps refusals slow."""
    if not CHECKED_KEYS:
        return
    path, digest = Path(cache_dir) / INDEX_FILE, source_digest()
    index = _read(path) or {}
    keys = index["keys"] if index.get("digest") == digest else {}
    for (key, form), registry in CHECKED_KEYS.items():
        keys[key] = {"kind": registry.kind, "form": form, "names": sorted(registry.names())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"digest": digest, "keys": keys}, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def _named(cfg: DictConfig, key: str, form: str) -> list[str]:
    """The names `cfg` gives under `key`: its value (each item of a list), or the keys of a mapping (form
    "keys", e.g. reward.weights)."""
    value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
    if form == "keys":
        return [str(k) for k in value] if isinstance(value, DictConfig) else []
    items = list(value) if OmegaConf.is_list(value) else [value]
    return [v for v in items if isinstance(v, str)]


def unknown_names(cfg: DictConfig, cache_dir: str | Path) -> list[str]:
    """The refusals of every value that names no registered entry, by a current index in `cache_dir` (none
    without one): the same messages the registries' check gives."""
    index = _read(Path(cache_dir) / INDEX_FILE)
    if index is None or index.get("digest") != source_digest():
        return []
    errors = []
    for key, entry in sorted(index["keys"].items()):
        for name in _named(cfg, key, entry["form"]):
            if name not in entry["names"] and not is_import_path(name):
                shown = f"{key}.{name}" if entry["form"] == "keys" else key
                errors.append(unregistered_message(shown, name, entry["names"]))
    return errors


__all__ = ["INDEX_FILE", "source_digest", "unknown_names", "write_index"]
