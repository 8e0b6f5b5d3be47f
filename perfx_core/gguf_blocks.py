"""GGML tensor blocks -> perfx weight formats, a chunk of rows at a time, on a pool of threads.

Each decoder here is a pure function from a chunk of a tensor's rows (as stored in the file) to the same rows in
perfx's format. ``convert_rows`` runs one over every chunk, in parallel: NumPy releases the GIL in the work that
matters (gathers, bit operations, casts), and converting a 7B file is the bulk of loading it. Chunks are 256K
elements, so temporaries stay small next to the result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .split_weights import NIBBLE_SHIFTS, pack_int5
from .weights import Int4KScales

_CHUNK_ELEMENTS = 1 << 18  # per chunk; a worker holds a few bytes of temporaries per element
QK_K = 256  # values per K-quant super-block

# One decoder: stored rows (uint8 blocks or typed values) -> the output arrays' rows, in output order.
Decoder = Callable[[np.ndarray], tuple[np.ndarray, ...]]


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 16), thread_name_prefix="perfx-convert")


def row_chunks(rows: int, cols: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        yield slice(r, min(r + step, rows))


def convert_rows(
    raw: np.ndarray, cols: int, outputs: tuple[np.ndarray, ...], decode: Decoder, order: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Fill ``outputs`` (each with one row per output row) with ``decode`` of the stored rows.

    Output row ``r`` comes from stored row ``order[r]`` (``r`` without an order), so a row permutation costs no
    extra pass over the tensor.
    """

    def one(rs: slice) -> None:
        stored = np.asarray(raw[rs] if order is None else raw[order[rs]])
        for out, part in zip(outputs, decode(stored), strict=True):
            out[rs] = part

    chunks = list(row_chunks(outputs[0].shape[0], cols))
    if len(chunks) == 1:
        one(chunks[0])
    else:
        for _ in _pool().map(one, chunks):  # re-raises the first failure
            pass
    return outputs


# -- int8 types: codes times a scale per block of 32 (Q8_0, Q5_0; float16) or 16 (Q6_K; float32) -------------


def q8_0_decode(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q8_0 blocks (d float16, 32 int8 codes) -> (codes int8, scale float16) of int8 group 32, bit for bit."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 34)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16)[:, :, 0]
    return b[:, :, 2:].view(np.int8).reshape(rows, -1), d


def q5_0_decode(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q5_0 blocks (d float16, 32 high bits, 16 bytes of low nibbles) -> the same int8 group-32 form: code
    ``(low | high << 4) - 16`` in -16..15. Element j < 16 is byte j's low nibble and bit j of the high bits,
    element j + 16 its high nibble and bit j + 16."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 22)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16)[:, :, 0]
    bits = np.unpackbits(b[:, :, 2:6], axis=2, bitorder="little")  # bit j of the little-endian uint32: (rows, nb, 32)
    bits <<= 4
    qs = b[:, :, 6:]
    bits[:, :, :16] |= qs & 0x0F
    bits[:, :, 16:] |= qs >> 4
    codes = bits.view(np.int8)
    codes -= 16  # 0..31 -> -16..15, in place (no wrap: the stored value is below 32)
    return codes.reshape(rows, -1), d


_Q6_K_SHIFTS_LOW = np.array([0, 4], np.uint8).reshape(2, 1)
_Q6_K_SHIFTS_HIGH = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)


def q6_k_decode(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-scales, d float16)
    -> (codes int8 in -32..31, scale float32 per 16: d times its sub-scale, exact in float32).

    Each half of 128 elements: element 64 * n + i is nibble n (low, high) of low byte i and element 32 * p + i
    holds bit pair p of high byte i; the code is ``(low | high << 4) - 32``."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 210)
    nb = b.shape[1]
    low = (b[:, :, :128].reshape(rows, nb, 2, 1, 64) >> _Q6_K_SHIFTS_LOW) & 0x0F
    high = (b[:, :, 128:192].reshape(rows, nb, 2, 1, 32) >> _Q6_K_SHIFTS_HIGH) & 0x03
    codes = (low.reshape(rows, nb, 256) | (high.reshape(rows, nb, 256) << 4)).view(np.int8)
    codes -= 32  # 0..63 -> -32..31, in place
    sub = b[:, :, 192:208].view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(b[:, :, 208:210]).view(np.float16).astype(np.float32)
    return codes.reshape(rows, nb * 256), (d * sub).reshape(rows, nb * 16)


# -- 5-bit types: Int5Weight's (low nibbles, fifth bits, float16 scale, float16 bias) per group of 32 ----------


def q5_0_int5(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q5_0 blocks (d float16, 32 fifth bits, 16 bytes of low nibbles) -> (low, high, d, -16 d): the block's own
    nibbles and bits (Int5Weight keeps GGML's order), code ``q`` with ``bias = -16 d`` exactly (an infinity where
    16 d overflows float16; the loader then takes the int8 form)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 22)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16)[:, :, 0]
    high = np.ascontiguousarray(b[:, :, 2:6]).view("<u4")[:, :, 0]
    with np.errstate(over="ignore"):
        bias = (d.astype(np.float32) * np.float32(-16.0)).astype(np.float16)
    return b[:, :, 6:].reshape(rows, -1), high, d, bias


def q5_1_int5(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q5_1 blocks (d, m float16, 32 fifth bits, 16 bytes of low nibbles) -> (low, high, d, m), bit for bit."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 24)
    dm = np.ascontiguousarray(b[:, :, :4]).view(np.float16)
    high = np.ascontiguousarray(b[:, :, 4:8]).view("<u4")[:, :, 0]
    return b[:, :, 8:].reshape(rows, -1), high, dm[:, :, 0], dm[:, :, 1]


def q5_k_int5(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q5_K super-blocks of 256 (d, dmin float16, 12 bytes of 6-bit sub-scales and mins, 32 bytes of fifth bits,
    128 of low nibbles) -> groups of 32 with scale ``d * sc`` and bias ``-dmin * m``, both rounded to float16.

    Chunk c of 64 elements: byte i of its 32 nibble bytes holds element 64c + i (low) and 64c + 32 + i (high);
    their fifth bits are bits 2c and 2c + 1 of fifth-bit byte i."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 176)
    nb = b.shape[1]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
    sc, m = _q4_k_scales(b[:, :, 4:16])
    with np.errstate(over="ignore"):
        scale = (d[:, :, None] * sc).astype(np.float16).reshape(n, -1)
        bias = (-(dmin[:, :, None] * m)).astype(np.float16).reshape(n, -1)
    qs = b[:, :, 48:].reshape(n, nb, 4, 1, 32)
    nibbles = (qs >> NIBBLE_SHIFTS) & 0x0F  # (n, nb, chunk, half, 32): sub-block 2c + half
    fifth = (b[:, :, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # (n, nb, sub-block, 32)
    codes = nibbles.reshape(n, nb * 8, 32) | (fifth.reshape(n, nb * 8, 32) << 4)
    low, high = pack_int5(codes.reshape(n, nb * QK_K))
    return low, high, scale, bias


def q6_k_int6(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-scales, d float16)
    -> Int6Weight's (ql, qh, sub, d): the blocks' own bytes, split into one array each."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 210)
    nb = b.shape[1]
    sub = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).reshape(rows, nb * 16)
    d = np.ascontiguousarray(b[:, :, 208:210]).view(np.float16)[:, :, 0]
    return b[:, :, :128].reshape(rows, nb * 128), b[:, :, 128:192].reshape(rows, nb * 64), sub, d


# -- float types ------------------------------------------------------------------------------------------


def dequantize_f16(t: GGMLQuantizationType) -> Decoder:
    """Any type the gguf library can dequantize, as float16 (raises NotImplementedError for the others)."""
    return lambda blocks: (gguf_quants.dequantize(blocks, t).astype(np.float16),)


# -- int4 types ---------------------------------------------------------------------------------------------


@cache
def _nibble_tables() -> tuple[np.ndarray, np.ndarray]:
    """For each little-endian pair of GGML bytes (b0, b1): the perfx byte of their low nibbles and of their
    high ones. GGML's byte j holds element j (low nibble) and j + 16 (high); perfx's byte k holds 2k and 2k + 1."""
    pair = np.arange(1 << 16, dtype=np.uint32)
    b0, b1 = pair & 0xFF, pair >> 8
    low = ((b0 & 0x0F) | ((b1 & 0x0F) << 4)).astype(np.uint8)
    high = ((b0 >> 4) | (b1 & 0xF0)).astype(np.uint8)
    return low, high


def q4_decoder(t: GGMLQuantizationType) -> Decoder:
    """Q4_0 / Q4_1 blocks -> (packed, scale, bias) of int4 group 32, bit for bit."""
    has_min = t == GGMLQuantizationType.Q4_1
    block_bytes = GGML_QUANT_SIZES[t][1]
    low, high = _nibble_tables()

    def decode(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
        n = blocks.shape[0]
        b = blocks.reshape(n, -1, block_bytes)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]
        if has_min:
            bias = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)
        else:
            bias = d.astype(np.float32) * np.float32(-8.0)  # (q - 8) * d == q * d + (-8 d), exactly
        pairs = np.ascontiguousarray(b[:, :, block_bytes - 16 :]).view(np.uint16)  # (n, nb, 8)
        packed = np.empty((n, b.shape[1], 16), np.uint8)
        np.take(low, pairs, out=packed[:, :, :8])  # elements 0..15 of each block
        np.take(high, pairs, out=packed[:, :, 8:])  # elements 16..31
        return packed.reshape(n, -1), d, bias

    return decode


def _q4_k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and min of each of a Q4_K block's 8 sub-blocks, from its 12 packed bytes (..., 12)."""
    sc = sc.astype(np.uint8)
    scale = np.empty((*sc.shape[:-1], 8), np.uint8)
    mins = np.empty_like(scale)
    scale[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scale[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return scale, mins


def q4_k_decode(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K as int4 with groups of 32: its codes as they are, scale d * sc (float16) and bias -dmin * m (float32,
    exact), so a value differs from the file's only by the float16 rounding of its group's scale; then the exact
    factors (d, dmin float16 per 256 columns; sc, m uint8 per 32: weights.Int4KScales)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 144)  # d (2), dmin (2), scales (12), qs (128)
    nb = b.shape[1]
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0]
    dmin = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0]
    sc, m = _q4_k_scales(b[:, :, 4:16])
    factors = Int4KScales(d, dmin, sc.reshape(n, -1), m.reshape(n, -1))
    qs = b[:, :, 16:].reshape(n, nb, 4, 32)  # 4 chunks of 64 values: low nibbles 32 values, high the next 32
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * QK_K)  # in column order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, *factors.scale_bias(), *factors.arrays
