"""A name -> entry registry: one per concept (advantage estimator, policy loss, objective, engine, ...).

Dispatch goes only through a registry (verl's ``register_adv_est`` pattern), so no code outside a
registry writes ``if name == "grpo"``. Every function in one registry shares one calling
convention; the registry does not check signatures, the tests of each module do.

Two things live on an entry besides its function:

* **facts** (``register("rloo", min_group_size=2)``): what the rest of the lab must know about the
  entry (needs a critic, needs G >= 2, ...). ``validate()`` asks ``registry.fact(name, key)``
  instead of keeping lists of names.
* **settings by signature** (``registry.call(name, *tensors, **settings)``, or ``registry.bind(name,
  **settings)`` once for a function called every step): the caller passes every setting of its config
  section; each function receives only the keyword arguments its signature names. A new setting therefore touches the schema, the YAML and the one function that reads it,
  never the call site or the other entries.

**Plug-ins by import path**: a name of the form ``"package.module:attribute"`` (or
``"package.module.attribute"``, which Hydra's command line takes without escaping) is not looked up in
the entries but imported on first use (and then remembered under that name, with the registry's
default facts), so a user's reward function, task source or model builder works from config without
editing the lab: ``reward.weights={my_lab.rewards:length_bonus: 0.1}``. The module must be importable
in every process that runs the job (installed, or on PYTHONPATH), which is what Hydra's joblib and
Slurm launchers need anyway.

This module is neutral ground: the pure math (``grpo_lab.algos``) and the I/O-side registries
(rollout engines, models, tasks, rewards, objectives) all use it, and it imports nothing of the lab.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UnknownChoiceError(KeyError, ValueError):
    """Raised by :meth:`Registry.get` for a name that is not registered.

    Subclasses both ``KeyError`` (it is a failed lookup) and ``ValueError`` (it is usually a bad
    config value), so callers may catch either.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else ""


def known_kwargs(fn: Callable[..., Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``settings`` that ``fn``'s signature names (all of them when it takes
    ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(settings)
    return {k: v for k, v in settings.items() if k in params}


def call_with_known_kwargs(fn: Callable[..., Any], /, *args: Any, **settings: Any) -> Any:
    """``fn(*args, **settings)`` with only the keyword arguments ``fn``'s signature names: one config
    section serves many functions."""
    return fn(*args, **known_kwargs(fn, settings))


class Registry:
    """Maps names to functions (or classes) of one kind, each with a dict of facts.

    Example::

        ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

        @ADVANTAGE_ESTIMATORS.register("rloo", min_group_size=2)
        def rloo(...): ...

        fn = ADVANTAGE_ESTIMATORS.get("rloo")
        ADVANTAGE_ESTIMATORS.fact("rloo", "min_group_size")           # -> 2
        ADVANTAGE_ESTIMATORS.call("rloo", rewards, mask, ids, adv_eps=1e-6, gamma=1.0)  # rloo reads neither
    """

    def __init__(self, kind: str, *, defaults: Mapping[str, Any] | None = None) -> None:
        # `kind` names the concept in error messages ("unknown advantage estimator 'x'").
        self.kind = kind
        # Facts an entry has unless its registration says otherwise (e.g. min_group_size=1).
        self.defaults = dict(defaults or {})
        self._entries: dict[str, Callable[..., Any]] = {}
        self._facts: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **facts: Any) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` with ``facts``; a second use of a name is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        unknown = sorted(set(facts) - set(self.defaults)) if self.defaults else []
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown facts {unknown}; known: {sorted(self.defaults)}")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {getattr(self._entries[name], '__qualname__', self._entries[name])!s}); "
                    "pick another name"
                )
            self._entries[name] = fn
            self._facts[name] = {**self.defaults, **facts}
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (e.g. an entry a notebook or a test registered for a while)."""
        self.get(name)
        del self._entries[name], self._facts[name]

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name`` (or imported from ``"module:attribute"``);
        :class:`UnknownChoiceError` lists valid names or says why the import failed."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: unhashable name from a bad config
            pass
        if is_import_path(name):
            return self._import(name)
        raise UnknownChoiceError(
            f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())} "
            "(or a plug-in as 'package.module:function')"
        )

    def _import(self, path: str) -> Callable[..., Any]:
        # "pkg.mod:attr" or "pkg.mod.attr" (Hydra's command line needs `:` escaped inside dict keys).
        module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        if not module_name or not attr:
            raise UnknownChoiceError(f"{self.kind} {path!r} is neither registered nor an import path; "
                                     "write a plug-in as 'package.module:function'")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as err:  # ModuleNotFoundError, or the module itself failing on import
            raise UnknownChoiceError(
                f"{self.kind} plug-in {path!r}: cannot import module {module_name!r} ({type(err).__name__}: "
                f"{err}); make the package importable in every process that runs the job (pip install -e it, "
                "or put its directory on PYTHONPATH; the launch directory is searched too), or fix the path"
            ) from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
                raise UnknownChoiceError(f"{self.kind} plug-in {path!r}: module {module_name!r} has no attribute "
                                         f"{attr!r}; it defines: {', '.join(public)}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise UnknownChoiceError(f"{self.kind} plug-in {path!r} is a {type(obj).__name__}, not a callable "
                                     f"{self.kind}")
        self._entries[path] = obj
        self._facts[path] = dict(self.defaults)
        return obj

    def fact(self, name: str, key: str) -> Any:
        """A fact about the entry ``name`` (its registration's value, else the registry's default)."""
        self.get(name)  # unknown names fail with the list of choices
        facts = self._facts[name]
        if key not in facts:
            raise KeyError(f"{self.kind} {name!r} has no fact {key!r}; it has {sorted(facts)}")
        return facts[key]

    def call(self, name: str, /, *args: Any, **settings: Any) -> Any:
        """Call entry ``name`` with ``args`` and the subset of ``settings`` its signature names."""
        return call_with_known_kwargs(self.get(name), *args, **settings)

    def bind(self, name: str, /, **settings: Any) -> functools.partial:
        """Entry ``name`` with the subset of ``settings`` its signature names bound: what ``call`` does,
        resolved once, for a caller that calls the entry every step with the same settings."""
        fn = self.get(name)
        return functools.partial(fn, **known_kwargs(fn, settings))

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        """Registered, or an importable ``"module:attribute"`` plug-in."""
        try:
            self.get(name)  # type: ignore[arg-type]
        except UnknownChoiceError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


# Which config key named an entry of which registry, as this process's validation asked: (key, form) ->
# registry, form "value" (the key's value, or each item of its list) or "keys" (the keys of the mapping at
# `key`, e.g. reward.weights). grpo_lab.name_index writes it out so that a later launch refuses an unknown
# name without importing the registries.
CHECKED_KEYS: dict[tuple[str, str], Registry] = {}


def is_import_path(name: Any) -> bool:
    """A plug-in's "package.module:attribute" (or dotted) path: registered names have neither ':' nor '.'."""
    return isinstance(name, str) and (":" in name or "." in name)


def unregistered_message(key: str, name: str, names: list[str]) -> str:
    return (f"{key}={name!r} is not registered; valid choices: {', '.join(sorted(names))}"
            " (or a plug-in as 'package.module:function')")


def check_registered(registry: Registry, name: str, key: str, errors: list[str]) -> bool:
    """Append an error naming the config `key` unless `name` is registered (or an importable plug-in path)."""
    parent, _, last = key.rpartition(".")
    CHECKED_KEYS[(parent, "keys") if parent and last == name else (key, "value")] = registry
    try:
        registry.get(name)
        return True
    except UnknownChoiceError as err:
        if is_import_path(name):  # a plug-in path: say why it failed
            errors.append(f"{key}: {err}")
        else:
            errors.append(unregistered_message(key, name, registry.names()))
        return False
