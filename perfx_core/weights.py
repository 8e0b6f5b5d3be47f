"""perfx's host-side weight formats and the int4 quantization helpers (pack order written once here).

Five formats cover every model (a sixth, ``BlockWeight``, hands a file's own blocks to a runtime that converts
them on its device):

- ``Int4Weight``: 4-bit codes with one scale and one bias per group of ``group_size`` consecutive input
  columns. Dequantized value: ``w[r, c] = q[r, c] * scale[r, c // g] + bias[r, c // g]``.
  AWQ's ``(q - zero) * scale`` is the same thing with ``bias = -zero * scale``; GGUF Q4_0 is
  ``bias = -8 * d`` and Q4_1 is ``bias = m``. The bias is float32 so all three are stored exactly.
  GGUF Q4_K (``scale = d * sc``, ``bias = -dmin * m``, 6-bit sc and m per 32, float16 d and dmin per 256) is
  this format with its scale rounded to float16; its factors ride along as ``Int4KScales``, exact, for a
  runtime that holds them instead (0.58 bytes per weight, the file's 0.56).
- ``Int8Weight``: int8 codes with one scale per group: ``w[r, c] = q[r, c] * scale[r, c // g]``.
  GGUF Q8_0 (``d * q``, 32 per block) is this format bit for bit with float16 scales, and so is Q5_0 (``q`` in
  -16..15); Q6_K (``q`` in -32..31 per 16, scaled by a float16 ``d`` times an int8 sub-scale) exactly with
  float32 scales, which hold every such product. Only
  runtimes that list "int8" in ``Runtime.weight_formats`` get it; ``for_runtime`` widens it for the others.
- ``Int5Weight`` and ``Int6Weight`` (perfx_core.split_weights): 5- and 6-bit codes kept in GGML's own split of low
  nibbles and high bits. Int5: a float16 scale and bias per 32, GGUF Q5_0 (``bias = -16 d``) and Q5_1
  (``bias = m``) bit for bit, Q5_K with ``d * sc`` and ``-dmin * m`` rounded to float16. Int6: GGUF Q6_K's blocks
  exactly, its int8 sub-scale per 16 and float16 ``d`` per 256. Runtimes without "int5" / "int6" in
  ``Runtime.weight_formats`` get Q5_0 and Q6_K as Int8Weight (exact) and Q5_1 / Q5_K as float16 (``for_runtime``).
- ``DenseWeight``: float32 or float16 values (GGUF F32/F16/BF16 land here without loss).

A fused matrix (QKV, gate|up) whose parts no one format holds exactly is a ``RowParts`` of them (concat_rows).

Packing: byte ``packed[r, j]`` holds column ``2j`` in its low nibble and column ``2j + 1`` in its high nibble.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError
from .split_weights import INT6_SUB, SPLIT_GROUP, Int5Weight, Int6Weight, int5_codes, int6_codes, split_rows

SUPPORTED_GROUP_SIZES = (32, 64, 128)
INT8_GROUP_SIZES = (16, *SUPPORTED_GROUP_SIZES)  # 16: Q6_K's sub-blocks


K_SUPER = 256  # columns per Q4_K super-block: one d and one dmin


@dataclass(frozen=True)
class Int4KScales:
    """A GGUF Q4_K weight's own scales: group g of row r has scale ``d[r, g // 8] * sc[r, g]`` and bias
    ``-dmin[r, g // 8] * m[r, g]`` (groups of 32 columns), both exact in float32."""

    d: np.ndarray  # float16 (rows, cols // 256)
    dmin: np.ndarray  # float16 (rows, cols // 256)
    sc: np.ndarray  # uint8 (rows, cols // 32), 0..63
    m: np.ndarray  # uint8 (rows, cols // 32), 0..63

    def __post_init__(self) -> None:
        rows, groups = self.sc.shape
        supers = groups * 32 // K_SUPER
        if self.d.dtype != np.float16 or self.dmin.dtype != np.float16 or self.sc.dtype != np.uint8:
            raise InvalidArgumentError("Int4KScales wants d and dmin float16, sc and m uint8")
        if self.m.shape != self.sc.shape or self.m.dtype != np.uint8 or groups * 32 % K_SUPER:
            raise InvalidArgumentError(
                f"Int4KScales: sc {self.sc.shape} and m {self.m.shape} must be equal uint8 arrays"
            )
        if self.d.shape != (rows, supers) or self.dmin.shape != (rows, supers):
            raise InvalidArgumentError(f"Int4KScales: d/dmin {self.d.shape}/{self.dmin.shape}, want ({rows}, {supers})")

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.d, self.dmin, self.sc, self.m

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def exact(self, rows: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """These rows' group scales and biases, float32 (rows, cols // 32): exactly the weight's."""
        per_group = K_SUPER // 32
        d = np.repeat(self.d[rows].astype(np.float32), per_group, axis=1)
        dmin = np.repeat(self.dmin[rows].astype(np.float32), per_group, axis=1)
        return d * self.sc[rows], -(dmin * self.m[rows])

    def scale_bias(self) -> tuple[np.ndarray, np.ndarray]:
        """Int4Weight's (scale float16, bias float32) of these factors (the scale rounded)."""
        scale, bias = self.exact()
        return scale.astype(np.float16), bias


@dataclass(frozen=True)
class Int4Weight:
    packed: np.ndarray  # uint8 (rows, cols // 2)
    scale: np.ndarray  # float16 (rows, cols // group_size)
    bias: np.ndarray  # float32 (rows, cols // group_size)
    group_size: int
    k_scales: Int4KScales | None = None  # a GGUF Q4_K weight's exact factors of scale and bias

    def __post_init__(self) -> None:
        rows, half = self.packed.shape
        groups = (2 * half) // self.group_size
        if self.packed.dtype != np.uint8 or self.scale.dtype != np.float16 or self.bias.dtype != np.float32:
            raise InvalidArgumentError("Int4Weight wants packed uint8, scale float16 and bias float32")
        if self.group_size not in SUPPORTED_GROUP_SIZES or (2 * half) % self.group_size:
            raise InvalidArgumentError(
                f"group size {self.group_size} must be one of {SUPPORTED_GROUP_SIZES} and divide {2 * half} columns"
            )
        if self.scale.shape != (rows, groups) or self.bias.shape != (rows, groups):
            raise InvalidArgumentError(
                f"scale/bias shapes {self.scale.shape}/{self.bias.shape} do not match ({rows}, {groups})"
            )
        if self.k_scales is not None and (self.group_size != 32 or self.k_scales.sc.shape != (rows, groups)):
            raise InvalidArgumentError(
                f"Q4_K factors {self.k_scales.sc.shape} need group size 32 and ({rows}, {groups}) groups"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def factors(self, rows: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """These rows' group scales and biases in float32: a Q4_K's exact ones where the weight has them (its
        ``scale`` is those rounded to float16), else ``scale`` and ``bias``."""
        if self.k_scales is not None:
            return self.k_scales.exact(rows)
        return self.scale[rows].astype(np.float32), self.bias[rows]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.k_scales is None else self.k_scales.nbytes
        return self.packed.nbytes + self.scale.nbytes + self.bias.nbytes + extra


@dataclass(frozen=True)
class Int8Weight:
    codes: np.ndarray  # int8 (rows, cols)
    scale: np.ndarray  # float16 or float32 (rows, cols // group_size)
    group_size: int = 32
    # What a runtime without int8 ops gets instead (for_runtime): float32 holds every q * scale exactly;
    # "float16" takes half that memory at float16 rounding (GGUF Q5_0, like the types perfx has no kernels for).
    dense_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.codes.ndim != 2 or self.codes.dtype != np.int8 or self.scale.dtype not in (np.float16, np.float32):
            raise InvalidArgumentError("Int8Weight wants 2-D codes int8 and scale float16 or float32")
        rows, cols = self.codes.shape
        if self.group_size not in INT8_GROUP_SIZES or cols % self.group_size:
            raise InvalidArgumentError(
                f"group size {self.group_size} must be one of {INT8_GROUP_SIZES} and divide {cols} columns"
            )
        if self.scale.shape != (rows, cols // self.group_size):
            raise InvalidArgumentError(
                f"scale shape {self.scale.shape} does not match ({rows}, {cols // self.group_size})"
            )
        if self.dense_dtype not in ("float32", "float16"):
            raise InvalidArgumentError(f"dense_dtype must be 'float32' or 'float16'; got {self.dense_dtype!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


@dataclass(frozen=True)
class DenseWeight:
    data: np.ndarray  # float32 or float16 (rows, cols)

    def __post_init__(self) -> None:
        if self.data.ndim != 2 or self.data.dtype not in (np.float32, np.float16):
            raise InvalidArgumentError("DenseWeight wants a 2-D float32 or float16 array")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class BlockWeight:
    """A weight still in its file's block format, for a runtime that converts that format on its device
    (``Runtime.block_formats``): uploading the file's bytes is cheaper than converting them on the host first.

    ``parts`` are stacked along the output rows (a fused QKV is three parts); each is (rows_i, bytes per row),
    usually a view of the mapped file. ``as_int4`` is the host conversion, for every other runtime.
    """

    parts: tuple[np.ndarray, ...]  # uint8 (rows_i, bytes per row)
    block_format: str  # a lower-case GGML type name: "q4_0", "q4_1"
    cols: int
    as_int4: Callable[[], Int4Weight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Weight = Int4Weight | Int8Weight | Int5Weight | Int6Weight | DenseWeight | BlockWeight


@dataclass(frozen=True)
class RowParts:
    """Weights stacked along the output rows that keep formats of their own, where one format for all of them
    would widen some (a Q4_K_M file's QKV: q and k are Q4_K, v is Q6_K in half the layers). The model projects
    each part into its own columns of the output (perfx_core.row_parts)."""

    parts: tuple[Weight, ...]

    def __post_init__(self) -> None:
        if len({p.shape[1] for p in self.parts}) != 1:
            raise InvalidArgumentError(f"row parts must share their columns; got {[p.shape for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def for_runtime(
    weight: Weight | RowParts, block_formats: frozenset[str], weight_formats: frozenset[str] = frozenset()
) -> Weight | RowParts:
    """``weight`` (a Weight or RowParts) in a form a runtime can take: one that converts ``block_formats`` itself
    and has the ops of ``weight_formats`` (``Runtime.weight_formats``: "int8", "int5", "int6")."""
    if isinstance(weight, RowParts):
        # Parts converted to one format fuse again (a Q5_0 q|k next to a Q8_0 v: one int8 matrix where int5 is not
        # taken); a file's blocks stay blocks (concat_rows keeps them apart without decoding them).
        return concat_rows([for_runtime(p, block_formats, weight_formats) for p in weight.parts])
    if isinstance(weight, BlockWeight) and weight.block_format not in block_formats:
        return weight.as_int4()
    if isinstance(weight, Int5Weight) and "int5" not in weight_formats:
        weight = int5_for_others(weight)
    if isinstance(weight, Int6Weight) and "int6" not in weight_formats:
        codes = int6_codes(weight.ql, weight.qh).view(np.int8)
        codes -= 32  # 0..63 -> -32..31
        weight = Int8Weight(codes, weight.scales(), INT6_SUB, "float16")  # GGUF Q6_K's int8 form, exact
    if isinstance(weight, Int8Weight) and "int8" not in weight_formats:
        return as_dense(weight)
    return weight


def int5_for_others(weight: Int5Weight) -> Int8Weight | DenseWeight:
    """An int5 weight for a runtime without int5 ops: an Int8Weight of codes - 16 where every bias is -16 times its
    scale (GGUF Q5_0: exact), else its values in float16."""
    if np.array_equal(weight.bias, (weight.scale.astype(np.float32) * np.float32(-16.0)).astype(np.float16)):
        codes = int5_codes(weight.low, weight.high)
        codes -= 16  # 0..31 -> -16..15: no wrap
        return Int8Weight(codes.view(np.int8), weight.scale, SPLIT_GROUP, "float16")
    return _dense_in_chunks(weight, split_rows, "float16")


def as_dense(weight: Int8Weight) -> DenseWeight:
    """An int8 weight's values in its ``dense_dtype``, a chunk of rows at a time (no float32 copy of the whole
    matrix on the way to a float16 one)."""
    return _dense_in_chunks(weight, int8_rows, weight.dense_dtype)


def _dense_in_chunks(weight, rows_of: Callable, dtype) -> DenseWeight:
    """DenseWeight of ``rows_of(weight, rows)`` (float32 values) in ``dtype``, about 1M values at a time."""
    return DenseWeight(_values_in_chunks(weight, rows_of, dtype))


def _values_in_chunks(weight, rows_of: Callable, dtype) -> np.ndarray:
    """(rows, cols) array of ``rows_of(weight, rows)`` in ``dtype``, about 1M values at a time: no whole-matrix
    temporaries next to the result."""
    rows, cols = weight.shape
    out = np.empty((rows, cols), dtype=dtype)
    step = max(1, (1 << 20) // cols)
    for r0 in range(0, rows, step):
        out[r0 : r0 + step] = rows_of(weight, slice(r0, r0 + step))
    return out


def int8_rows(weight: Int8Weight, rows: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of some rows of an int8 weight (a slice or an index array), into ``out`` if given."""
    codes, scale = weight.codes[rows], weight.scale[rows]
    n, cols = codes.shape
    g = weight.group_size
    if out is None:
        out = np.empty((n, cols), dtype=np.float32)
    groups = out.view()
    groups.shape = (n, cols // g, g)  # raises, rather than writing a copy, if out cannot be viewed so
    np.multiply(codes.reshape(n, -1, g), scale.astype(np.float32)[:, :, None], out=groups)
    return out


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack codes 0..15, shape (rows, cols) with even cols, into uint8 (rows, cols // 2)."""
    q = np.asarray(q, dtype=np.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4: uint8 (rows, cols // 2) -> uint8 codes (rows, cols)."""
    rows, half = packed.shape
    q = np.empty((rows, half * 2), dtype=np.uint8)
    q[:, 0::2] = packed & 0x0F
    q[:, 1::2] = packed >> 4
    return q


def dequantize(weight: Weight | RowParts, dtype: type = np.float32) -> np.ndarray:
    """Full-precision values of a weight, shape (rows, cols)."""
    if isinstance(weight, RowParts):
        return np.concatenate([dequantize(p, dtype) for p in weight.parts])
    if isinstance(weight, BlockWeight):
        weight = weight.as_int4()
    if isinstance(weight, DenseWeight):
        return weight.data.astype(dtype, copy=False)
    if isinstance(weight, Int8Weight):
        return int8_rows(weight, slice(None)).astype(dtype, copy=False)
    if isinstance(weight, Int5Weight | Int6Weight):
        return _values_in_chunks(weight, split_rows, dtype)
    rows, cols = weight.shape
    g = weight.group_size
    q = unpack_int4(weight.packed).reshape(rows, cols // g, g).astype(np.float32)
    scale, bias = weight.factors()
    w = q * scale[:, :, None] + bias[:, :, None]
    return w.reshape(rows, cols).astype(dtype, copy=False)


def int4_from_scale_zero(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group_size: int) -> Int4Weight:
    """Build an Int4Weight from AWQ-style codes (rows, cols), scales and zero points (rows, groups)."""
    scale16 = np.asarray(scale, dtype=np.float16)
    bias = -np.asarray(zero, dtype=np.float32) * scale16.astype(np.float32)
    return Int4Weight(pack_int4(q), scale16, bias.astype(np.float32), group_size)


def quantize_rtn(w: np.ndarray, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest asymmetric int4 quantization with integer zero points (AWQ's storage convention)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if group_size not in SUPPORTED_GROUP_SIZES or cols % group_size:
        raise InvalidArgumentError(
            f"group size {group_size} must be one of {SUPPORTED_GROUP_SIZES} and divide the {cols} input columns"
        )
    groups = w.reshape(rows, cols // group_size, group_size)
    lo = np.minimum(groups.min(axis=2), 0.0)
    hi = np.maximum(groups.max(axis=2), 0.0)
    scale = ((hi - lo) / 15.0).astype(np.float16).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))  # an all-zero group: any scale works
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(groups / scale[:, :, None]) + zero[:, :, None], 0, 15).astype(np.uint8)
    return int4_from_scale_zero(q.reshape(rows, cols), scale, zero, group_size)


def concat_rows(weights: list[Weight]) -> Weight | RowParts:
    """Stack weights along the output dimension (used for fused QKV and gate|up).

    Int4 weights with one group size stay int4, int8 weights int8, int5 int5, int6 int6; int8 ones mixed with dense
    ones become dense in their ``dense_dtype``. Any other mix (int4 next to int8, int4 groups of two sizes) stays as
    RowParts, each part in its own format, instead of widening all of them to float32.
    """
    if all(isinstance(w, BlockWeight) for w in weights) and len({(w.block_format, w.cols) for w in weights}) == 1:  # type: ignore[union-attr]
        parts = tuple(p for w in weights for p in w.parts)  # type: ignore[union-attr]
        return BlockWeight(
            parts, weights[0].block_format, weights[0].cols, lambda: concat_rows([w.as_int4() for w in weights])
        )  # type: ignore[union-attr]
    given = weights
    if any(isinstance(w, BlockWeight) for w in weights) and not all(
        isinstance(w, BlockWeight | Int4Weight) for w in weights
    ):
        return _row_parts(given)  # a file's blocks next to another format: never one matrix, so no host decode
    weights = [w.as_int4() if isinstance(w, BlockWeight) else w for w in weights]
    if all(isinstance(w, Int8Weight) for w in weights):
        # At the smallest group (a scale repeated over its smaller groups is the same weight), float32 scales
        # if any part has them (float16 ones widen exactly).
        group = min(w.group_size for w in weights)  # type: ignore[union-attr]
        return Int8Weight(
            np.concatenate([w.codes for w in weights]),  # type: ignore[union-attr]
            np.concatenate([np.repeat(w.scale, w.group_size // group, axis=1) for w in weights]),  # type: ignore[union-attr]
            group,
            "float16" if all(w.dense_dtype == "float16" for w in weights) else "float32",  # type: ignore[union-attr]
        )
    for split in (Int5Weight, Int6Weight):
        if all(isinstance(w, split) for w in weights):
            return split(*(np.concatenate(parts) for parts in zip(*(w.arrays for w in weights), strict=True)))
    if all(isinstance(w, Int4Weight) for w in weights) and len({w.group_size for w in weights}) == 1:  # type: ignore[union-attr]
        factors = [w.k_scales for w in weights]  # type: ignore[union-attr]
        joined = None
        if None not in factors:
            joined = Int4KScales(*(np.concatenate(a) for a in zip(*(f.arrays for f in factors), strict=True)))  # type: ignore[union-attr]
        return Int4Weight(
            np.concatenate([w.packed for w in weights]),  # type: ignore[union-attr]
            np.concatenate([w.scale for w in weights]),  # type: ignore[union-attr]
            np.concatenate([w.bias for w in weights]),  # type: ignore[union-attr]
            weights[0].group_size,  # type: ignore[union-attr]
            joined,
        )
    if all(isinstance(w, Int8Weight | DenseWeight) for w in weights):
        # Next to float32 parts an int8 one widens to float32 too (its values exactly), else to its dense_dtype.
        wide = any(isinstance(w, DenseWeight) and w.data.dtype == np.float32 for w in weights)
        weights = [
            (DenseWeight(int8_rows(w, slice(None))) if wide else as_dense(w)) if isinstance(w, Int8Weight) else w
            for w in weights
        ]
        if all(w.data.dtype == weights[0].data.dtype for w in weights):  # type: ignore[union-attr]
            return DenseWeight(np.concatenate([w.data for w in weights]))  # type: ignore[union-attr]
    return _row_parts(given)


def _row_parts(weights: list[Weight]) -> RowParts:
    """Neighbours of one format still share a matrix (q|k of a Q4_K_M QKV: one int4 part, then v)."""
    runs = [list(run) for _, run in itertools.groupby(weights, key=_format_key)]
    return RowParts(tuple(run[0] if len(run) == 1 else concat_rows(run) for run in runs))  # type: ignore[misc]


def _format_key(w: Weight) -> tuple:
    """Weights with equal keys concatenate into one matrix of their format."""
    if isinstance(w, BlockWeight):
        return ("block", w.block_format)
    if isinstance(w, Int4Weight):
        return ("int4", w.group_size)
    if isinstance(w, Int8Weight):
        return ("int8",)
    if isinstance(w, Int5Weight):
        return ("int5",)
    if isinstance(w, Int6Weight):
        return ("int6",)
    return ("dense", w.data.dtype.str)


def take_rows(weight: Weight, order: np.ndarray) -> Weight:
    """The same weight with its output rows reordered (exact for every format)."""
    if isinstance(weight, BlockWeight):
        weight = weight.as_int4()
    if isinstance(weight, DenseWeight):
        return DenseWeight(np.ascontiguousarray(weight.data[order]))
    if isinstance(weight, Int8Weight):
        return Int8Weight(
            np.ascontiguousarray(weight.codes[order]),
            np.ascontiguousarray(weight.scale[order]),
            weight.group_size,
            weight.dense_dtype,
        )
    if isinstance(weight, Int5Weight | Int6Weight):
        return type(weight)(*(np.ascontiguousarray(a[order]) for a in weight.arrays))
    factors = weight.k_scales
    return Int4Weight(
        np.ascontiguousarray(weight.packed[order]),
        np.ascontiguousarray(weight.scale[order]),
        np.ascontiguousarray(weight.bias[order]),
        weight.group_size,
        None if factors is None else Int4KScales(*(np.ascontiguousarray(a[order]) for a in factors.arrays)),
    )
