"""The shapes a model's layers hand to the ops: the attention heads' layout and the KV cache's.

Part of the backend contract (perfx_core.backend re-exports both); here, at the bottom of the import graph, so that
the NumPy reference (perfx_core.reference) and the ops can use them without importing the backend interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVCacheSpec:
    n_layers: int
    n_slots: int  # one slot per concurrently running sequence
    max_seq_len: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # "float32" or "float16"

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Canonical layout used by Runtime.kv_cache_to_numpy: (layer, slot, kv_head, position, head_dim)."""
        return (self.n_layers, self.n_slots, self.n_kv_heads, self.max_seq_len, self.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class AttentionSpec:
    """Head layout of one attention layer; a fused qkv row is [q (n_heads*hd) | k (n_kv*hd) | v (n_kv*hd)]."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    # What the families beyond Llama add (an attention op declares which it implements: OpTable.features):
    window: int | None = None  # a query sees at most this many positions, itself included
    softcap: float | None = None  # scores s become softcap * tanh(s / softcap)
    scale: float | None = None  # multiplier of q.k; None: 1/sqrt(head_dim)

    @property
    def features(self) -> frozenset[str]:
        """The optional attention features this layer uses."""
        used = {"window": self.window is not None, "softcap": self.softcap is not None, "scale": self.scale is not None}
        return frozenset(name for name, on in used.items() if on)

    @property
    def score_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)  # ~10x np.sqrt's speed

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim
