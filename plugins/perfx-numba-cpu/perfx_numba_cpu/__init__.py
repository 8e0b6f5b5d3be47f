"""perfx-numba-cpu: compiled (numba) CPU kernels that replace the NumPy backend's hot ops.

- ``int4_gemv`` / ``int4_gemm`` with n <= SMALL_N (decode, batched decode, short prompts): a kernel on the
  packed nibbles and the per-group scale and bias (never a float copy), ``s * xs * (x_g . q_g) + b * sum(x_g)``
  per group with x rounded to int16 per group and the dot in integers (vector_dot.int4_pairs_dot), on the
  codes laid out in blocks of 64 rows (kernels.int4_block_layout), widening each byte column once for
  kernels.TILE rows of x; parallel over row blocks while the machine is otherwise idle, single-threaded when
  other processes load it (see _Machine). An x with an infinity or NaN takes the float path below.
- ``int4_gemm`` with larger n (prefill chunks): the blocks dequantized into W.T in a reused float32 scratch
  buffer (in tiles only for huge matrices), then one BLAS call.
- ``int5_gemm`` (GGUF Q5_0 / Q5_1 / Q5_K as loaded, weights.Int5Weight) with n <= INT8_MAX_N: x rounded to int16
  per group of 32 and each group's codes built from its nibbles and fifth bits in registers (vector_dot.int5_rows_dot);
  larger n: blocks of rows dequantized for BLAS.
- ``int6_gemm`` (GGUF Q6_K as loaded, weights.Int6Weight): the same on Q6_K's own layout, codes centred, an int8
  sub-scale per 16 columns times a float16 d per 256 (vector_dot.int6_rows_dot).
- ``int8_gemm`` (int8 codes, a scale per group: GGUF Q8_0 in float16, e.g. SmolLM2's tied
  embedding/output, Q6_K in float32) with n <= INT8_MAX_N: a kernel on the weight's own arrays (no copy),
  4x less memory traffic than a float32 sgemv. With groups of 16 or 32 columns (every GGUF type) x is rounded
  to int16 per group and a row is one integer multiply-add intrinsic (vector_dot) for kernels.TILE rows of x;
  other groups take the float kernel, each code widened once for kernels.TILE rows of x. Larger n: blocks of
  rows dequantized into one reused buffer for BLAS. ``dense_gemm``: NumPy's BLAS.
- fused ``rmsnorm``, ``add_rmsnorm``, ``head_rmsnorm``, ``silu_mul``, ``gelu_mul``, ``attention_decode``
  (float32 caches; windows, soft-capping and custom scales included), and the
  composites ``linear``, ``qkv_proj``, ``logits`` (direct dispatch), ``gate_up_silu`` and
  ``linear_add_rmsnorm`` (one kernel each for n <= SMALL_N on int4 weights).

The layout of an int4 weight (the blocked codes, its float16 scales and its biases) is built once, at the weight's
first use, and kept on the weight handle as the attribute ``_numba_cpu``; it replaces the weight's row-major arrays
(NumpyWeight.hand_over), so the weight is held once, and an int4 embedding table's rows are read from it. Nothing
is re-laid-out per token. Int8 weights need none.
"""

from __future__ import annotations

import math
import os
from time import perf_counter, process_time

import numba
import numpy as np
from perfx_numpy import ops as numpy_ops

from perfx_core.errors import InvalidArgumentError
from perfx_core.hookspecs import hookimpl
from perfx_core.ops import generic_gate_up_silu
from perfx_core.weights import Int4KScales, Int4Weight, Int5Weight, Int6Weight

from . import compile_notice  # noqa: F401  (announces a first compile)
from . import kernels as K

PRIORITY = 20  # above the NumPy backend (0) and perfx-lowmem-int4 (10)
# Up to this many rows of x (any batched decode step of the default --max-running 8, a 32-sequence batch, short
# prompts), int4 matmuls run the packed kernel; above (prefill chunks), BLAS on a per-call dequantized tile. The
# packed kernel reads a quarter of a float copy's bytes and its cost grows by about half a GEMV per added row:
# `python benchmarks/bench_serving.py --engine-ceiling 1,2,4,8,16,32` times batched decode per row count.
SMALL_N = 32
# float32 bytes of one dequantized tile for BLAS. One call per matrix is what counts: a BLAS call per small
# tile (1 MiB) made a 256-token gate_up 6x slower than one call on the whole dequantized matrix (thread
# hand-offs between numba's pool and OpenBLAS's, and strided output), so tiles are only for huge matrices.
TILE_BYTES = 64 << 20
INT8_MAX_N = 32  # the int8 kernel's rows of x (as SMALL_N); larger n is BLAS's job
# float32 bytes of the block of an int8 weight dequantized per BLAS call (n > INT8_MAX_N): bounded memory, and
# large enough that a whole layer matrix of a small model is one call (see TILE_BYTES)
INT8_TILE_BYTES = 16 << 20
F16 = K.f16_table()
ATTR = "_numba_cpu"  # an int4 weight's _Int4Layout on its handle
SPLIT_ATTR = "_numba_cpu_split"  # an int5 or int6 weight's _SplitLayout
# Serial or parallel. On the idle 2-core VM the parallel GEMV kernels make decode 1.5x faster (99 against
# 65 tok/s), but when other processes keep the cores busy a parallel region waits for a worker thread the
# OS has not scheduled, and a 20 us GEMV takes milliseconds: decode measured 5-10x slower than
# single-threaded under a load of 2. So the kernels run parallel only while the rest of the machine is
# idle: every CHECK_S seconds, the CPU time all processes used (/proc/stat) minus this process's own
# (time.process_time) over that window must be below OTHERS_LIMIT cores. Timing the parallel calls
# themselves misleads: a rare trial call finds the workers asleep and always looks slow.
# PERFX_NUMBA_PARALLEL: "auto" (default), "always" or "never". The same goes for attention_decode.
PARALLEL_MODE = os.environ.get("PERFX_NUMBA_PARALLEL", "auto").strip().lower()
PARALLEL_MIN_WORK = 200_000  # multiply-adds below which a call always runs on one thread
CHECK_S = 0.25
OTHERS_LIMIT = 0.3  # cores
# After a BLAS call OpenBLAS's worker threads spin (sched_yield) for ~2^28 cycles before they sleep, and a
# parallel kernel's worker then shares a core with one: the first decode steps after a 512-token prefill
# took 17-45 ms instead of 9 (2-core VM, SmolLM2), against ~12 ms single-threaded. So for this long after
# the plugin's last BLAS call the kernels run on one thread.
BLAS_SPIN_S = 0.12


class _Machine:
    """Whether the other processes leave the cores free, re-read every CHECK_S seconds."""

    free = True
    next_check = 0.0
    last: tuple[float, float, float] | None = None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @classmethod
    def is_free(cls) -> bool:
        now = perf_counter()
        if now < cls.next_check:
            return cls.free
        cls.next_check = now + CHECK_S
        try:
            with open("/proc/stat", "rb") as f:
                fields = f.readline().split()[1:9]
        except OSError:
            return cls.free
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields)
        busy = (user + nice + system + irq + softirq + steal) / cls.ticks
        own = process_time()
        if cls.last is not None:
            last_busy, last_own, last_now = cls.last
            others = ((busy - last_busy) - (own - last_own)) / max(now - last_now, 1e-3)
            cls.free = others < OTHERS_LIMIT
        cls.last = (busy, own, now)
        return cls.free


_blas_spinning_until = 0.0


def _matmul(x, wt, out) -> None:
    """out = x @ wt through BLAS, noting when its threads will stop spinning (BLAS_SPIN_S)."""
    global _blas_spinning_until
    np.matmul(x, wt, out=out)
    _blas_spinning_until = perf_counter() + BLAS_SPIN_S


def _parallel(work) -> bool:
    """Whether a kernel of ``work`` multiply-adds runs parallel, as PARALLEL_MODE and the machine's load say."""
    if PARALLEL_MODE == "always":
        return True
    if PARALLEL_MODE == "never" or work < PARALLEL_MIN_WORK or perf_counter() < _blas_spinning_until:
        return False
    return _Machine.is_free()


def _run(parallel, serial, work, *args):
    """The kernel's result (the int4 kernels: False where x was not finite and nothing was written)."""
    return (parallel if _parallel(work) else serial)(*args)


class _Int4Layout:
    """An int4 weight as the plugin holds it: kernels.int4_block_layout's codes, scales and biases, the only copy.

    The kernels read the blocks for every n: the GEMV walks them, prefill dequantizes them into W.T for BLAS and
    the embedding lookup gathers rows from them. So the handle's row-major arrays are let go (NumpyWeight.hand_over)
    and the weight is held in about the file's bytes (GGUF Q4_0: 0.5625 bytes per weight, float16 scales and no
    biases; Q4_1 0.625, float16 scales and biases; Q4_K 0.58, its own 6-bit sc and m per 32 and float16 d and dmin
    per 256)."""

    __slots__ = ("codes", "scales", "biases", "supers", "shape", "group_size")

    def __init__(self, weight: Int4Weight):
        self.shape = weight.shape
        self.group_size = weight.group_size
        factors = None if weight.k_scales is None else weight.k_scales.arrays
        layout = K.int4_block_layout(weight.packed, weight.scale, weight.bias, factors)
        self.codes, self.scales, self.biases, self.supers = layout

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """What the int4 kernels take: codes, scales, biases, supers (kernels.int4_block_layout)."""
        return self.codes, self.scales, self.biases, self.supers

    def as_weight(self) -> Int4Weight:
        packed, scale, bias, factors = K.int4_row_major(*self.arrays, self.shape[0])
        if factors is None:
            return Int4Weight(packed, scale, bias, self.group_size)
        k_scales = Int4KScales(*factors)
        return Int4Weight(packed, *k_scales.scale_bias(), self.group_size, k_scales)


def _int4_layout(rt, w) -> _Int4Layout:
    layout = w.__dict__.get(ATTR)
    if layout is None:
        weight = w.weight
        if not isinstance(weight, Int4Weight):
            raise InvalidArgumentError(f"perfx-numba-cpu got a {w.kind} weight where an int4 weight is required")
        layout = _Int4Layout(weight)
        track = getattr(rt, "track", None)
        if track is not None:
            for array in layout.arrays:
                track(array)
        setattr(w, ATTR, layout)
        hand_over = getattr(w, "hand_over", None)
        if hand_over is not None:
            del weight
            hand_over(layout.as_weight)
    return layout


def _f32(x):
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _packed(n: int) -> bool:
    """Whether an int4 matmul of ``n`` rows runs the packed kernel (no float copy of the weight is ever made)."""
    return n <= SMALL_N


def _int4_matmul(rt, x, w, out) -> None:
    layout = _int4_layout(rt, w)
    x = _f32(x)
    n = x.shape[0]
    if _packed(n):
        work = n * layout.codes.size * 2
        if _run(K.int4_matvec, K.int4_matvec_serial, work, *layout.arrays, x, out):
            return
        # x holds an infinity or NaN: the float path below propagates it as the contract asks
    m, k = layout.shape
    rows = max(1, min(m, TILE_BYTES // (4 * k)))
    rows = -(-rows // K.ROWS) * K.ROWS  # whole blocks
    tile = rt.scratch("numba_cpu.tile_t", (k, rows))
    # Prefill: BLAS runs its own threads; a serial dequantization keeps numba's pool out of its way.
    dequantize = K.int4_dequantize_t if PARALLEL_MODE == "always" else K.int4_dequantize_t_serial
    if rows >= m:
        wt = tile[:, : layout.codes.shape[0] * K.ROWS]
        dequantize(*layout.arrays, 0, wt)
        _matmul(x, wt[:, :m], out)
        return
    part = rt.scratch("numba_cpu.tile_out", (n, rows))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        wt = tile[:, : -(-(r1 - r0) // K.ROWS) * K.ROWS]
        dequantize(*layout.arrays, r0 // K.ROWS, wt)
        _matmul(x, wt[:, : r1 - r0], part[:, : r1 - r0])
        out[:, r0:r1] = part[:, : r1 - r0]


def embedding(rt, table, ids, out) -> None:
    # A tied int4 table (the output matrix too) is held only as the kernels' blocks once the logits have run.
    layout = table.__dict__.get(ATTR)
    if layout is None:
        numpy_ops.embedding(rt, table, ids, out)
        return
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= layout.shape[0]):  # the kernel does not check its reads
        raise InvalidArgumentError(f"embedding ids must lie in [0, {layout.shape[0]}); got {ids.min()}..{ids.max()}")
    K.int4_rows(*layout.arrays, ids, out)


def int4_gemv(rt, x, w, out) -> None:
    _int4_matmul(rt, x, w, out)


def int4_gemm(rt, x, w, out) -> None:
    _int4_matmul(rt, x, w, out)


def dense_gemm(rt, x, w, out) -> None:
    _matmul(x, w.float32().T, out)


def int8_gemm(rt, x, w, out) -> None:
    weight = w.weight
    x = _f32(x)
    n = x.shape[0]
    if weight.scale.dtype == np.float16:
        scales = weight.scale.view(np.int16)  # numba has no float16: the kernels look the bits up in F16
        matvec, matvec_serial = K.int8_matvec, K.int8_matvec_serial
        dequantize = K.int8_dequantize if PARALLEL_MODE == "always" else K.int8_dequantize_serial
    else:  # float32 scales (Q6_K)
        scales = weight.scale
        matvec, matvec_serial = K.int8_matvec_f32, K.int8_matvec_f32_serial
        dequantize = K.int8_dequantize_f32 if PARALLEL_MODE == "always" else K.int8_dequantize_f32_serial
    # Groups of 16 or 32 (Q6_K, Q8_0, Q5_0): x in int16 (kernels.int8_matvec_int16), every row of x on its own, so
    # a row's result does not depend on the batch it is in; at 8 rows it took 0.5-0.6 of the float kernel's time.
    # The intrinsic reads one scale per 16 or 32 columns, so groups of 64 and 128 (perfx's own int8 files) take the
    # float kernel (not measured against a repeated-scale variant).
    if n <= INT8_MAX_N and weight.group_size in (16, 32) and weight.codes.flags.c_contiguous:
        padded = n if n < 3 else -(-n // K.TILE) * K.TILE  # whole tiles of rows (kernels.int8_matvec_int16)
        xq = np.zeros((padded, x.shape[1]), dtype=np.int16)
        xs = np.zeros((padded, x.shape[1] // weight.group_size), dtype=np.float32)
        if K.quantize_x_int16(x, weight.group_size, xq, xs):
            _run(
                K.int8_matvec_int16,
                K.int8_matvec_int16_serial,
                n * weight.codes.size,
                weight.codes,
                scales,
                F16,
                xq,
                xs,
                out,
            )
            return
    if n <= INT8_MAX_N:
        _run(matvec, matvec_serial, n * weight.codes.size, weight.codes, scales, F16, x, out)
        return
    m, k = weight.shape
    rows = max(1, min(m, INT8_TILE_BYTES // (4 * k)))
    tile = rt.scratch("numba_cpu.int8_tile", (rows, k))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block = tile[: r1 - r0]
        dequantize(weight.codes[r0:r1], scales[r0:r1], F16, block)
        _matmul(x, block.T, out[:, r0:r1])


# Per split format: how x is rounded (and how many per-32-column arrays that gives the kernel: its steps, and for
# int5 its sums), the integer kernels (parallel, serial) and the dequantizers for BLAS (parallel, serial).
_SPLIT_KERNELS = {
    Int5Weight: (
        K.quantize_x_int5,
        2,
        (K.int5_matvec_int16, K.int5_matvec_int16_serial),
        (K.int5_dequantize, K.int5_dequantize_serial),
    ),
    Int6Weight: (
        K.quantize_x_int6,
        1,
        (K.int6_matvec_int16, K.int6_matvec_int16_serial),
        (K.int6_dequantize, K.int6_dequantize_serial),
    ),
}


class _SplitLayout:
    """An int5 or int6 weight's arrays as the kernels take them (float16 ones as their int16 bits, looked up in
    F16) and its kernels, worked out once per weight: a Gemma 3 decode step makes 45 of these calls."""

    __slots__ = ("arrays", "contiguous", "quantize", "per_group", "kernels", "dequantizers")

    def __init__(self, weight):
        self.quantize, self.per_group, self.kernels, self.dequantizers = _SPLIT_KERNELS[type(weight)]
        self.arrays = tuple(a.view(np.int16) if a.dtype == np.float16 else a for a in weight.arrays)
        self.contiguous = all(a.flags.c_contiguous for a in self.arrays)  # the intrinsics read rows as C arrays


def _split_layout(w) -> _SplitLayout:
    layout = w.__dict__.get(SPLIT_ATTR)
    if layout is None:
        layout = _SplitLayout(w.weight)
        setattr(w, SPLIT_ATTR, layout)
    return layout


def split_gemm(rt, x, w, out) -> None:
    """int5_gemm and int6_gemm: out = x @ W.T on the weight's own arrays. Up to INT8_MAX_N rows, x rounded to
    int16 and the integer kernel; beyond, or where x is not finite (or an array is not C-contiguous), blocks of
    rows dequantized for BLAS."""
    layout = _split_layout(w)
    arrays = layout.arrays
    x = _f32(x)
    n, k = x.shape
    m = out.shape[1]
    if n <= INT8_MAX_N and layout.contiguous:
        padded = n if n < 3 else -(-n // K.TILE) * K.TILE  # whole tiles of rows
        xq = np.zeros((padded, k), dtype=np.int16)
        groups = [np.zeros((padded, k // 32), dtype=np.float32) for _ in range(layout.per_group)]
        if layout.quantize(x, xq, *groups):
            _run(*layout.kernels, n * m * k, *arrays, F16, xq, *groups, out)
            return
        # x holds an infinity or NaN: the float path below propagates it as the contract asks
    rows = max(1, min(m, INT8_TILE_BYTES // (4 * k)))
    tile = rt.scratch("numba_cpu.split_tile", (rows, k))
    dequantize = layout.dequantizers[0] if PARALLEL_MODE == "always" else layout.dequantizers[1]
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block = tile[: r1 - r0]
        dequantize(*(a[r0:r1] for a in arrays), F16, block)
        _matmul(x, block.T, out[:, r0:r1])


def linear(rt, x, w, out) -> None:
    kind = w.kind
    if kind == "int4":
        _int4_matmul(rt, x, w, out)
    elif kind == "int8":
        int8_gemm(rt, x, w, out)
    elif kind in ("int5", "int6"):
        split_gemm(rt, x, w, out)
    else:
        dense_gemm(rt, x, w, out)


def gate_up_silu(rt, x, w, out) -> None:
    n, f = out.shape
    if w.kind == "int4" and _packed(n) and f % K.ROWS == 0:
        layout = _int4_layout(rt, w)
        work = n * layout.codes.size * 2
        args = (*layout.arrays, _f32(x), out)
        if _run(K.int4_gate_up_silu, K.int4_gate_up_silu_serial, work, *args):
            return
    generic_gate_up_silu(rt, x, w, out)  # the generic composition, on this plugin's linear and silu_mul


def linear_add_rmsnorm(rt, x, w, residual, weight, eps, out) -> None:
    # 60 calls per SmolLM2 decode step: the generic composite (a scratch lookup, a view and two more op calls
    # each) cost ~1 ms of host time per token, more than the rest of the step's Python together.
    n = x.shape[0]
    if w.kind == "int4" and _packed(n):
        layout = _int4_layout(rt, w)
        work = n * layout.codes.size * 2
        args = (*layout.arrays, _f32(x), residual, weight, np.float32(eps), out)
        if _run(K.int4_matvec_add_rmsnorm, K.int4_matvec_add_rmsnorm_serial, work, *args):
            return
    delta = rt.scratch("linear_add_rmsnorm", out.shape)
    linear(rt, x, w, delta)
    K.add_rmsnorm(delta, residual, weight, np.float32(eps), out)


def gate_up_gelu(rt, x, w, out) -> None:
    # As the generic composition, without its two trips through the op table (18 calls a Gemma 3 decode step).
    gate_up = rt.scratch("gate_up_gelu", (out.shape[0], 2 * out.shape[1]))
    linear(rt, x, w, gate_up)
    gelu_mul(rt, gate_up, out)


def linear_post_norm_add_rmsnorm(rt, x, w, post_weight, residual, weight, eps, out) -> None:
    # The generic composition's three op calls in two (36 calls a Gemma 3 decode step).
    delta = rt.scratch("linear_post_norm", out.shape)
    linear(rt, x, w, delta)
    K.post_norm_add_rmsnorm(delta, post_weight, residual, weight, np.float32(eps), out)


def rmsnorm(rt, x, weight, eps, out) -> None:
    K.rmsnorm(x, weight, np.float32(eps), out)


def add_rmsnorm(rt, x, residual, weight, eps, out) -> None:
    K.add_rmsnorm(x, residual, weight, np.float32(eps), out)


def head_rmsnorm(rt, qkv, q_weight, k_weight, eps, spec, out) -> None:
    K.head_rmsnorm(qkv, q_weight, k_weight, np.float32(eps), spec.n_heads, spec.n_kv_heads, spec.head_dim, out)


def silu_mul(rt, gate_up, out) -> None:
    (K.silu_mul if PARALLEL_MODE == "always" else K.silu_mul_serial)(gate_up, out)


def gelu_mul(rt, gate_up, out) -> None:
    # NumPy's version makes five temporaries of the gate's size (a 512-token Gemma 3 prompt: 4 MiB each, per layer).
    (K.gelu_mul if PARALLEL_MODE == "always" else K.gelu_mul_serial)(gate_up, out)


def attention_decode(rt, qkv, cache, layer, slots, positions, rope, spec, out) -> None:
    half = cache.k.dtype == np.float16
    if qkv.dtype != np.float32 or not (cache.k.dtype == np.float32 or half and spec.head_dim % 16 == 0):
        numpy_ops.attention_decode(rt, qkv, cache, layer, slots, positions, rope, spec, out)
        return
    # numba has no float16: a float16 cache goes in as its bits, which the kernel narrows and widens row by row
    kc, vc = (cache.k.view(np.int16), cache.v.view(np.int16)) if half else (cache.k, cache.v)
    args = (qkv, kc, vc, layer, slots, positions, rope.cos, rope.sin)
    args += (spec.n_heads, spec.n_kv_heads, spec.head_dim)
    args_tail = (np.float32(spec.score_scale), spec.window or 0, np.float32(spec.softcap or 0.0), out)
    if len(slots) > SMALL_N:
        # Past SMALL_N rows this step's matmuls run in BLAS (see _int4_matmul): numba's pool, spinning after a
        # parallel region, would take the cores from BLAS's threads (a 16-row step on BLAS measured 260 ms against
        # 56 ms when that was the 16-row path).
        K.attention_decode_serial(*args, 1, *args_tail)
        return
    # max over a list: positions has at most SMALL_N rows here, and ndarray.max costs ~3 us (30 calls a step)
    work = len(slots) * spec.n_heads * (max(positions.tolist()) + 1) * spec.head_dim * 2
    if _parallel(work):
        # Split the positions into parts so that the (row, kv head, part) items are a multiple of the threads.
        threads = numba.get_num_threads()
        K.attention_decode(*args, threads // math.gcd(threads, len(slots) * spec.n_kv_heads), *args_tail)
    else:
        K.attention_decode_serial(*args, 1, *args_tail)


attention_decode.perfx_features = ("window", "softcap", "scale")


OPS = {
    "embedding": embedding,
    "int4_gemv": int4_gemv,
    "int4_gemm": int4_gemm,
    "dense_gemm": dense_gemm,
    "int8_gemm": int8_gemm,
    "int5_gemm": split_gemm,
    "int6_gemm": split_gemm,
    "rmsnorm": rmsnorm,
    "add_rmsnorm": add_rmsnorm,
    "silu_mul": silu_mul,
    "gelu_mul": gelu_mul,
    "head_rmsnorm": head_rmsnorm,
    "attention_decode": attention_decode,
    "linear": linear,
    "qkv_proj": linear,
    "logits": linear,
    "gate_up_silu": gate_up_silu,
    "gate_up_gelu": gate_up_gelu,
    "linear_add_rmsnorm": linear_add_rmsnorm,
    "linear_post_norm_add_rmsnorm": linear_post_norm_add_rmsnorm,
}


@hookimpl
def perfx_register_ops(register):
    for name, function in OPS.items():
        register("numpy", name, function, priority=PRIORITY)
