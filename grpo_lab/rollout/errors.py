"""Errors of the rollout engines: each names the phase (generate, weight sync) and carries the
engine's own root error text, so the run's summary.json can show what actually went wrong."""

from __future__ import annotations


class RolloutEngineError(RuntimeError):
    """The rollout engine failed; the message names the phase and carries the engine's root error."""

    def __init__(self, message: str, *, phase: str, engine_error: str = ""):
        super().__init__(message)
        self.phase = phase
        # The engine processes' own logged error text (traceback included), for summary.json.
        self.engine_error = engine_error


class EngineDeadError(RolloutEngineError):
    """An engine process died (crash, signal, OOM): the engine cannot serve any further call."""


class EngineTimeoutError(RolloutEngineError, TimeoutError):
    """A call into the engine did not finish within its configured timeout."""
