"""A name -> function registry: one per concept (advantage estimator, policy loss, ...).

Dispatch goes only through a registry (verl's ``register_adv_est`` pattern), so the train loop
never writes ``if name == "grpo"``. Every function in one registry shares one signature; the
registry does not check signatures, the tests of each module do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


class Registry:
    """Maps names to functions of one kind.

    Example::

        ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

        @ADVANTAGE_ESTIMATORS.register("group_zscore")
        def group_zscore(...): ...

        fn = ADVANTAGE_ESTIMATORS.get("group_zscore")
    """

    def __init__(self, kind: str) -> None:
        # `kind` names the concept in error messages ("unknown advantage estimator 'x'").
        self.kind = kind
        self._entries: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; a second use of a name is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {getattr(self._entries[name], '__qualname__', self._entries[name])!s}); "
                    "pick another name"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``; :class:`UnknownChoiceError` lists valid names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: unhashable name from a bad config
            raise UnknownChoiceError(
                f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
