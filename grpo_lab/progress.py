"""Progress lines for long phases (model conversion, engine start, warm-up, evaluation), so a log file
never goes quiet for minutes: a line when the phase starts, saying what it does and how much (a count
or an estimate), then a line at least every `EVERY_S` seconds (or every 10 % of a counted phase), and
a line when it ends. Lines go to stdout, flushed, like the trainer's own step lines.

`heartbeat(what)` covers a phase that is one opaque call (an engine start, one batched generate):
a daemon thread prints how long it has run. `CountedProgress` covers a phase of counted steps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Longest silence, in seconds, of a long phase's log.
EVERY_S = 30.0


def say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


@contextmanager
def heartbeat(what: str, *, every_s: float | None = None) -> Iterator[None]:
    """Print ``<what> ...`` now, ``<what>: still running, N s`` every `every_s` seconds while the
    block runs, and ``<what>: done in N s`` (or ``failed after``) when it ends."""
    every = EVERY_S if every_s is None else every_s
    start, stop = time.time(), threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            say(f"{what}: still running, {time.time() - start:.0f} s")

    say(f"{what} ...")
    thread = threading.Thread(target=beat, daemon=True, name="progress-heartbeat")
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join()
        say(f"{what}: {'done in' if ok else 'failed after'} {time.time() - start:.1f} s")


class CountedProgress:
    """``update(done, detail)`` prints ``<what> done/total | detail | s per unit | ~N s left`` when
    `every_s` seconds passed since the last line, at every 10 % and at the end."""

    def __init__(self, what: str, total: int, *, unit: str = "step", every_s: float | None = None):
        self.what, self.total, self.unit = what, max(int(total), 1), unit
        self.every = EVERY_S if every_s is None else every_s
        self.start = self.last = time.time()
        self.last_decile = 0

    def update(self, done: int, detail: str = "") -> None:
        now = time.time()
        decile = 10 * done // self.total
        if now - self.last < self.every and decile == self.last_decile and done < self.total:
            return
        self.last, self.last_decile = now, decile
        per = (now - self.start) / max(done, 1)
        parts = [f"{self.what} {self.unit} {done}/{self.total}", *([detail] if detail else []),
                 f"{per:.2f} s/{self.unit}", f"~{per * (self.total - done):.0f} s left at most"]
        say(" | ".join(parts))
