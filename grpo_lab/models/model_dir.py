"""Model directories on disk: what makes one complete, and writing one atomically.

Shared by every builder (``builders.py``) and converter (``smollm2.py``). Of the lab it imports only
``grpo_lab.atomic_dir`` (standard library only), so the builders and converters never import each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from grpo_lab.atomic_dir import write_dir_atomically

BUILD_SPEC_FILE = "grpo_lab_build.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_complete_model_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` has a config, weights and tokenizer files."""
    p = Path(path)
    return (
        (p / "config.json").is_file()
        and any((p / f).is_file() for f in WEIGHT_FILES)
        and any((p / f).is_file() for f in TOKENIZER_FILES)
    )


def publish_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)`` then move ``tmp_dir`` to ``out_dir`` (atomic rename on one filesystem).
    A complete ``out_dir`` written meanwhile by another process is kept: both wrote the same model."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not is_complete_model_dir(out_dir):
        raise FileExistsError(
            f"{out_dir} exists and is not empty but does not hold a complete model "
            "(config.json, model.safetensors, tokenizer files); delete it or choose another out_dir"
        )

    def write_complete(tmp: Path) -> None:
        write(tmp)
        if not is_complete_model_dir(tmp):
            raise RuntimeError(f"model builder wrote an incomplete directory: {sorted(os.listdir(tmp))}")

    return write_dir_atomically(out_dir, write_complete, keep_existing=is_complete_model_dir)
