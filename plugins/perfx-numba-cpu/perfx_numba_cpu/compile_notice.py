"""Say once that the kernels are compiling: on a machine's first run numba compiles them for a minute or so
before the first token, and nothing else would show why. numba's "numba:compile" event fires only for a real
compile, not for a kernel read from its on-disk cache, so later runs say nothing."""

from __future__ import annotations

import logging

from numba.core import event

log = logging.getLogger("perfx.numba_cpu")


class _FirstCompile(event.Listener):
    def __init__(self) -> None:
        self.told = False

    def on_start(self, ev: event.Event) -> None:
        if not self.told:
            self.told = True
            log.info("compiling the CPU kernels (numba; numba caches them on disk for later runs)")

    def on_end(self, ev: event.Event) -> None:
        pass


event.register("numba:compile", _FirstCompile())
