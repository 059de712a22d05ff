"""Plug-ins named in config by import path: ``"package.module:function"`` or ``"package.module.function"``.

One scheme for every plug-in (reward functions in ``reward.weights``, task factories in
``task.source``): the module part is imported with ``importlib.import_module`` (so the package
must be importable: installed, or on ``PYTHONPATH`` / the launch directory) and the function is
looked up on it. Registered names contain neither ``:`` nor ``.``, so the two kinds of names cannot
be confused. Both spellings exist for Hydra's command line, where ``:`` inside a dict key must be
escaped: ``'reward.weights={my_pkg.rewards.length_penalty: 0.5}'`` needs no escape,
``'reward.weights={my_pkg.rewards\\:length_penalty: 0.5}'`` does; YAML files take either.
"""

from __future__ import annotations

import importlib
from typing import Any


def is_import_path(name: object) -> bool:
    return isinstance(name, str) and (":" in name or "." in name)


def import_object(path: str, *, key: str, what: str) -> Any:
    """The object at ``"package.module:attribute"``; errors name the config ``key`` and say what to fix."""
    path = str(path)
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not an import path; write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or the module itself failing on import
        raise ValueError(
            f"{key}: cannot import module {module_name!r} for the {what} {path!r} "
            f"({type(e).__name__}: {e}). Make the package importable (pip install -e it, or put its "
            "directory on PYTHONPATH; the launch directory is searched too), or fix the path"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in dir(module) if not n.startswith("_"))[:20]
            raise ValueError(
                f"{key}: module {module_name!r} has no attribute {attr!r} (the {what} {path!r}); "
                f"it defines: {', '.join(public)}"
            ) from None
    if not callable(obj):
        raise ValueError(f"{key}: {path!r} is a {type(obj).__name__}, not a callable {what}")
    return obj
