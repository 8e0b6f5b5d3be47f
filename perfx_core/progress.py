"""Progress of the slow steps (loading a model, building kernels, warming up, tuning), as log records.

They go to the ``perfx`` loggers at INFO level, so a library user sees nothing unless they configure logging, the
server shows them in its log, and the command line prints them on stderr (``on_stderr``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("perfx.progress")


def begin(doing: str) -> float:
    """Log that a slow step starts; returns its start time for ``end``."""
    log.info("%s ...", doing)
    return time.perf_counter()


def end(done: str, started: float) -> None:
    log.info("%s in %.1f s", done, time.perf_counter() - started)


@contextmanager
def step(doing: str, done: str) -> Iterator[None]:
    """``begin(doing)``, then ``end(done)`` once the block finishes without an error."""
    started = begin(doing)
    yield
    end(done, started)


@contextmanager
def on_stderr(quiet: bool = False) -> Iterator[None]:
    """While inside, the ``perfx`` loggers' INFO records print as ``perfx: message`` lines on stderr (only
    warnings when ``quiet``); the loggers are as they were afterwards (main() may run inside a bigger program)."""
    root = logging.getLogger("perfx")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("perfx: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (tests and embedding programs replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's contract: a handler reports its own failure instead of raising
            self.handleError(record)
