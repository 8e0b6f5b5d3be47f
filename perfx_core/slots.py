"""Which generation holds each KV-cache slot of a Model, and the lock that keeps engine steps one at a time.

The engine's KV slots and work buffers are shared state: two generations on one slot, or two steps running at
once, would silently corrupt each other. Each Generation holds a slot of its own from creation until it ends,
and every step runs under ``lock``, so generations on different slots can be iterated from different threads.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import ModelBusyError
from .prefix_cache import SlotPrefixes

if TYPE_CHECKING:
    from .generation import Generation


class SlotPool:
    def __init__(self, n_slots: int, slot_writes: Sequence[int] | None = None):
        self.lock = threading.RLock()
        # Per slot: (weak reference to the generation, id of the thread that created it), or None when free.
        # Weak: a generation dropped without close() frees its slot once it is collected.
        self._holders: list[tuple[weakref.ref[Generation], int] | None] = [None] * n_slots
        self.prefixes = SlotPrefixes(n_slots, slot_writes)  # what each slot's cache holds (prefix caching)

    def take(self, prompt: Sequence[int] = (), reuse: bool = True) -> tuple[int, int]:
        """(slot, prompt tokens its cache already holds) for ``prompt`` (call with ``lock`` held): the free slot
        agreeing with it longest. When every slot is held, the calling thread's own oldest generation is ended
        ("cancelled"): a new request from the same caller replaces its previous one. A slot held by another
        thread's generation is never taken: that raises ModelBusyError."""
        free = self._free_slots()
        if not free:
            # A started generation and its generator refer to each other: one dropped without close() is only
            # freed by the cycle collector.
            gc.collect()
            free = self._free_slots()
        if not free:
            free = self._end_own_generation()
        slot, cached = self.prefixes.choose(free, prompt) if prompt else (free[0], 0)
        self.prefixes.take(slot)
        return slot, cached if reuse else 0

    def _end_own_generation(self) -> list[int]:
        me = threading.get_ident()
        for slot, holder in enumerate(self._holders):
            generation = holder[0]() if holder is not None else None
            if generation is not None and holder[1] == me:
                generation.close()  # its on_end frees the slot and remembers what it holds
                self._holders[slot] = None
                return [slot]
        n = len(self._holders)
        raise ModelBusyError(
            f"all {n} KV-cache slot(s) of this model are held by generations of other threads; finish or close() "
            f"one of them first, or load the model with n_slots greater than {n} to run that many at once"
        )

    def _free_slots(self) -> list[int]:
        free = []
        for slot, holder in enumerate(self._holders):
            if holder is not None and holder[0]() is None:  # dropped: what its cache holds is unknown
                self._holders[slot] = None
                self.prefixes.take(slot)
            if self._holders[slot] is None:
                free.append(slot)
        return free

    def hold(self, slot: int, generation: Generation) -> None:
        self._holders[slot] = (weakref.ref(generation), threading.get_ident())

    def release(self, generation: Generation) -> None:
        """A generation's ``on_end``: its slot is free again (unless another generation took it meanwhile)."""
        holder = self._holders[generation.slot]
        if holder is not None and holder[0]() in (generation, None):
            self._holders[generation.slot] = None
            self.prefixes.remember(generation.slot, generation.cached_tokens())

    def close_all(self) -> None:
        for holder in list(self._holders):
            generation = holder[0]() if holder is not None else None
            if generation is not None:
                generation.close()
        self._holders = [None] * len(self._holders)
