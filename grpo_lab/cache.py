"""Content keys of cached artefacts (built models, warm-up checkpoints): a short hash of everything that
shapes one, so a change of any setting or datum gets a new entry and equal inputs share one."""

from __future__ import annotations

import hashlib
import json


def cache_key(*parts) -> str:
    """sha256 prefix of `parts` as sorted JSON; OmegaConf sections count by their resolved values."""
    from omegaconf import OmegaConf

    blob = json.dumps([OmegaConf.to_container(p, resolve=True) if OmegaConf.is_config(p) else p for p in parts],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
