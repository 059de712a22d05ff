"""Content keys of cached artefacts (built models, warm-up checkpoints): a short hash of everything that
shapes one, so a change of any setting or datum gets a new entry and equal inputs share one."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from grpo_lab.schema import as_dict


def is_section(value) -> bool:
    """A config section: a typed one (a dataclass instance) or an OmegaConf node."""
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or hasattr(value, "_metadata")


def cache_key(*parts) -> str:
    """sha256 prefix of `parts` as sorted JSON; a config section (typed or OmegaConf) counts by its
    resolved values, so both carry the same key."""
    blob = json.dumps([as_dict(p) if is_section(p) else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
