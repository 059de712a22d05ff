"""Writing a directory atomically: into a temporary sibling, then renamed into place.

A kill at any moment leaves the target as it was or complete, never half-written, so a reader that
finds the directory may use it (a resumable checkpoint, a cached model). The temporary sibling is a
hidden `.<name>.tmp-*` in the same parent, so the rename never crosses filesystems. Standard library
only: the model builders and the checkpoint writer both use it without importing each other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_dir_atomically(final: str | os.PathLike, write: Callable[[Path], None], *,
                         keep_existing: Callable[[Path], bool] = lambda path: False) -> Path:
    """Run ``write(tmp)`` on an empty temporary sibling of ``final``, then rename it to ``final``.

    An existing ``final`` is kept (the new copy discarded) when ``keep_existing(final)`` holds, e.g.
    another process finished the same model first; otherwise it is replaced. When ``write`` raises,
    the temporary directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        if keep_existing(final):
            shutil.rmtree(tmp)
            return final
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
