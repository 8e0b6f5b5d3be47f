"""5- and 6-bit weight formats kept in GGML's own split of low nibbles and high bits, so that a file's Q5_0, Q5_1,
Q5_K and Q6_K blocks are their bytes rearranged; perfx_core.weights says which runtimes take them and what the
others get.

- ``Int5Weight``: codes 0..31 with a float16 scale and bias per group of 32: ``w = q * scale + bias``. Per group,
  16 bytes of low nibbles (byte j holds column j in its low nibble and column j + 16 in its high one) and one
  little-endian uint32 of fifth bits (bit j is column j's).
- ``Int6Weight``: GGUF Q6_K's own layout with its parts in separate arrays: ``w = (q - 32) * d * sub``, codes 0..63,
  an int8 ``sub`` per 16 columns and a float16 ``d`` per 256, every value the file's exactly (0.8203 bytes per
  weight, Q6_K's size). Per 128 columns, 64 bytes of low nibbles (byte i: column i low, i + 64 high) and 32 bytes of
  high bit pairs (byte i: columns i, i + 32, i + 64, i + 96 in bits 0-1, 2-3, 4-5, 6-7).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .errors import InvalidArgumentError

SPLIT_GROUP = 32  # columns per group of low nibbles and bit planes
INT6_SUB = 16  # columns per Int6Weight sub-scale
INT6_BLOCK = 256  # columns per Int6Weight d


def _check(name: str, arrays: dict[str, tuple[np.ndarray, str, tuple[int, int]]]) -> None:
    for field, (array, dtype, shape) in arrays.items():
        if array.dtype.str != np.dtype(dtype).str or array.shape != shape:
            raise InvalidArgumentError(
                f"{name}.{field} must be {np.dtype(dtype)} of shape {shape}; got {array.dtype} {array.shape}"
            )


class _SplitWeight:
    """What the two formats share: their fields are all arrays, the first one the low nibbles (rows, cols // 2)."""

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]

    @property
    def shape(self) -> tuple[int, int]:
        low = self.arrays[0]
        return low.shape[0], low.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass(frozen=True)
class Int5Weight(_SplitWeight):
    low: np.ndarray  # uint8 (rows, cols // 2)
    high: np.ndarray  # little-endian uint32 (rows, cols // 32): the fifth bits
    scale: np.ndarray  # float16 (rows, cols // 32)
    bias: np.ndarray  # float16 (rows, cols // 32)

    group_size = SPLIT_GROUP  # always 32, as GGML's 5-bit blocks (a class constant, not a field)

    def __post_init__(self) -> None:
        rows, half = self.low.shape
        if (2 * half) % SPLIT_GROUP:
            raise InvalidArgumentError(f"Int5Weight has groups of {SPLIT_GROUP} columns; got {2 * half} columns")
        groups = (rows, 2 * half // SPLIT_GROUP)
        _check(
            "Int5Weight",
            {
                "low": (self.low, "u1", (rows, half)),
                "high": (self.high, "<u4", groups),
                "scale": (self.scale, "<f2", groups),
                "bias": (self.bias, "<f2", groups),
            },
        )


@dataclass(frozen=True)
class Int6Weight(_SplitWeight):
    ql: np.ndarray  # uint8 (rows, cols // 2): the low nibbles
    qh: np.ndarray  # uint8 (rows, cols // 4): the high bit pairs
    sub: np.ndarray  # int8 (rows, cols // 16)
    d: np.ndarray  # float16 (rows, cols // 256)

    def __post_init__(self) -> None:
        rows, half = self.ql.shape
        cols = 2 * half
        if cols % INT6_BLOCK:
            raise InvalidArgumentError(f"Int6Weight has blocks of {INT6_BLOCK} columns; got {cols} columns")
        _check(
            "Int6Weight",
            {
                "ql": (self.ql, "u1", (rows, half)),
                "qh": (self.qh, "u1", (rows, cols // 4)),
                "sub": (self.sub, "i1", (rows, cols // INT6_SUB)),
                "d": (self.d, "<f2", (rows, cols // INT6_BLOCK)),
            },
        )

    def scales(self, rows: slice | np.ndarray = slice(None)) -> np.ndarray:
        """float32 (rows, cols // 16) of these rows: d times each sub-scale, exact in float32."""
        return np.repeat(self.d[rows].astype(np.float32), INT6_BLOCK // INT6_SUB, axis=1) * self.sub[rows]


NIBBLE_SHIFTS = np.array([0, 4], np.uint8).reshape(2, 1)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)


def int6_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Int6Weight's codes 0..63 in column order, uint8 (rows, cols)."""
    rows, half = ql.shape
    halves = 2 * half // 128
    low = (ql.reshape(rows, halves, 1, 64) >> NIBBLE_SHIFTS) & 0x0F  # (rows, halves, nibble, 64): columns 64n + i
    high = (qh.reshape(rows, halves, 1, 32) >> _CRUMB_SHIFTS) & 0x03  # (rows, halves, crumb, 32): columns 32p + i
    return (low.reshape(rows, halves, 128) | (high.reshape(rows, halves, 128) << 4)).reshape(rows, 2 * half)


def pack_int6(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes 0..63, (rows, cols) with cols a multiple of 256 -> Int6Weight's (ql, qh)."""
    codes = np.asarray(codes, dtype=np.uint8)
    rows, cols = codes.shape
    halves = codes.reshape(rows, cols // 128, 128)
    ql = (halves[:, :, :64] & 0x0F) | ((halves[:, :, 64:] & 0x0F) << 4)
    crumbs = (halves >> 4).reshape(rows, cols // 128, 4, 32)
    qh = crumbs[:, :, 0] | (crumbs[:, :, 1] << 2) | (crumbs[:, :, 2] << 4) | (crumbs[:, :, 3] << 6)
    return ql.reshape(rows, cols // 2), qh.reshape(rows, cols // 4)


def int5_codes(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Int5Weight's codes 0..31 in column order, uint8 (rows, cols), from its low nibbles and fifth bits."""
    rows, half = low.shape
    groups = 2 * half // SPLIT_GROUP
    nibbles = low.reshape(rows, groups, 16)
    codes = np.empty((rows, groups, SPLIT_GROUP), np.uint8)
    codes[:, :, :16] = nibbles & 0x0F
    codes[:, :, 16:] = nibbles >> 4
    bits = np.ascontiguousarray(high).view(np.uint8).reshape(rows, groups, 4)
    codes |= np.unpackbits(bits, axis=2, bitorder="little") << 4
    return codes.reshape(rows, 2 * half)


def pack_int5(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes 0..31, (rows, cols) with cols a multiple of 32 -> Int5Weight's (low, high)."""
    codes = np.asarray(codes, dtype=np.uint8)
    rows, cols = codes.shape
    groups = codes.reshape(rows, cols // SPLIT_GROUP, SPLIT_GROUP)
    low = (groups[:, :, :16] & 0x0F) | ((groups[:, :, 16:] & 0x0F) << 4)
    bits = np.packbits(groups >> 4, axis=2, bitorder="little")  # (rows, groups, 4): the bytes of each uint32
    return low.reshape(rows, cols // 2), np.ascontiguousarray(bits).view("<u4").reshape(rows, cols // SPLIT_GROUP)


def split_rows(weight: Int5Weight | Int6Weight, rows: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of some rows (a slice or an index array) of an int5 or int6 weight, into ``out`` if given."""
    if isinstance(weight, Int5Weight):
        codes = int5_codes(weight.low[rows], weight.high[rows])
    else:
        codes = int6_codes(weight.ql[rows], weight.qh[rows])
    n, cols = codes.shape
    if out is None:
        out = np.empty((n, cols), dtype=np.float32)
    groups = out.view()
    if isinstance(weight, Int5Weight):
        groups.shape = (n, cols // SPLIT_GROUP, SPLIT_GROUP)  # raises, rather than writing a copy, if out cannot be
        np.multiply(codes.reshape(groups.shape), weight.scale[rows].astype(np.float32)[:, :, None], out=groups)
        groups += weight.bias[rows].astype(np.float32)[:, :, None]
        return out
    centered = codes.view(np.int8)
    centered -= 32  # 0..63 -> -32..31: (q - 32) * d * sub is exact in float32, q * d * sub - 32 d * sub is not
    scale = weight.scales(rows)
    groups.shape = (n, cols // INT6_SUB, INT6_SUB)
    np.multiply(centered.reshape(groups.shape), scale[:, :, None], out=groups)
    return out
