"""The numba kernels of perfx-numba-cpu. Every kernel writes only into the arrays it is handed as outputs.

Compiled on first call and cached on disk (``cache=True``, in ``__pycache__`` next to this file or in
NUMBA_CACHE_DIR), so a second process starts without compiling. Every kernel releases the GIL
(``nogil=True``): a desktop app's UI thread keeps running while a worker thread decodes.

Fast-math: the flags that let LLVM vectorize float reductions (reassociation, contraction to FMA,
reciprocals, no signed zeros) but not ``nnan``/``ninf``: the fused gate_up_silu kernel relies on
``exp(-g)`` overflowing to inf for very negative g (g / inf = -0, as the contract asks).
"""

from __future__ import annotations

import math
import types

import numpy as np
from numba import njit, prange
from numba import types as nbtypes
from numba.extending import overload

from .vector_dot import (
    floats_to_halves,
    halves_to_floats,
    int4_pairs_dot,
    int5_rows_dot,
    int6_rows_dot,
    scaled_accumulate,
    scaled_rows_dot,
)

FM = {"reassoc", "contract", "arcp", "nsz", "afn"}
F32 = np.float32


def _twin(dispatcher, name, parallel=False, **names):
    """Another compilation of a kernel's loops, cached under its own name: single-threaded by default (prange
    runs as range), and with ``names`` replacing globals the kernel calls (the int8 kernels' float32 scales).

    On a machine shared with other work a parallel region waits for its slowest thread, which may not be
    scheduled for milliseconds; small calls are faster and far steadier on one thread.
    """
    fn = dispatcher.py_func
    scope = {**fn.__globals__, **names} if names else fn.__globals__
    twin = types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
    twin.__qualname__ = name
    twin.__module__ = fn.__module__
    twin.__doc__ = fn.__doc__
    return njit(parallel=parallel, fastmath=FM, cache=True, nogil=True)(twin)


# -- int4: packed nibbles, per-group float32 scale and bias ----------------------------------------------
ROWS = 64  # rows per block of the GEMV layout: the vectorized loop runs across them
# Rows of x one pass over a weight column serves in the multi-row kernels (batched decode): decoding a byte's
# nibbles costs more than the two multiply-adds a row of x adds to it, so it is done once for TILE rows.
TILE = 4
# Up to this many rows the int4 kernels go row by row: two rows padded to a tile of four cost 1.05-1.25x what two
# single-row passes cost (3072 x 576, one thread).
ROW_BY_ROW = 2
# Rows of a block the int4 dot sums at once (vector_dot.int4_pairs_dot): a tile's 4 x 16 int32 sums fit AVX2's 16
# registers, 4 x 64 spilled every column; 12% less time per row of a 4- or 8-row batch at 3072 x 576 and 576 x 1536
# (`PERFX_NUMBA_PARALLEL=never python benchmarks/bench_cpu_rows.py --rows 1,2,4,8`, VM). One row keeps all 64.
ROW_CHUNK_1 = 64
ROW_CHUNK_TILE = 16
pairs_dot1 = int4_pairs_dot(1, ROWS, ROW_CHUNK_1)
pairs_dot_tile = int4_pairs_dot(TILE, ROWS, ROW_CHUNK_TILE)
accumulate_row = scaled_accumulate(ROWS, 1)
accumulate_tile = scaled_accumulate(ROWS, TILE)
widen_rows = halves_to_floats(ROWS)
widen_16 = halves_to_floats(16)
narrow_16 = floats_to_halves(16)


def int4_block_layout(packed, scale, bias, k_scales=None):
    """The one copy of an int4 weight the plugin keeps (NumPy, once per weight): rows in blocks of ROWS, transposed.

    ``codes[b, j, t]`` is byte j of row ``b * ROWS + t`` and ``scales[b, g, t]``/``biases[b, g, t]`` its
    group g, rows padded with zeros to a whole block. The GEMV kernels walk a byte column of a block with one
    vector across ROWS rows, so the sum over a group needs no horizontal reduction. Scales are the weight's
    float16 bits (as int16, widened by vector conversions); biases too where float16 holds every one of them exactly
    (GGUF Q4_1), else float32; none where each is -8 times its scale (GGUF Q4_0: an int8 array of no groups marks
    it, and the kernels compute them). ``supers`` is empty then.

    With Q4_K's factors (weights.Int4KScales, a tuple d, dmin, sc, m) the scales and biases are its uint8 sc and m
    per 32 columns and ``supers[b, 2s]``/``supers[b, 2s + 1]`` the float16 bits of d/dmin of its 256 columns s: the
    kernels multiply them out (exactly, in float32), and a weight takes 0.58 bytes against 0.69 for float16 scales
    and float32 biases.
    """
    m, half = packed.shape
    blocks = (m + ROWS - 1) // ROWS
    if k_scales is not None:
        d, dmin, sc, mins = k_scales
        supers = np.empty((m, 2 * d.shape[1]), np.int16)
        supers[:, 0::2], supers[:, 1::2] = d.view(np.int16), dmin.view(np.int16)
        return tuple(_blocked(a, blocks) for a in (packed, sc, mins, supers))
    if np.array_equal(bias, -8.0 * scale.astype(np.float32)):
        bias = np.zeros((m, 0), np.int8)
    else:
        bias16 = bias.astype(np.float16)
        exact = bool(np.array_equal(bias16.astype(np.float32), bias, equal_nan=True))
        bias = bias16.view(np.int16) if exact else bias
    scale = np.ascontiguousarray(scale).view(np.int16)
    supers = np.zeros((blocks, 0, ROWS), np.int16)
    return (*(_blocked(a, blocks) for a in (packed, scale, bias)), supers)


def _blocked(rows, blocks):
    """(m, c) row-major -> (blocks, c, ROWS), rows padded with zeros."""
    m, c = rows.shape
    out = np.zeros((blocks, c, ROWS), rows.dtype)
    for b in range(blocks):
        part = rows[b * ROWS : (b + 1) * ROWS]
        out[b, :, : part.shape[0]] = part.T
    return out


def int4_row_major(codes, scales, biases, supers, m):
    """The row-major (packed, scale float16, bias float32, None) of a weight in int4_block_layout (perfx_core's
    Int4Weight arrays), for a generic op that asks for them; of a Q4_K layout (packed, None, None, its factors
    d, dmin, sc, m), whose scale and bias weights.Int4KScales.scale_bias gives."""

    def unblocked(a):
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1])[:m])

    if scales.dtype == np.uint8:
        factors = unblocked(supers)
        d, dmin = (np.ascontiguousarray(factors[:, i::2]).view(np.float16) for i in (0, 1))
        return unblocked(codes), None, None, (d, dmin, unblocked(scales), unblocked(biases))
    scale = unblocked(scales).view(np.float16)
    if biases.dtype == np.int8:  # Q4_0
        return unblocked(codes), scale, -8.0 * scale.astype(np.float32), None
    bias = unblocked(biases)
    bias = bias.view(np.float16).astype(np.float32) if bias.dtype == np.int16 else bias
    return unblocked(codes), scale, bias, None


def _group_row(values, g, buffer):
    """Group g of a block's scales or biases (int4_block_layout) as ROWS float32: float16 bits widened into
    ``buffer``, float32 as they are (a view)."""


@overload(_group_row, inline="always")
def _group_row_impl(values, g, buffer):
    if values.dtype == nbtypes.int16:

        def widened(values, g, buffer):
            widen_rows(values, g * ROWS, buffer)
            return buffer

        return widened
    return lambda values, g, buffer: values[g]


def _group_values(scales_b, biases_b, supers_b, g, sbuf, bbuf):
    """Group g's scales and biases of a block's ROWS rows as float32 (int4_block_layout's forms): widened or taken
    as they are (_group_row), or Q4_K's ``d * sc`` and ``-dmin * m`` multiplied out into sbuf and bbuf."""


@overload(_group_values, inline="always")
def _group_values_impl(scales_b, biases_b, supers_b, g, sbuf, bbuf):
    if scales_b.dtype == nbtypes.uint8:

        def factored(scales_b, biases_b, supers_b, g, sbuf, bbuf):
            s = g // (2 * scales_b.shape[0] // supers_b.shape[0])  # the group's 256 columns
            widen_rows(supers_b, 2 * s * ROWS, sbuf)
            widen_rows(supers_b, (2 * s + 1) * ROWS, bbuf)
            for t in range(ROWS):
                sbuf[t] = sbuf[t] * F32(scales_b[g, t])
                bbuf[t] = -(bbuf[t] * F32(biases_b[g, t]))
            return sbuf, bbuf

        return factored
    if biases_b.dtype == nbtypes.int8:  # Q4_0: no biases stored

        def symmetric(scales_b, biases_b, supers_b, g, sbuf, bbuf):
            s = _group_row(scales_b, g, sbuf)
            for t in range(ROWS):
                bbuf[t] = F32(-8.0) * s[t]
            return s, bbuf

        return symmetric
    return lambda scales_b, biases_b, supers_b, g, sbuf, bbuf: (
        _group_row(scales_b, g, sbuf),
        _group_row(biases_b, g, bbuf),
    )


def _cache_row(rows, t, buffer):
    """Row t of a (positions, head_dim) cache view as float32: itself, or a float16 cache's bits (int16) widened
    into ``buffer`` (attention_decode's float16 caches)."""


@overload(_cache_row, inline="always")
def _cache_row_impl(rows, t, buffer):
    if rows.dtype == nbtypes.int16:

        def widened(rows, t, buffer):
            hd = buffer.shape[0]
            for c in range(hd // 16):
                widen_16(rows, t * hd + 16 * c, buffer[16 * c :])
            return buffer

        return widened
    return lambda rows, t, buffer: rows[t]


@njit(fastmath=FM, cache=True, nogil=True)
def _x_pairs(x, groups):
    """x (n, k) for the int4 kernels: (ok, xq, xs, sums) with xq (n', k/2) int32 the int16 rounding of x per group
    (quantize_x_int16, viewed as pairs of columns), xs (n', groups) its scales and sums (n', groups) the float sums
    of each group; n' is n up to ROW_BY_ROW rows and n rounded up to whole TILEs (zero rows) beyond, so the tiled
    loops need no remainder. ok is False where x holds an infinity or NaN (the caller then takes the float path)."""
    n, k = x.shape
    padded = n if n <= ROW_BY_ROW else (n + TILE - 1) // TILE * TILE
    size = k // groups
    xq = np.zeros((padded, k), dtype=np.int16)
    xs = np.zeros((padded, groups), dtype=np.float32)
    sums = np.zeros((padded, groups), dtype=np.float32)
    ok = quantize_x_int16(x, size, xq, xs)
    if ok:
        for j in range(n):
            xr = x[j]
            for g in range(groups):
                s = F32(0.0)
                for i in range(g * size, (g + 1) * size):
                    s += xr[i]
                sums[j, g] = s
    return ok, xq.view(np.int32), xs, sums


@njit(fastmath=FM, cache=True, nogil=True)
def _block_dots(codes_b, scales_b, biases_b, supers_b, xq, xs, sums, j0, tile, acc, dots):
    """acc (tile, ROWS) = the block's rows . x rows j0 .. j0 + tile - 1 (tile 1 or TILE), group by group:
    ``scale * xs * (q_g . xq_g) + bias * sum(x_g)``, the integer dots from the pairs intrinsic."""
    half, rows = codes_b.shape
    groups = scales_b.shape[0]
    hg = half // groups
    for jj in range(tile):
        for t in range(rows):
            acc[jj, t] = 0.0
    for g in range(groups):
        if tile == 1:
            pairs_dot1(codes_b, g * hg, (g + 1) * hg, xq, j0, dots)
            accumulate_row(scales_b, biases_b, supers_b, g, xs, sums, j0, dots, acc)
        else:
            pairs_dot_tile(codes_b, g * hg, (g + 1) * hg, xq, j0, dots)
            accumulate_tile(scales_b, biases_b, supers_b, g, xs, sums, j0, dots, acc)


@njit(fastmath=FM, cache=True, nogil=True)
def _block_into(codes_b, scales_b, biases_b, supers_b, xq, xs, sums, n, dst, c0, c1):
    """dst[j, c0:c1] = the block's first c1 - c0 rows . x row j, for the n rows of x: row by row up to
    ROW_BY_ROW rows, TILE rows at a time beyond (xq, xs, sums from _x_pairs)."""
    rows = codes_b.shape[1]
    tile = 1 if n <= ROW_BY_ROW else TILE
    acc = np.empty((tile, rows), dtype=np.float32)
    dots = np.empty((tile, rows), dtype=np.int32)
    for j0 in range(0, n, tile):
        _block_dots(codes_b, scales_b, biases_b, supers_b, xq, xs, sums, j0, tile, acc, dots)
        for jj in range(min(tile, n - j0)):
            drow = dst[j0 + jj]
            arow = acc[jj]
            for c in range(c0, c1):
                drow[c] = arow[c - c0]


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int4_matvec(codes, scales, biases, supers, x, out):
    """out (n, m) = x (n, k) @ W.T for W[r, c] = q[r, c] * scale[r, c // g] + bias[r, c // g]; False (out
    untouched) where x holds an infinity or NaN.

    W in int4_block_layout; x rounded to int16 per group (_x_pairs), which adds an NMSE of ~1e-9. Per group:
    ``s * xs * (q_g . xq_g) + b * sum(x_g)``, the dot in integers (vector_dot.int4_pairs_dot), twice as fast
    as the same loop in float32 at SmolLM2's shapes. Parallel over blocks; more than ROW_BY_ROW rows of x go
    TILE rows at a time, each byte column widened once for them (`PERFX_NUMBA_PARALLEL=never python
    benchmarks/bench_cpu_rows.py` times a row of a batch against a lone row).
    """
    blocks, half, rows = codes.shape
    n, m = out.shape
    ok, xq, xs, sums = _x_pairs(x, scales.shape[1])
    if not ok:
        return False
    for b in prange(blocks):
        _block_into(codes[b], scales[b], biases[b], supers[b], xq, xs, sums, n, out, b * rows, min(m, b * rows + rows))
    return True


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int4_matvec_add_rmsnorm(codes, scales, biases, supers, x, residual, weight, eps, out):
    """residual (n, m) += x (n, k) @ W.T (in place); out (n, m) = rmsnorm(residual) * weight; False (nothing
    written) where x holds an infinity or NaN.

    int4_matvec (parallel over blocks) into a local row, then add_rmsnorm's loops, in one call.
    """
    blocks, half, rows = codes.shape
    n, m = out.shape
    ok, xq, xs, sums = _x_pairs(x, scales.shape[1])
    if not ok:
        return False
    delta = np.empty((n, blocks * rows), dtype=np.float32)
    for b in prange(blocks):
        _block_into(codes[b], scales[b], biases[b], supers[b], xq, xs, sums, n, delta, b * rows, b * rows + rows)
    for j in range(n):
        _add_rmsnorm_row(delta[j], F32(1.0), None, residual[j], weight, eps, out[j])
    return True


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int4_gate_up_silu(codes, scales, biases, supers, x, out):
    """out (n, f) = silu(x @ Wg.T) * (x @ Wu.T) for W = [Wg; Wu] (2f, k) in int4_block_layout, f % ROWS == 0;
    False (out untouched) where x holds an infinity or NaN."""
    blocks, half, rows = codes.shape
    n, f = out.shape
    fb = f // rows
    ok, xq, xs, sums = _x_pairs(x, scales.shape[1])
    if not ok:
        return False
    tile = 1 if n <= ROW_BY_ROW else TILE
    for b in prange(fb):
        acc_g = np.empty((tile, rows), dtype=np.float32)
        acc_u = np.empty((tile, rows), dtype=np.float32)
        dots = np.empty((tile, rows), dtype=np.int32)
        bu = b + fb
        for j0 in range(0, n, tile):
            _block_dots(codes[b], scales[b], biases[b], supers[b], xq, xs, sums, j0, tile, acc_g, dots)
            _block_dots(codes[bu], scales[bu], biases[bu], supers[bu], xq, xs, sums, j0, tile, acc_u, dots)
            for jj in range(min(tile, n - j0)):
                orow = out[j0 + jj]
                ag = acc_g[jj]
                au = acc_u[jj]
                for t in range(rows):
                    g = ag[t]
                    orow[b * rows + t] = g / (F32(1.0) + math.exp(-g)) * au[t]
    return True


@njit(fastmath=FM, cache=True, nogil=True)
def _byte_values(byte, s, bias):
    """The two weights a code byte holds, ``q * s + bias`` for its low nibble then its high one.

    The nibbles are taken in float (the low one is ``byte - 16 * high``, exact) because numba widens integer ``&``
    and ``>>`` to int64 (8 lanes per AVX-512 vector, not 16).
    """
    p = F32(byte)
    h = np.floor(p * F32(0.0625))
    return (p - F32(16.0) * h) * s + bias, h * s + bias


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int4_dequantize_t(codes, scales, biases, supers, b0, dst):
    """dst (k, c) float32 = the transpose of rows b0 * ROWS .. b0 * ROWS + c of the weight in int4_block_layout
    (c a multiple of ROWS), for BLAS: ``x @ dst`` is x times those rows. A block's byte column holds its ROWS rows
    side by side, so each column of W.T is written ROWS floats at a time."""
    half = codes.shape[1]
    groups = scales.shape[1]
    hg = half // groups
    for b in prange(dst.shape[1] // ROWS):
        cb = codes[b0 + b]
        sb = scales[b0 + b]
        bb = biases[b0 + b]
        ub = supers[b0 + b]
        c0 = b * ROWS
        sbuf = np.empty(ROWS, np.float32)
        bbuf = np.empty(ROWS, np.float32)
        for g in range(groups):
            s, bias = _group_values(sb, bb, ub, g, sbuf, bbuf)
            for i in range(g * hg, (g + 1) * hg):
                lo = dst[2 * i]
                hi = dst[2 * i + 1]
                col = cb[i]
                for t in range(ROWS):
                    lo[c0 + t], hi[c0 + t] = _byte_values(col[t], s[t], bias[t])


@njit(fastmath=FM, cache=True, nogil=True)
def int4_rows(codes, scales, biases, supers, ids, out):
    """out (len(ids), k) float32 = rows ``ids`` of the weight in int4_block_layout (an embedding lookup)."""
    half = codes.shape[1]
    groups = scales.shape[1]
    hg = half // groups
    sbuf = np.empty(ROWS, np.float32)
    bbuf = np.empty(ROWS, np.float32)
    for j in range(len(ids)):
        b, t = divmod(ids[j], ROWS)
        orow = out[j]
        for g in range(groups):
            s_row, bias_row = _group_values(scales[b], biases[b], supers[b], g, sbuf, bbuf)
            s, bias = s_row[t], bias_row[t]
            for i in range(g * hg, (g + 1) * hg):
                orow[2 * i], orow[2 * i + 1] = _byte_values(codes[b, i, t], s, bias)


# -- int8: codes with a scale per group (perfx_core.weights.Int8Weight, GGUF Q8_0 / Q5_0 / Q6_K) ------------
def f16_table():
    """float32 value of every float16 bit pattern, by the pattern read as uint16 (256 KiB). numba has no float16,
    so the kernels take a weight's scales as their bits viewed as int16 and look them up here, exactly, once per
    group: a negative index wraps around to the same pattern read as uint16 (indexing by uint16 ran 10% slower
    here, numba widening it on every lookup)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always", cache=True, nogil=True)
def _group_scale(scales, r, b, f16):
    """Group b's scale of row r, from float16 bits (f16_table)."""
    return f16[scales[r, b]]


@njit(inline="always", cache=True, nogil=True)
def _own_scale(scales, r, b, f16):
    """Group b's scale of row r, stored as float32 (Q6_K's d * sub-scale): the *_f32 kernels' _group_scale."""
    return scales[r, b]


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int8_matvec(q, scales, f16, x, out):
    """out (n, m) = x (n, k) @ W.T, W[r, c] = q[r, c] * (row r's scale of group c // (k / groups)); ``scales``
    are float16 bits viewed as int16 (looked up in ``f16``, f16_table), float32 in int8_matvec_f32.

    Three rows of x or more: TILE rows per pass over a weight row (x padded with zero rows to whole tiles), each
    code widened once for all of them (for two rows the padding costs more than it saves): a row of a batch costs
    0.61-0.65 of a lone row at SmolLM2's 49152 x 576 LM head (bench_cpu_rows.py, one thread)."""
    m, k = q.shape
    nb = scales.shape[1]
    block = k // nb
    n = x.shape[0]
    if n < 3:
        for r in prange(m):
            qrow = q[r]
            for j in range(n):
                xj = x[j]
                acc = F32(0.0)
                for b in range(nb):
                    base = b * block
                    s = F32(0.0)
                    for i in range(block):
                        s += F32(qrow[base + i]) * xj[base + i]
                    acc += _group_scale(scales, r, b, f16) * s
                out[j, r] = acc
        return
    tiles = (n + TILE - 1) // TILE
    xp = np.zeros((tiles * TILE, k), dtype=np.float32)
    xp[:n] = x
    for r in prange(m):
        qrow = q[r]
        for tile in range(tiles):
            j0 = tile * TILE
            x0, x1, x2, x3 = xp[j0], xp[j0 + 1], xp[j0 + 2], xp[j0 + 3]
            a0 = a1 = a2 = a3 = F32(0.0)
            for b in range(nb):
                base = b * block
                s0 = s1 = s2 = s3 = F32(0.0)
                for i in range(block):  # (not range(base, base + block): its indices vectorize as gathers)
                    c = F32(qrow[base + i])
                    s0 += c * x0[base + i]
                    s1 += c * x1[base + i]
                    s2 += c * x2[base + i]
                    s3 += c * x3[base + i]
                sc = _group_scale(scales, r, b, f16)
                a0 += sc * s0
                a1 += sc * s1
                a2 += sc * s2
                a3 += sc * s3
            for jj, a in enumerate((a0, a1, a2, a3)):
                if j0 + jj < n:
                    out[j0 + jj, r] = a


# x in int16 per piece of a group (16 or 32 columns, the weight's group size); a row is then one intrinsic
# (vector_dot.scaled_rows_dot): int8 * int16 products added pairwise in integers, scaled per group into one float
# vector. The float loop above converts every code to float32 and sums each group horizontally, which bounds it:
# at Gemma 3's 262144 x 640 Q8_0 output matrix one row of x takes 4.0 against 5.4-5.8 ms on two threads (the
# machine reads those 168 MB in ~4 ms), 8 rows 19 against 32 ms. x's rounding to int16 (a scale per piece,
# max |x| / 32767) adds an NMSE of ~1e-9.
INT16_STEP = F32(32767.0)


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _piece_step(xr, p, lanes, xs_row):
    """Piece p (``lanes`` columns) of the row xr: its int16 step max |x| / 32767 into xs_row[p], and 1 / step (0 for a
    zero step); -1 where the piece holds an infinity or NaN, which the float kernels propagate instead."""
    amax = F32(0.0)
    for i in range(p * lanes, p * lanes + lanes):
        v = xr[i]
        if v != v:  # NaN (max() would skip it)
            return F32(-1.0)
        amax = max(amax, abs(v))
    if not math.isfinite(amax):
        return F32(-1.0)
    # A piece below 1e-30 counts as zero: 1 / s would overflow for the smallest floats.
    s = amax / INT16_STEP if amax >= F32(1e-30) else F32(0.0)
    xs_row[p] = s
    return F32(0.0) if s == 0 else F32(1.0) / s


@njit(fastmath=FM, cache=True, nogil=True)
def quantize_x_int16(x, lanes, xq, xs):
    """xq (n, k) int16 and xs (n, k // lanes) float32 with x ~= xq * xs per piece of ``lanes`` columns; False
    (and xq, xs unfinished) when a piece holds an infinity or NaN, which the float kernel propagates instead."""
    n, k = x.shape
    for j in range(n):
        xr = x[j]
        for p in range(k // lanes):
            inv = _piece_step(xr, p, lanes, xs[j])
            if inv < 0:
                return False
            for i in range(p * lanes, p * lanes + lanes):
                xq[j, i] = np.int16(round(xr[i] * inv))
    return True


dot16_row = scaled_rows_dot(16, 1)
dot32_row = scaled_rows_dot(32, 1)
dot16_tile = scaled_rows_dot(16, TILE)
dot32_tile = scaled_rows_dot(32, TILE)


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int8_matvec_int16(q, scales, f16, xq, xs, out):
    """out (n, m) = x @ W.T as int8_matvec, for a weight whose groups are 16 or 32 columns (Q6_K, Q8_0, Q5_0),
    from x quantized by quantize_x_int16 with one piece per group; ``scales`` float16 bits viewed as int16
    (looked up in ``f16``, f16_table), or float32. Three rows of x or more go TILE at a time (xq and xs padded to
    whole tiles with zero rows), a group's codes widened once for them; each row's result is the same either way.
    """
    m, k = q.shape
    n = out.shape[0]
    groups = xs.shape[1]
    # One loop per variant: a branch among the four inside one loop made a row 25% slower.
    if k // groups == 16:
        if n < 3:
            for r in prange(m):
                for j in range(n):
                    dot16_row(q[r], scales[r], f16, xq, xs, j, out, r)
        else:
            for r in prange(m):
                for j0 in range(0, n, TILE):
                    dot16_tile(q[r], scales[r], f16, xq, xs, j0, out, r)
    elif n < 3:
        for r in prange(m):
            for j in range(n):
                dot32_row(q[r], scales[r], f16, xq, xs, j, out, r)
    else:
        for r in prange(m):
            for j0 in range(0, n, TILE):
                dot32_tile(q[r], scales[r], f16, xq, xs, j0, out, r)


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int8_dequantize(q, scales, f16, dst):
    """dst (rows, k) float32 = W[:rows] of int8_matvec's weight, for BLAS on a batch."""
    rows, k = dst.shape
    nb = scales.shape[1]
    block = k // nb
    for r in prange(rows):
        qrow = q[r]
        drow = dst[r]
        for b in range(nb):
            s = _group_scale(scales, r, b, f16)
            for i in range(b * block, (b + 1) * block):
                drow[i] = F32(qrow[i]) * s


# -- int5: GGML's 5-bit split (weights.Int5Weight), float16 scale and bias per group of 32 -------------------
int5_dot_row = int5_rows_dot(1)
int5_dot_tile = int5_rows_dot(TILE)


@njit(fastmath=FM, cache=True, nogil=True)
def quantize_x_int5(x, xq, xs, sums):
    """quantize_x_int16 with groups of 32 for int5_rows_dot: xq in the column order the kernel reads, each pair
    of groups as columns 0-7 of the first group, 0-7 of the second, then 8-15 of each, 16-23, 24-31 (it decodes
    two groups at once, one per 128-bit half), an odd last group as it is; sums (n, k // 32) gets x's sum per
    group. False where a group holds an infinity or NaN."""
    n, k = x.shape
    groups = k // 32
    for j in range(n):
        xr = x[j]
        for g in range(groups):
            inv = _piece_step(xr, g, 32, xs[j])
            if inv < 0:
                return False
            total = F32(0.0)
            for i in range(32 * g, 32 * g + 32):
                total += xr[i]
            sums[j, g] = total
            paired = g < groups - groups % 2
            base = 64 * (g // 2) + 8 * (g % 2) if paired else 32 * g
            for c in range(32):
                at = base + 16 * (c // 8) + c % 8 if paired else base + c
                xq[j, at] = np.int16(round(xr[32 * g + c] * inv))
    return True


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int5_matvec_int16(low, high, scales, biases, f16, xq, xs, sums, out):
    """out (n, m) = x @ W.T for an Int5Weight (scales and biases as float16 bits viewed as int16), from x rounded
    by quantize_x_int5 (in its column order) and its sums per group. Three rows of x or more go TILE at a time (xq, xs
    and sums padded to whole tiles with zero rows), a group's codes built once for them; a row's result is the
    same either way."""
    m = low.shape[0]
    n = out.shape[0]
    if n < 3:
        for r in prange(m):
            for j in range(n):
                int5_dot_row(low[r], high[r], scales[r], biases[r], f16, xq, xs, sums, j, out, r)
    else:
        for r in prange(m):
            for j0 in range(0, n, TILE):
                int5_dot_tile(low[r], high[r], scales[r], biases[r], f16, xq, xs, sums, j0, out, r)


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int5_dequantize(low, high, scales, biases, f16, dst):
    """dst (rows, k) float32 = the first rows of an Int5Weight (as int5_matvec_int16's arrays), for BLAS."""
    rows, k = dst.shape
    for r in prange(rows):
        lr, hr, drow = low[r], high[r], dst[r]
        for g in range(k // 32):
            s = _group_scale(scales, r, g, f16)
            b = _group_scale(biases, r, g, f16)
            h = hr[g]
            for j in range(16):
                byte = lr[16 * g + j]
                drow[32 * g + j] = F32((byte & 15) | (((h >> j) & 1) << 4)) * s + b
                drow[32 * g + 16 + j] = F32((byte >> 4) | (((h >> (j + 16)) & 1) << 4)) * s + b


# -- int6: GGUF Q6_K (weights.Int6Weight), an int8 sub-scale per 16 columns and a float16 d per 256 ----------
int6_dot_row = int6_rows_dot(1)
int6_dot_tile = int6_rows_dot(TILE)


@njit(fastmath=FM, cache=True, nogil=True)
def quantize_x_int6(x, xq, xs):
    """quantize_x_int16 with groups of 32 for int6_rows_dot: each group's columns stored as 0-7, 16-23, 8-15,
    24-31 (the order the kernel's sign-extending interleave leaves the codes in). False where a group holds an
    infinity or NaN."""
    n, k = x.shape
    for j in range(n):
        xr = x[j]
        for g in range(k // 32):
            inv = _piece_step(xr, g, 32, xs[j])
            if inv < 0:
                return False
            for c in range(32):
                quarter = c // 8
                slot = quarter if quarter % 3 == 0 else 3 - quarter  # 0, 2, 1, 3: quarters 1 and 2 swap places
                xq[j, 32 * g + 8 * slot + c % 8] = np.int16(round(xr[32 * g + c] * inv))
    return True


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int6_matvec_int16(ql, qh, sub, d, f16, xq, xs, out):
    """out (n, m) = x @ W.T for an Int6Weight (d as float16 bits viewed as int16), from x as quantize_x_int6
    leaves it; rows of x TILE at a time from three on, as int5_matvec_int16."""
    m = ql.shape[0]
    n = out.shape[0]
    if n < 3:
        for r in prange(m):
            for j in range(n):
                int6_dot_row(ql[r], qh[r], sub[r], d[r], f16, xq, xs, j, out, r)
    else:
        for r in prange(m):
            for j0 in range(0, n, TILE):
                int6_dot_tile(ql[r], qh[r], sub[r], d[r], f16, xq, xs, j0, out, r)


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def int6_dequantize(ql, qh, sub, d, f16, dst):
    """dst (rows, k) float32 = the first rows of an Int6Weight, for BLAS: (q - 32) * d * sub, exact."""
    rows, k = dst.shape
    for r in prange(rows):
        lr, hr, drow = ql[r], qh[r], dst[r]
        for c in range(k):
            h, e = c // 128, c % 128
            nibble = (lr[64 * h + e % 64] >> (4 * (e // 64))) & 15
            pair = (hr[32 * h + e % 32] >> (2 * (e // 32))) & 3
            scale = f16[d[r, c // 256]] * F32(sub[r, c // 16])
            drow[c] = F32(np.int64(nibble | (pair << 4)) - 32) * scale


# -- norms and activation ---------------------------------------------------------------------------------
@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _inv_rms(ss, dim, eps):
    """1 / sqrt(mean square + eps) from the row's sum of squares."""
    return F32(1.0 / math.sqrt(ss / dim + eps))


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _sum_squares(row):
    ss = F32(0.0)
    for i in range(row.shape[0]):
        ss += row[i] * row[i]
    return ss


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _normed_into(row, inv, weight, orow):
    for i in range(row.shape[0]):
        orow[i] = row[i] * inv * weight[i]


@njit(fastmath=FM, cache=True, nogil=True)
def rmsnorm(x, weight, eps, out):
    n, dim = x.shape
    for r in range(n):
        _normed_into(x[r], _inv_rms(_sum_squares(x[r]), dim, eps), weight, out[r])


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _add_rmsnorm_row(x, x_inv, x_weight, res, weight, eps, orow):
    """res += x (x_weight None), or x * x_inv * x_weight (x RMS-normed first); orow = rmsnorm(res) * weight."""
    dim = res.shape[0]
    ss = F32(0.0)
    for i in range(dim):
        v = res[i] + _scaled(x, x_inv, x_weight, i)
        res[i] = v
        ss += v * v
    _normed_into(res, _inv_rms(ss, dim, eps), weight, orow)


def _scaled(x, x_inv, x_weight, i):
    """x[i], or x[i] * x_inv * x_weight[i] where x_weight is not None."""


@overload(_scaled, inline="always")
def _scaled_impl(x, x_inv, x_weight, i):
    if isinstance(x_weight, nbtypes.NoneType):
        return lambda x, x_inv, x_weight, i: x[i]
    return lambda x, x_inv, x_weight, i: x[i] * x_inv * x_weight[i]


@njit(fastmath=FM, cache=True, nogil=True)
def add_rmsnorm(x, residual, weight, eps, out):
    for r in range(x.shape[0]):
        _add_rmsnorm_row(x[r], F32(1.0), None, residual[r], weight, eps, out[r])


@njit(fastmath=FM, cache=True, nogil=True)
def post_norm_add_rmsnorm(delta, post_weight, residual, weight, eps, out):
    """residual += rmsnorm(delta) * post_weight, then out = rmsnorm(residual) * weight, row by row: Gemma's
    block output normed before it joins the residual stream, and the next norm, in one call."""
    n, dim = delta.shape
    for r in range(n):
        inv = _inv_rms(_sum_squares(delta[r]), dim, eps)
        _add_rmsnorm_row(delta[r], inv, post_weight, residual[r], weight, eps, out[r])


@njit(fastmath=FM, cache=True, nogil=True)
def head_rmsnorm(qkv, q_weight, k_weight, eps, n_heads, n_kv, hd, out):
    """out = qkv with each q head and each k head RMS-normed over its hd values (times q_weight / k_weight),
    the v heads copied (Qwen3's and Gemma 3's q/k norm)."""
    n = qkv.shape[0]
    v0 = (n_heads + n_kv) * hd
    for r in range(n):
        xr = qkv[r]
        orow = out[r]
        for h in range(n_heads + n_kv):
            w = q_weight if h < n_heads else k_weight
            base = h * hd
            ss = F32(0.0)
            for i in range(hd):
                ss += xr[base + i] * xr[base + i]
            inv = F32(1.0 / math.sqrt(ss / hd + eps))
            for i in range(hd):
                orow[base + i] = xr[base + i] * inv * w[i]
        for i in range(v0, qkv.shape[1]):
            orow[i] = xr[i]


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def silu_mul(gate_up, out):
    """out = g / (1 + exp(-g)) * u, finite and right for any finite g (see _exp_into's clamp)."""
    n, f = out.shape
    for r in prange(n):
        gu = gate_up[r]
        orow = out[r]
        e = np.empty(f, dtype=np.float32)
        exponents = np.empty(f, dtype=np.int32)
        _exp_into(gu, F32(-1.0), F32(0.0), e, exponents, f)
        for i in range(f):
            g = gu[i]
            silu = g / (F32(1.0) + e[i])
            # Below -80, g * sigmoid(g) is under 1e-33 in magnitude: 0 (the clamped exp would not be).
            orow[i] = (silu if g > F32(-80.0) else F32(0.0)) * gu[f + i]


GELU_C = F32(2.0 * 0.7978845608028654)  # 2 sqrt(2 / pi): gelu_tanh(g) = g / (1 + exp(-GELU_C (g + 0.044715 g^3)))


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def gelu_mul(gate_up, out):
    """out = gelu_tanh(g) * u (GELU's tanh approximation, Gemma's GeGLU), as g / (1 + exp(-2 u')) with u' the
    tanh's argument, which is 0.5 g (1 + tanh(u')); exp clamped as in _exp_into, so a very negative g gives a
    value below 1e-36 in magnitude where the exact one is below 1e-22."""
    n, f = out.shape
    for r in prange(n):
        gu = gate_up[r]
        orow = out[r]
        e = np.empty(f, dtype=np.float32)
        exponents = np.empty(f, dtype=np.int32)
        for i in range(f):
            g = gu[i]
            e[i] = GELU_C * (g + F32(0.044715) * g * g * g)
        _exp_into(e, F32(-1.0), F32(0.0), e, exponents, f)
        for i in range(f):
            orow[i] = gu[i] / (F32(1.0) + e[i]) * gu[f + i]


# -- attention (float32 KV cache) -------------------------------------------------------------------------
@njit(fastmath=FM, cache=True, nogil=True)
def _exp_into(src, sign, shift, dst, exponents, n):
    """dst[:n] = exp(sign * src[:n] - shift), in loops LLVM vectorizes (libm's expf does not).

    exp(x) = 2^k * e^r with k = round(x / ln 2) and |r| <= ln(2) / 2: e^r by a degree-7 polynomial
    (Cephes expf coefficients), 2^k by adding k to the float's exponent bits. x is clamped to [-80, 88]
    so the result stays a normal float (e^-80 = 1.8e-35 is nothing next to 1; e^88 = 1.7e38 is finite,
    and where a caller needs exp's overflow, e.g. silu's g / (1 + e^-g), 1.7e38 does as well). Relative
    error ~1e-7. ``src`` and ``dst`` may be the same array.
    """
    bits = dst.view(np.int32)
    for t in range(n):
        x = min(max(sign * src[t] - shift, F32(-80.0)), F32(88.0))
        k = np.floor(x * F32(1.4426950408889634) + F32(0.5))
        r = x - k * F32(0.693359375)
        r = r + k * F32(2.12194440e-4)
        p = F32(1.9875691500e-4)
        p = p * r + F32(1.3981999507e-3)
        p = p * r + F32(8.3334519073e-3)
        p = p * r + F32(4.1665795894e-2)
        p = p * r + F32(1.6666665459e-1)
        p = p * r + F32(5.0000001201e-1)
        dst[t] = p * r * r + r + F32(1.0)
        exponents[t] = np.int32(k)
    for t in range(n):
        bits[t] += exponents[t] << 23


@njit(inline="always", cache=True, nogil=True)
def _store_new(qkv, kc, vc, layer, slots, positions, cos, sin, n_kv, hd):
    """attention_decode's cache writes: RoPE'd k and raw v of each row at its position, in float32, or rounded
    to float16 for a float16 cache (its bits as int16)."""
    half = hd // 2
    q_dim = qkv.shape[1] - 2 * n_kv * hd
    rotated = np.empty(hd, dtype=np.float32)
    for b in range(qkv.shape[0]):
        slot = slots[b]
        pos = positions[b]
        for j in range(n_kv):
            kb = q_dim + j * hd
            vb = q_dim + n_kv * hd + j * hd
            for i in range(half):
                c = cos[pos, i]
                s = sin[pos, i]
                x1 = qkv[b, kb + i]
                x2 = qkv[b, kb + half + i]
                rotated[i] = x1 * c - x2 * s
                rotated[half + i] = x2 * c + x1 * s
            _put_row(rotated, kc[layer, slot, j, pos])
            _put_row(qkv[b, vb : vb + hd], vc[layer, slot, j, pos])


def _put_row(values, row):
    """row[:] = values (float32): as they are, or rounded to float16 bits for an int16 row."""


@overload(_put_row, inline="always")
def _put_row_impl(values, row):
    if row.dtype == nbtypes.int16:

        def narrowed(values, row):
            for c in range(row.shape[0] // 16):
                narrow_16(values[16 * c :], row[16 * c :])

        return narrowed

    def copied(values, row):
        for i in range(row.shape[0]):
            row[i] = values[i]

    return copied


ROWS_AT_ONCE = 4  # cache rows attention_decode's loops take together (fixed: _four_rows and the loops name each)


@njit(inline="always", cache=True, nogil=True)
def _four_rows(cache, t, rows):
    """Rows t..t+3 of a (positions, head_dim) cache view as float32 (a float16 cache's widened into rows)."""
    return (
        _cache_row(cache, t, rows[0]),
        _cache_row(cache, t + 1, rows[1]),
        _cache_row(cache, t + 2, rows[2]),
        _cache_row(cache, t + 3, rows[3]),
    )


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _part_scores(qr, keys, t0, n_t, cap, scores, mx, rows):
    """scores[g, t] = qr[g] . keys[t0 + t] for the group's heads, soft-capped where cap > 0; mx[g] their max.
    Four keys per pass: four independent sums per head keep the multiply-adds busy where one key at a time leaves
    a single dependent sum, and each key is loaded once for the whole group."""
    group, hd = qr.shape
    t = 0
    while t + ROWS_AT_ONCE <= n_t:
        k0, k1, k2, k3 = _four_rows(keys, t0 + t, rows)
        for gi in range(group):
            q = qr[gi]
            s0 = F32(0.0)
            s1 = F32(0.0)
            s2 = F32(0.0)
            s3 = F32(0.0)
            for i in range(hd):
                s0 += q[i] * k0[i]
                s1 += q[i] * k1[i]
                s2 += q[i] * k2[i]
                s3 += q[i] * k3[i]
            scores[gi, t] = s0
            scores[gi, t + 1] = s1
            scores[gi, t + 2] = s2
            scores[gi, t + 3] = s3
        t += ROWS_AT_ONCE
    for rest in range(t, n_t):
        kt = _cache_row(keys, t0 + rest, rows[0])
        for gi in range(group):
            q = qr[gi]
            sc = F32(0.0)
            for i in range(hd):
                sc += q[i] * kt[i]
            scores[gi, rest] = sc
    for gi in range(group):
        top = F32(-3.0e38)
        for t in range(n_t):
            sc = scores[gi, t]
            if cap > 0:
                sc = cap * F32(math.tanh(sc / cap))
                scores[gi, t] = sc
            top = max(top, sc)
        mx[gi] = top


@njit(inline="always", fastmath=FM, cache=True, nogil=True)
def _part_values(weights, values, t0, n_t, acc, rows):
    """acc[g] += sum over t of weights[g, t] * values[t0 + t], four value rows per pass (one load and store of
    acc per four rows instead of per row)."""
    group, hd = acc.shape
    t = 0
    while t + ROWS_AT_ONCE <= n_t:
        v0, v1, v2, v3 = _four_rows(values, t0 + t, rows)
        for gi in range(group):
            w0 = weights[gi, t]
            w1 = weights[gi, t + 1]
            w2 = weights[gi, t + 2]
            w3 = weights[gi, t + 3]
            a = acc[gi]
            for i in range(hd):
                a[i] += w0 * v0[i] + w1 * v1[i] + w2 * v2[i] + w3 * v3[i]
        t += ROWS_AT_ONCE
    for rest in range(t, n_t):
        vt = _cache_row(values, t0 + rest, rows[0])
        for gi in range(group):
            wt = weights[gi, rest]
            a = acc[gi]
            for i in range(hd):
                a[i] += wt * vt[i]


@njit(parallel=True, fastmath=FM, cache=True, nogil=True)
def attention_decode(
    qkv, kc, vc, layer, slots, positions, cos, sin, n_heads, n_kv, hd, n_split, score_scale, window, softcap, out
):
    """One new token per row b: RoPE'd k and raw v into the cache at positions[b], then causal GQA attention.
    float32 caches, or float16 ones as their bits (int16 views): new rows rounded once, rows widened as read.

    Scores are q.k * score_scale, soft-capped to softcap * tanh(s / softcap) where softcap > 0; a query sees the
    last ``window`` positions (itself included) where window > 0, else all of them (AttentionSpec's features).

    The cache writes come first (one thread). Then every (row, kv head, part) runs in parallel, each with
    its own scratch: a part is one of ``n_split`` equal spans of the positions, and computes the query
    heads of its kv head's group together (each key and value row is loaded once), with its own softmax
    max and sum; the parts are then merged. More than one part evens out the threads' work when there are
    few (row, kv head) pairs (SmolLM2's 3 kv heads on 2 threads: 2 + 1 heads without parts).
    """
    half = hd // 2
    group = n_heads // n_kv
    inv_sqrt = F32(score_scale)
    cap = F32(softcap)
    n_rows = qkv.shape[0]
    _store_new(qkv, kc, vc, layer, slots, positions, cos, sin, n_kv, hd)
    items = n_rows * n_kv * n_split
    part_acc = np.empty((items, group, hd), dtype=np.float32)
    part_max = np.empty((items, group), dtype=np.float32)
    part_sum = np.empty((items, group), dtype=np.float32)
    # Every item's scratch in one allocation each: an np.empty per item cost as much as a short item's work.
    longest = 0
    for b in range(n_rows):
        longest = max(longest, positions[b] + 1)
    longest = (longest + n_split - 1) // n_split
    part_q = np.empty((items, group, hd), dtype=np.float32)
    part_scores = np.empty((items, group, longest), dtype=np.float32)
    part_exponents = np.empty((items, longest), dtype=np.int32)
    part_rows = np.empty((items, ROWS_AT_ONCE, hd), dtype=np.float32)  # a float16 cache's rows, widened
    for item in prange(items):
        bj = item // n_split
        part = item - bj * n_split
        b = bj // n_kv
        j = bj - b * n_kv
        slot = slots[b]
        pos = positions[b]
        lo = max(0, pos + 1 - window) if window > 0 else 0  # the first position this query sees
        span = (pos + 1 - lo + n_split - 1) // n_split
        t0 = lo + part * span
        n_t = max(0, min(pos + 1, t0 + span) - t0)
        qr = part_q[item]
        scores = part_scores[item]
        exponents = part_exponents[item]
        acc = part_acc[item]
        mx = part_max[item]
        keys = kc[layer, slot, j]
        values = vc[layer, slot, j]
        for gi in range(group):
            qb = (j * group + gi) * hd
            q = qr[gi]
            for i in range(half):
                c = cos[pos, i]
                s = sin[pos, i]
                x1 = qkv[b, qb + i]
                x2 = qkv[b, qb + half + i]
                q[i] = (x1 * c - x2 * s) * inv_sqrt
                q[half + i] = (x2 * c + x1 * s) * inv_sqrt
            a = acc[gi]
            for i in range(hd):
                a[i] = 0.0
        _part_scores(qr, keys, t0, n_t, cap, scores, mx, part_rows[item])
        for gi in range(group):
            _exp_into(scores[gi], F32(1.0), mx[gi], scores[gi], exponents, n_t)
        _part_values(scores, values, t0, n_t, acc, part_rows[item])
        sums = part_sum[item]
        for gi in range(group):
            total = F32(0.0)
            for t in range(n_t):
                total += scores[gi, t]
            sums[gi] = total
    # Merge the parts: each one's sums and weighted values scaled by exp(its max - the overall max).
    for bj in range(n_rows * n_kv):
        b = bj // n_kv
        j = bj - b * n_kv
        orow = out[b]
        first = bj * n_split
        for gi in range(group):
            top = part_max[first, gi]
            for part in range(1, n_split):
                top = max(top, part_max[first + part, gi])
            total = F32(0.0)
            qb = (j * group + gi) * hd
            for i in range(hd):
                orow[qb + i] = 0.0
            for part in range(n_split):
                item = first + part
                if part_sum[item, gi] > 0:  # an empty part (fewer positions than parts) adds nothing
                    scale = F32(math.exp(part_max[item, gi] - top))
                    total += part_sum[item, gi] * scale
                    a = part_acc[item, gi]
                    for i in range(hd):
                        orow[qb + i] += a[i] * scale
            inv = F32(1.0) / total
            for i in range(hd):
                orow[qb + i] *= inv


int4_matvec_serial = _twin(int4_matvec, "int4_matvec_serial")
int4_gate_up_silu_serial = _twin(int4_gate_up_silu, "int4_gate_up_silu_serial")
int4_matvec_add_rmsnorm_serial = _twin(int4_matvec_add_rmsnorm, "int4_matvec_add_rmsnorm_serial")
int8_matvec_serial = _twin(int8_matvec, "int8_matvec_serial")
int8_matvec_int16_serial = _twin(int8_matvec_int16, "int8_matvec_int16_serial")
int8_dequantize_serial = _twin(int8_dequantize, "int8_dequantize_serial")
# The same int8 loops on float32 scales (Q6_K), parallel and serial.
int8_matvec_f32 = _twin(int8_matvec, "int8_matvec_f32", parallel=True, _group_scale=_own_scale)
int8_matvec_f32_serial = _twin(int8_matvec, "int8_matvec_f32_serial", _group_scale=_own_scale)
int8_dequantize_f32 = _twin(int8_dequantize, "int8_dequantize_f32", parallel=True, _group_scale=_own_scale)
int8_dequantize_f32_serial = _twin(int8_dequantize, "int8_dequantize_f32_serial", _group_scale=_own_scale)
silu_mul_serial = _twin(silu_mul, "silu_mul_serial")
gelu_mul_serial = _twin(gelu_mul, "gelu_mul_serial")
int4_dequantize_t_serial = _twin(int4_dequantize_t, "int4_dequantize_t_serial")
attention_decode_serial = _twin(attention_decode, "attention_decode_serial")
int5_matvec_int16_serial = _twin(int5_matvec_int16, "int5_matvec_int16_serial")
int5_dequantize_serial = _twin(int5_dequantize, "int5_dequantize_serial")
int6_matvec_int16_serial = _twin(int6_matvec_int16, "int6_matvec_int16_serial")
int6_dequantize_serial = _twin(int6_dequantize, "int6_dequantize_serial")
