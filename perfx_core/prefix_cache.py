"""Prefix caching on KV-cache slots: each free slot remembers which tokens its cache holds, and a new prompt
goes to the free slot whose content agrees with it longest, so only the rest of the prompt is prefilled.

Why slots rather than paged blocks: the engine's cache is one contiguous region per slot, which every backend's
attention kernels read directly. Reusing what a slot already holds needs no copy and no change to those kernels,
costs no memory beyond the slots, and serves the common cases: a conversation's next turn, the choices of one
multiple-choice question, and requests sharing a system prompt (once each slot has served one). What it cannot
do is share one prefix among several slots at once: each slot computes a shared prefix once, on its first use.
Eviction is by recency: a prompt that matches no free slot takes the one used longest ago.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    return int(np.argmax(differs)) if differs.any() else n


class SlotPrefixes:
    """The tokens whose keys and values are valid at positions 0.. of each slot, and when it was last used."""

    def __init__(self, n_slots: int, writes: Sequence[int] | None = None):
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self._used = [0] * n_slots
        self._clock = 0
        # The engine's per-slot write counts (LlamaModel.slot_writes): a slot written by anyone since it was
        # remembered holds something else now.
        self._writes = writes
        self._written_at = [0] * n_slots

    def choose(self, free: Sequence[int], prompt: Sequence[int]) -> tuple[int, int]:
        """(slot, tokens it already holds) for ``prompt`` among the ``free`` slots: the longest agreement, then
        the least recently used. At least the prompt's last token is left to compute: its logits are needed."""
        best, best_shared = None, -1
        if self._writes is not None:
            for slot in free:
                if self._writes[slot] != self._written_at[slot]:
                    self.tokens[slot] = []
        for slot in free:
            shared = min(shared_prefix(self.tokens[slot], prompt), len(prompt) - 1)
            if shared > best_shared or (shared == best_shared and self._used[slot] < self._used[best]):
                best, best_shared = slot, shared
        assert best is not None, "choose() needs a free slot"
        return best, max(best_shared, 0)

    def take(self, slot: int) -> None:
        """The slot is about to be written: forget what it held."""
        self.tokens[slot] = []
        self._clock += 1
        self._used[slot] = self._clock

    def remember(self, slot: int, tokens: Sequence[int]) -> None:
        self.tokens[slot] = list(tokens)
        if self._writes is not None:
            self._written_at[slot] = self._writes[slot]

    def forget_all(self) -> None:
        """Every slot's content is unknown (e.g. after a warm-up wrote garbage)."""
        self.tokens = [[] for _ in self.tokens]
