"""Matmuls by a weight held as row parts of different formats (weights.RowParts).

A Q4_K_M file's QKV has q and k in Q4_K and, in half the layers, v in Q6_K: one format for all three would be
float32 (4 bytes per weight against the file's ~0.6). Instead each part keeps its format and its own handle, and
a matmul projects each part into its columns of the output: at one row those columns are contiguous, so each
part writes a view of the output; with more rows each part goes through a scratch buffer and ``write_columns``.
Runtimes and their ops never see a RowParts: they prepare and multiply ordinary weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .weights import RowParts


@dataclass(frozen=True)
class PreparedRowParts:
    """A runtime's handles of a RowParts' parts, in row order."""

    parts: tuple[Any, ...]
    kind: str = "parts"

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


def prepare(rt, weights: Sequence[Any]) -> list[Any]:
    """rt.prepare_weights over weights that may be RowParts (their parts prepared in the same call)."""
    flat = [p for w in weights for p in (w.parts if isinstance(w, RowParts) else (w,))]
    handles = iter(rt.prepare_weights(flat))
    return [
        PreparedRowParts(tuple(next(handles) for _ in w.parts)) if isinstance(w, RowParts) else next(handles)
        for w in weights
    ]


def weight_bytes(rt, handle: Any) -> int | None:
    """rt.weight_bytes, summed over the parts of a PreparedRowParts."""
    if not isinstance(handle, PreparedRowParts):
        return rt.weight_bytes(handle)
    sizes = [rt.weight_bytes(p) for p in handle.parts]
    return None if any(s is None for s in sizes) else sum(sizes)


def linear(rt, x, w: PreparedRowParts, out) -> None:
    """out (n, m) = x (n, k) @ w.T, a part at a time into its columns."""
    n, start = out.shape[0], 0
    for i, part in enumerate(w.parts):
        m = part.shape[0]
        if n == 1:
            rt.ops.linear(x, part, rt.view(out, start, (1, m)))
        else:
            scratch = rt.scratch(f"row_part_{i}", (n, m))
            rt.ops.linear(x, part, scratch)
            rt.ops.write_columns(scratch, start, out)
        start += m


def gate_up(rt, x, w: PreparedRowParts, out, gelu: bool) -> None:
    """gate_up_silu / gate_up_gelu where [w_gate; w_up] are row parts."""
    n, f = out.shape
    both = rt.scratch("row_parts_gate_up", (n, 2 * f))
    linear(rt, x, w, both)
    (rt.ops.gelu_mul if gelu else rt.ops.silu_mul)(both, out)
