"""The OpenCL backends' ops (contract in perfx_core/ops.py and docs/ops.md): kernel launches.

Shared by ``opencl`` and ``opencl-adreno``; the runtime's variant picks the kernel build options.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from perfx_core.errors import BackendError, InvalidArgumentError
from perfx_core.ops import (
    ATTENTION_FEATURES,
    FAMILY_OPS,
    PRIMITIVE_OPS,
    PROMPT_KEYS,
    generic_attention_mixed,
    generic_gate_up_gelu,
    generic_gate_up_silu,
    prompt_indices,
    row_view,
)

from . import tuning
from .device_handles import CLInt8Weight
from .tuning import ADRENO_GEMV_TUNING, FLAGS, GEMV_TUNING  # the GEMV's default shapes (RW, KS, CR, UC, XS, QX)

# Fused composites, for int4 and byte-decoded weights and the token counts their kernels take (else the generic
# compositions), and the matmuls of the int8, int5 and int6 weight formats (the runtime lists them in
# weight_formats).
OPS = (
    PRIMITIVE_OPS
    + FAMILY_OPS
    + ("gate_up_silu", "linear_add_rmsnorm", "attention_mixed", "argmax", "sample", "write_columns")
    + ("int8_gemm", "int5_gemm", "int6_gemm")
)
BYTE_KINDS = ("int8", "int5", "int6")  # weights the byte-decoded kernels take (kernels/int8_weight.cl)
GEMV_KINDS = ("int4", *BYTE_KINDS)  # weights with a GEMV kernel of their own (and its fused gate and norm tails)

SMALL_N = 16  # up to this many tokens an int4 matmul uses the GEMV kernel, which reads W once for all of them
# Up to this many tokens (a short prompt), GEMV passes of SMALL_N tokens beat the tiled GEMM, whose 64-token
# tiles are mostly empty there (H200, 12288x4096: n = 32 in 2 passes ~180 us, GEMM 354 us; n = 64 ~350 vs 397).
GEMV_PASSES_N = 64
# Matrix-unit matmuls (kernels/int4_mma.cl) take int4 matmuls of at least MMA_MIN_N tokens where the runtime
# has them (rt.use_mma: NVIDIA's mma.sync). A shape is MT 16-row tiles x NT8 8-token tiles per warp and KW
# warps splitting k. From bench_ops.py --sweep-mma over Llama-2-7B's matmuls on the H200 (docs/opencl.md):
# what matters most is enough warps in flight, so KW grows until the launch has MMA_WARPS_PER_CU warps per
# compute unit; bigger tiles (MT = NT8 = 4: each load feeds more products) pay once there are many tokens.
MMA_MIN_N = 2
# UC chunks whose weights each warp loads before multiplying any (more bytes in flight). The H200 sweep
# (docs/results/h200_sweep_mma_chunks_ahead.jsonl) had UC = 4 faster by 8-24% where a warp holds two row tiles of
# sums (RT = 2) with one or four token tiles; with two token tiles UC = 2 or 4 ranged from 5% faster to 13% slower
# (no rule found), and with four row tiles they were slower (the registers). A run stays inside one group: with
# 32-column groups (GGUF Q4_0), loading each chunk's scales ahead too gained nothing. With three token tiles
# (17-24 tokens) UC = 4 was the best of 1, 2 and 4 as well (12288x4096 and 4096x11008, 128-column groups;
# h200_sweep_mma_three_token_tiles.jsonl).
MMA_UC = 4
MMA_EMULATION_FLOATS = 256 + 128  # local floats per warp of the matrix units' emulation (kernels/mma.cl MMA_SCRATCH)
MMA_WARPS_PER_CU = ((16, 16), (64, 8), (None, 30))  # (up to n tokens, warps per compute unit wanted)
# linear_add_rmsnorm of up to this many tokens on the matrix units finishes in the matmul's launch
# (kernels/add_norm_tail.cl): batched decode steps, where the separate add_rmsnorm launch cost more than its
# work (~10 us of device time per launch on the H200, 64 launches per step for a 7B). H200, GGUF Q4_0 7B, a
# batch-16 step: 4.93 vs 5.28 ms of device time. With three or four token tiles the build with the tail got
# fewer registers (90 vs 104 at four, -cl-nv-verbose) and a slower matmul, so 17-32 tokens run the 16-token
# shape (two token tiles per warp) in two groups of work-groups, which read W twice (the second probably from
# L2). H200, 7B mixed steps, device ms, separate launch / tail with 3-4 tiles / tail with 2
# (docs/results/h200_norm_tail_17_32_rows.jsonl): 31 rows 6.24 / 6.99 / 6.07; 23 rows 5.90 / 6.11 / 5.88.
MMA_ADD_NORM_N = 32
MMA_ADD_NORM_SHAPE_N = 16  # the token count whose shape the tail's launches take
DENSE_SMALL_N = 4  # the dense GEMV re-reads W per token, so it only pays for very small batches
TILE = 32  # output tile of the dense GEMM kernel (kernels/dense.cl)
GEMM_ROWS = 128  # weight rows per int4 GEMM work-group (kernels/int4_gemm.cl), 8 per thread
GEMM_TPT8_LOCAL_BYTES = 32 * 128 * 4 * 2  # its local copies of a chunk at 128 tokens: 32 x (128 rows + 128 tokens)
NORM_WG = 512  # threads per row of the norm kernels (kernels/elementwise.cl): one work-group per row
ARGMAX_WG = 256  # threads per row of argmax_rows
HEAD_WG = 64  # threads per head of head_rmsnorm (kernels/elementwise.cl): head_dim 64-256 is 1-4 elements each
ATT_WG = 128  # kernels/attention.cl
ATT_PART = 128  # key positions per attention work-group: long contexts split over more work-groups
# The fused decode kernel splits a row's context over work-groups (kernels/attention.cl): at most one split per
# DECODE_PART positions (each work-group has fixed costs: q, its reductions, its share of the merge), and no more
# than fill DECODE_GROUPS_PER_CU work-groups per compute unit. H200, 7B shape, position 2000, 4 layers
# (benchmarks/profile_steps.py --position 2000 --layers 4 --group 32, float16 cache; the kernel before its merge
# was spread over the work-items), attention ms per step at batch 1 / 16: 4 per CU 0.114 / 0.737, 8 per CU
# 0.135 / 0.873. The graph signature rounds positions to buckets of DECODE_PART (decode_signature), and the
# split count is a function of the bucket.
DECODE_PART = int(os.environ.get("PERFX_OPENCL_DECODE_PART", 64))
if DECODE_PART not in (16, 32, 64, 128):
    raise InvalidArgumentError(f"PERFX_OPENCL_DECODE_PART must be 16, 32, 64 or 128; got {DECODE_PART}")
DECODE_GROUPS_PER_CU = int(os.environ.get("PERFX_OPENCL_DECODE_GROUPS_PER_CU", 4))
if DECODE_GROUPS_PER_CU < 1:
    raise InvalidArgumentError(f"PERFX_OPENCL_DECODE_GROUPS_PER_CU must be at least 1; got {DECODE_GROUPS_PER_CU}")
# Local memory for one decode work-group's scores (all its query heads): this bounds a split's length
# (MAX_SPLIT). attention_mixed's work-groups also hold the prefill tile, so its decode rows get less.
DECODE_SCORE_BYTES = 8192
MIXED_DECODE_SCORE_BYTES = 2048
MAX_HEAD_DIM = 256


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _int4_weight_args(w) -> tuple:
    """The kernel arguments of an int4 weight (kernels/int4_group.cl INT4_WEIGHT_PARAMS): packed, scale and bias,
    each a (buffer, element offset) pair, since several weights share a buffer; a weight without stored biases
    passes its scales' buffer there, unread (its kernels are built with Q4_0_BIAS)."""
    bias = (w.scale.buffer, 0) if w.bias is None else (w.bias.buffer, w.bias.offset)
    # Buffers and ints, not tensors: the launch cache keeps its arguments, and a tensor there would keep the
    # weight's allocation (what allocated_bytes counts) alive after the model that owns it is gone.
    return w.packed.buffer, w.packed.offset, w.scale.buffer, w.scale.offset, *bias


def _factor_form(w) -> str:
    """How an int4 weight keeps its group factors (kernels/int4_group.cl): "q4_0" (no biases: -8 * scale),
    "q4_k" (a GGUF Q4_K's own sc, m, d and dmin) or "stored" (a float16 scale and a float32 bias per group)."""
    return "q4_k" if w.k_factors else ("q4_0" if w.bias is None else "stored")


def _factor_options(form: str) -> dict:
    return {"Q4_0_BIAS": form == "q4_0", "Q4_K_FACTORS": form == "q4_k"}


def _gemv_shape(rt) -> tuple[int, int]:
    return (64, 2) if rt.variant == "adreno" else (32, 4)


def _dense_options(w) -> dict:
    return {"W_HALF": w.data.dtype == np.float16}


def embedding(rt, table, ids, out):
    n, d = out.shape
    if n == 0:
        return
    ids_buf = rt.upload_ints("ids", ids)
    if table.kind == "int4":
        kernel = rt.kernel("int4", "embedding_int4", **_factor_options(_factor_form(table)))
        rt.launch(
            kernel,
            (_round_up(d, 64), n),
            None,
            *_int4_weight_args(table),
            ids_buf,
            out,
            table.shape[0],
            d,
            table.group_size.bit_length() - 1,
        )
    elif table.kind in BYTE_KINDS:
        kernel = rt.kernel("int8", "embedding_int8", **_int8_options(table))
        rt.launch(
            kernel,
            (_round_up(d, 64), n),
            None,
            *_int8_weight_args(table),
            ids_buf,
            out,
            table.shape[0],
            d,
            table.group_size.bit_length() - 1,
        )
    else:
        kernel = rt.kernel("dense", "embedding_dense", **_dense_options(table))
        rt.launch(kernel, (_round_up(d, 64), n), None, table.data.buffer, ids_buf, out, d)


@functools.lru_cache(maxsize=8)
def gemv_overrides() -> dict[str, int]:
    """PERFX_OPENCL_GEMV="RW=32,KS=8,CR=2" overrides the GEMV shape everywhere (experiments). Read once: a
    script that changes the variable calls ``gemv_overrides.cache_clear()`` and ``clear_plans(rt)``."""
    overrides = {}
    for item in filter(None, os.environ.get("PERFX_OPENCL_GEMV", "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in GEMV_TUNING or not value.strip().isdigit() or (int(value) < 1 and key not in FLAGS):
            raise InvalidArgumentError(
                f"PERFX_OPENCL_GEMV: {item!r} is not KEY=N with KEY one of {', '.join(GEMV_TUNING)} and N >= 1 "
                f"(0 or 1 for {' and '.join(FLAGS)})"
            )
        overrides[key] = int(value)
    return overrides


def gemv_tuning(rt, silu: bool, rows: int, k: int, nt: int, form: str = tuning.DEFAULT_FORM) -> dict[str, int]:
    """The int4 GEMV shape for one matmul: RW row lanes x KS k-splits per work-group, CR output columns per
    thread, UC chunks loaded together. A forced shape (tuner), else the device's `perfx tune` result for this
    matmul and weight form (the user's, else the one shipped for the device; a shape tuned for another form
    next), else the variant's default; then PERFX_OPENCL_GEMV."""
    forced = rt.__dict__.get("_forced_gemv")
    if forced is not None:
        return dict(forced)
    tuned = rt.__dict__.get("_gemv_tuned")
    if tuned is None:
        tuned = rt.__dict__["_gemv_tuned"] = {**tuning.shipped(rt), **tuning.load(rt)}
    config = tuned.get(tuning.shape_key(silu, rows, k, nt, form))
    if config is None:
        config = tuned.get(tuning.shape_key(silu, rows, k, nt))
    if config is None:
        config = dict(ADRENO_GEMV_TUNING if rt.variant == "adreno" else GEMV_TUNING)
        config["QX"] = int(rt.native_int_dot)
        if nt > 1:
            config["CR"] = 1  # NT accumulators per column already fill many registers
    return {**config, **gemv_overrides()}


def clear_plans(rt) -> None:
    """Forget the launch plans (GEMV and mma) and loaded tuning of ``rt`` (after the tuning changed)."""
    rt.__dict__.pop("_gemv_plans", None)
    rt.__dict__.pop("_gemv_tuned", None)


@contextlib.contextmanager
def forced_gemv_tuning(rt, config: dict[str, int]) -> Iterator[None]:
    """Run every GEMV of ``rt`` with ``config`` inside the block (the tuner's candidates)."""
    rt.__dict__["_forced_gemv"] = dict(config)
    clear_plans(rt)
    try:
        yield
    finally:
        rt.__dict__.pop("_forced_gemv", None)
        clear_plans(rt)


def _local_bytes(rt) -> int:
    """Local memory a kernel's arrays may take on ``rt``'s device (1 KB kept for the compiler's own use)."""
    return rt.device.details.get("local_memory_bytes", 32768) - 1024


def _partial_bytes(config: dict[str, int], row_slots: int, nt: int) -> int:
    """The GEMV's local partial sums: KS x RW x row slots x NT floats."""
    return config["KS"] * config["RW"] * row_slots * nt * 4


def _fit_work_group(rt, config: dict[str, int], row_slots: int, nt: int, extra_local: int) -> dict[str, int]:
    """Shrink the shape (KS, then RW, then CR) until the work-group and its local partial sums, plus
    ``extra_local`` bytes, fit the device."""
    config = dict(config)
    local_budget = _local_bytes(rt) - extra_local
    max_group = rt.device.details.get("max_work_group_size", 256)
    silu_factor = row_slots // config["CR"]

    def fits() -> bool:
        slots = config["CR"] * silu_factor
        return _partial_bytes(config, slots, nt) <= local_budget and config["KS"] * config["RW"] <= max_group

    for key in ("KS", "RW"):
        while not fits() and config[key] > 1:
            config[key] //= 2
    if not fits():
        config["CR"] = 1
    if not fits():
        raise BackendError(f"no int4 GEMV work-group fits this device ({max_group} threads, {local_budget} B local)")
    return config


QX_CHUNK_BYTES = 72  # local memory per token and chunk of quantized x: four 16-byte planes, d and the sum


def _qx_slice(rt, config: dict[str, int], row_slots: int, nt: int, chunks: int) -> int:
    """Chunks of quantized x staged in local memory at a time: all of them when they fit, else the largest
    multiple of the chunks one pass of the work-group takes (KS x UC), else as many as fit; 0 when none does."""
    fit = (_local_bytes(rt) - _partial_bytes(config, row_slots, nt)) // (nt * QX_CHUNK_BYTES)
    if fit >= chunks:
        return chunks
    step = config["KS"] * config["UC"]
    return fit // step * step if fit >= step else max(fit, 0)


def _gemv_plan(
    rt,
    silu: bool,
    nt: int,
    rows: int,
    k: int,
    x_form: str,
    add_norm: bool = False,
    factors: str = "stored",
    group_size: int = 128,
    gelu: bool = False,
    post_norm: bool = False,
) -> tuple[Any, tuple[int, int], tuple[int, int]]:
    """(kernel, global size, local size) of a GEMV launch, worked out once per shape and kept on the runtime
    (``gelu``: the gated one's activation is GELU; it reads and sums what the SiLU one does, so shares its shape;
    ``post_norm``: the add_norm tail norms delta first)."""
    plans = rt.__dict__.setdefault("_gemv_plans", {})
    key = (silu, nt, rows, k, x_form, add_norm, factors, group_size, gelu, post_norm)
    plan = plans.get(key)
    if plan is None:
        config = gemv_tuning(rt, silu, rows, k, nt, tuning.weight_form(group_size, factors == "q4_0"))
        quantized = config.pop("QX", 0) == 1
        # XS=1: chunk sums of x shared in local memory (n = 1 only; the kernel is then built per k).
        xsum_chunks = k // 32 if config.pop("XS", 0) and nt == 1 and not quantized else 0
        if add_norm:  # the last work-group normalises n rows alone: give it at least 256 threads
            config["KS"] = max(config["KS"], 256 // config["RW"])
        row_slots = config["CR"] * (2 if silu else 1)
        config = _fit_work_group(rt, config, row_slots, nt, 4 * xsum_chunks)
        qx_slice = _qx_slice(rt, config, row_slots, nt, k // 32) if quantized else 0
        kernel = rt.kernel(
            "int4",
            "int4_gemv",
            NT=nt,
            SILU=silu,
            GELU=gelu,
            ADD_NORM=add_norm,
            POST_NORM=post_norm,
            X_IMAGE=x_form == "image",
            X_UNALIGNED=x_form == "unaligned",
            XSUM_CHUNKS=xsum_chunks or False,
            QX=qx_slice > 0,
            QX_SLICE=qx_slice or False,
            **_factor_options(factors),
            **config,
        )
        per_group = config["RW"] * config["CR"]
        plan = plans[key] = (
            kernel,
            ((rows + per_group - 1) // per_group * config["RW"], config["KS"]),
            (config["RW"], config["KS"]),
        )
    return plan


def _int4_gemv(rt, x, w, out, n, silu=False, epilogue=(), gelu=False, post_weight=None):
    """GEMV for n <= SMALL_N tokens, W read once for all of them; with ``silu`` W is [W_gate; W_up] (and ``gelu``
    makes the gate's activation GELU); a non-empty ``epilogue`` (residual, norm weight, normed, eps, counter,
    finishers) adds the add_rmsnorm tail, which with ``post_weight`` norms the output by it first."""
    k = w.shape[1]
    rows = w.shape[0] // 2 if silu else w.shape[0]
    nt = 1 << max(0, (n - 1).bit_length())  # tokens per pass: n rounded up to a power of two
    image = rt.image_of(x)
    x_form = "image" if image is not None else ("aligned" if x.offset % 4 == 0 else "unaligned")
    kernel, global_size, local_size = _gemv_plan(
        rt, silu, nt, rows, k, x_form, bool(epilogue), _factor_form(w), w.group_size, gelu, post_weight is not None
    )
    x_arg = (image, x.offset) if image is not None else (x,)
    rt.launch(
        kernel,
        global_size,
        local_size,
        *_int4_weight_args(w),
        *x_arg,
        out,
        n,
        rows,
        k,
        w.group_size.bit_length() - 1,
        *epilogue,
        *_post(post_weight),
    )


def _post(post_weight) -> tuple:
    """The post-norm weight's launch argument, where the tail takes one (kernels' POST_NORM_ARGS)."""
    return () if post_weight is None else (post_weight,)


def _gemv_passes(rt, x, w, out, silu=False, gelu=False):
    """The GEMV of the weight's format (int4 or byte-decoded) over ``x``'s rows SMALL_N at a time (views: no
    copies)."""
    gemv = _int4_gemv if w.kind == "int4" else _int8_gemv
    n, cols = out.shape
    k = x.shape[1]
    for start in range(0, n, SMALL_N):
        rows = min(SMALL_N, n - start)
        part_x, part_out = rt.view(x, start * k, (rows, k)), rt.view(out, start * cols, (rows, cols))
        gemv(rt, part_x, w, part_out, rows, silu=silu, gelu=gelu)


def int4_gemv(rt, x, w, out):
    _int4_gemv(rt, x, w, out, 1)


def _gemm_tokens_per_thread(rt, n: int, m: int) -> int:
    """8 (128-token tiles: each weight read from local memory feeds more tokens) when that still makes two
    work-groups per compute unit, else 4 (64-token tiles, twice the work-groups). PERFX_OPENCL_GEMM_TPT=4|8
    forces one (experiments)."""
    forced = os.environ.get("PERFX_OPENCL_GEMM_TPT")
    if forced is not None:
        if forced not in ("4", "8"):
            raise InvalidArgumentError(f"PERFX_OPENCL_GEMM_TPT must be 4 or 8; got {forced!r}")
        return int(forced)
    if _local_bytes(rt) < GEMM_TPT8_LOCAL_BYTES:
        return 4  # 128-token tiles need 32 KB of local memory: the whole of it on many mobile GPUs
    tiles = -(-m // GEMM_ROWS) * -(-n // 128)
    return 8 if tiles >= 2 * rt.device.details.get("compute_units", 1) else 4


@functools.lru_cache(maxsize=8)
def mma_overrides() -> dict[str, int]:
    """PERFX_OPENCL_MMA_SHAPE="MT=4,NT8=2,KW=2" overrides the matrix-unit kernel's shape (experiments). Read
    once: a script that changes the variable calls ``mma_overrides.cache_clear()`` and ``clear_plans(rt)``."""
    overrides = {}
    for item in filter(None, os.environ.get("PERFX_OPENCL_MMA_SHAPE", "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        allowed = ("1", "2", "3", "4", "8", "16") if key == "NT8" else ("1", "2", "4", "8", "16")
        if key not in ("MT", "NT8", "KW", "UC") or value.strip() not in allowed:
            raise InvalidArgumentError(
                f"PERFX_OPENCL_MMA_SHAPE: {item!r} is not KEY=N (KEY: MT, NT8, KW or UC; N: 1, 2, 4, 8, 16; NT8 also 3)"
            )
        overrides[key] = int(value)
    return overrides


def on_matrix_units(rt, n: int) -> bool:
    """Whether an int4 matmul of n tokens runs on the matrix-unit kernel on ``rt`` (int4_gemm, gate_up_silu, and
    so which token counts linear_add_rmsnorm and the GEMV tuner see)."""
    return n >= MMA_MIN_N and rt.use_mma


def _mma_config(
    rt, n: int, rows: int, k: int, group_size: int, silu: bool = False, add_norm: bool = False
) -> dict[str, int]:
    """The mma kernel's shape for n tokens of a rows x k matmul (module comment above), then overrides. With
    ``silu`` each row tile comes with its up tile, so MT is halved: the same work per warp as a plain matmul
    over both halves."""
    m = 2 * rows if silu else rows
    if add_norm:
        n = min(n, MMA_ADD_NORM_SHAPE_N)  # MMA_ADD_NORM_N: its launches keep two token tiles per warp
    if n <= 16:
        config = {"MT": 2, "NT8": 1 if n <= 8 else 2}
    else:  # three token tiles up to 24 tokens (the H200 sweep: 7-17% faster there than four)
        config = {"MT": 4 if n > 32 or m >= 16384 else 2, "NT8": 3 if n <= 24 else 4}
    if silu:
        config["MT"] = max(1, config["MT"] // 2)
    overrides = mma_overrides()
    config.update({key: overrides[key] for key in ("MT", "NT8") if key in overrides})
    row_tiles = config["MT"] * (2 if silu else 1)
    # UC: chunks loaded ahead (int4_mma.cl), at most a group's chunks; 1 in the emulation (its barriers).
    group_chunks = group_size // 32
    wanted = MMA_UC if row_tiles == 2 and config["NT8"] in (1, 3, 4) else 1
    config["UC"] = min(overrides.get("UC", wanted), group_chunks) if rt.native_mma else 1
    config["GROUP_CHUNKS"] = group_chunks
    chunks, max_kw = k // 32, 16 if n <= 16 else 8
    if "KW" in overrides:
        kw = overrides["KW"]
    else:
        per_cu = next(want for limit, want in MMA_WARPS_PER_CU if limit is None or n <= limit)
        tiles = -(-rows // (16 * config["MT"])) * -(-n // (8 * config["NT8"]))
        target = per_cu * rt.device.details.get("compute_units", 1)
        kw = 1
        while kw < max_kw and tiles * kw < target and chunks % (2 * kw) == 0:
            kw *= 2
    emulated = not rt.native_mma
    local = _local_bytes(rt)
    while chunks % kw or (kw > 1 and _mma_local_bytes(kw, row_tiles, config["NT8"], emulated, add_norm) > local):
        kw //= 2  # each warp takes an equal run of the chunks, and the warps' partial sums fit local memory
    return {**config, "KW": kw}


def _mma_local_bytes(kw: int, row_tiles: int, nt8: int, emulated: bool, add_norm: bool = False) -> int:
    """int4_mma.cl's local arrays: the partial sums of warps 1..KW-1, the emulation's per-warp tiles, and the
    add + RMSNorm tail's reduction scratch and ticket."""
    tail = 32 * kw + 1 if add_norm else 0
    return 4 * ((kw - 1) * row_tiles * nt8 * 4 * 32 + (kw * MMA_EMULATION_FLOATS if emulated else 0) + tail)


def _mma_plan(
    rt,
    silu: bool,
    n: int,
    rows: int,
    k: int,
    group_size: int,
    unaligned: bool,
    add_norm: bool = False,
    factors: str = "stored",
    gelu: bool = False,
    post_norm: bool = False,
) -> tuple[Any, tuple, tuple]:
    """(kernel, global size, local size) of an mma launch, worked out once per shape and kept on the runtime
    with the GEMV's plans (clear_plans forgets both)."""
    plans = rt.__dict__.setdefault("_gemv_plans", {})
    key = ("mma", silu, n, rows, k, group_size, unaligned, add_norm, factors, gelu, post_norm)
    plan = plans.get(key)
    if plan is None:
        config = _mma_config(rt, n, rows, k, group_size, silu, add_norm)
        kernel = rt.kernel(
            "int4_mma",
            "int4_mma",
            SILU=silu,
            GELU=gelu,
            X_UNALIGNED=unaligned,
            ADD_NORM=add_norm,
            POST_NORM=post_norm,
            **_factor_options(factors),
            **config,
        )
        global_size = (-(-rows // (16 * config["MT"])) * 32 * config["KW"], -(-n // (8 * config["NT8"])))
        plan = plans[key] = (kernel, global_size, (32 * config["KW"], 1))
    return plan


def _int4_mma(rt, x, w, out, silu=False, epilogue=(), gelu=False, post_weight=None):
    """out = x @ W.T (``silu``: silu(x @ W_gate.T) * (x @ W_up.T), gelu_tanh with ``gelu``) on the matrix units, any
    number of tokens; a non-empty ``epilogue`` (residual, norm weight, normed, eps, counter) adds the add_rmsnorm
    tail (``post_weight`` as in _int4_gemv)."""
    n, rows = out.shape
    k = w.shape[1]
    kernel, global_size, local_size = _mma_plan(
        rt,
        silu,
        n,
        rows,
        k,
        w.group_size,
        x.offset % 4 != 0,
        bool(epilogue),
        _factor_form(w),
        gelu,
        post_weight is not None,
    )
    if epilogue:
        groups = global_size[0] // local_size[0] * global_size[1]
        epilogue = (*epilogue, _tail_finishers(rt, n, groups))
    rt.launch(
        kernel,
        global_size,
        local_size,
        *_int4_weight_args(w),
        x,
        out,
        n,
        rows,
        k,
        *epilogue,
        *_post(post_weight),
    )


def _tail_finishers(rt, n: int, groups: int) -> int:
    """Work-groups that do the add + RMSNorm tail of a launch of ``groups`` (kernels/add_norm_tail.cl): one per
    token where a launch's work-groups run side by side (NVIDIA), so a finisher may wait for the others, at most
    half the compute units (the ones waited for always have room to run); else the last work-group alone.
    PERFX_OPENCL_NORM_FINISHERS=N caps it (experiments)."""
    cap = _norm_finishers_cap()
    if not rt.concurrent_groups:
        return 1
    wanted = min(n, groups, rt.device.details.get("compute_units", 1) // 2)
    return max(1, wanted if cap is None else min(wanted, cap))


@functools.lru_cache(maxsize=1)
def _norm_finishers_cap() -> int | None:
    """PERFX_OPENCL_NORM_FINISHERS: at most this many finishers; 0 turns the matrix units' tail off (their
    linear_add_rmsnorm is then the matmul and a separate add_rmsnorm launch, as before the tail; the GEMV's
    one-finisher tail is unaffected). Read once."""
    value = os.environ.get("PERFX_OPENCL_NORM_FINISHERS")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise InvalidArgumentError(f"PERFX_OPENCL_NORM_FINISHERS must be a whole number; got {value!r}")
    return int(value)


def int4_gemm(rt, x, w, out):
    n, m = out.shape
    k = w.shape[1]
    if on_matrix_units(rt, n):
        _int4_mma(rt, x, w, out)
        return
    if n <= GEMV_PASSES_N:
        _gemv_passes(rt, x, w, out)
        return
    tpt = _gemm_tokens_per_thread(rt, n, m)
    kernel = rt.kernel("int4_gemm", "int4_gemm", TPT=tpt, **_factor_options(_factor_form(w)))
    rt.launch(
        kernel,
        (_round_up(m, GEMM_ROWS) // 8, _round_up(n, 16 * tpt) // tpt),
        (16, 16),
        *_int4_weight_args(w),
        x,
        out,
        n,
        m,
        k,
        w.group_size.bit_length() - 1,
    )


# -- byte-decoded weights (kernels/int8_weight.cl: Int8Weight, GGUF Q8_0; Int6Weight, Q6_K; Int5Weight, Q5_0,
# Q5_1, Q5_K) -----------------------------------------------------------------------------------------------------


def _int8_options(w) -> dict:
    """The build options of a byte-decoded weight's form (int8_weight.cl)."""
    if w.kind == "int6":
        return {"INT6": True}
    if w.kind == "int5":
        return {"INT5": True, "Q5_0_BIAS": "bias" not in w.planes}
    return {"SCALE_F32": w.scale.dtype == np.float32}


def _has_bias(w) -> bool:
    return w.kind == "int5" and "bias" in w.planes


def _int8_weight_args(w) -> tuple:
    """A byte-decoded weight's arrays as its kernels take them (int8_weight.cl BYTE_WEIGHT_PARAMS): an int8 one's
    codes and scales; an int6 or int5 one's planes as (buffer, element offset) pairs, a Q5_0 one's scales'
    buffer in its bias's place, unread. Buffers and ints, not tensors (_int4_weight_args says why)."""
    if w.kind == "int8":
        return w.codes.buffer, w.scale.buffer
    planes = list(w.planes.values())
    if w.kind == "int5" and not _has_bias(w):  # Q5_0: its scales in the bias's place
        planes.append(w.planes["scale"])
    return tuple(a for t in planes for a in (t.buffer, t.offset))


def _form_key(w) -> tuple:
    return tuple(sorted(_int8_options(w).items()))


def _group_shift(w) -> int:
    return w.group_size.bit_length() - 1


def _int8_gemv_plan(
    rt,
    silu: bool,
    nt: int,
    rows: int,
    x_form: str,
    add_norm: bool,
    form: tuple,
    gelu: bool = False,
    post_norm: bool = False,
) -> tuple[Any, tuple[int, int], tuple[int, int]]:
    """(kernel, global size, local size) of an int8 GEMV launch (kept with the int4 GEMV's plans). Its shape is
    the variant's untuned int4 default (RW, KS, UC: a chunk is 16 bytes in both formats) with PERFX_OPENCL_GEMV's
    RW, KS and UC; `perfx tune` does not tune it."""
    plans = rt.__dict__.setdefault("_gemv_plans", {})
    key = ("int8", silu, nt, rows, x_form, add_norm, form, gelu, post_norm)
    plan = plans.get(key)
    if plan is None:
        base = {**(ADRENO_GEMV_TUNING if rt.variant == "adreno" else GEMV_TUNING), **gemv_overrides()}
        config = {"RW": base["RW"], "KS": base["KS"], "UC": base["UC"], "CR": 1}
        if add_norm:  # the last work-group normalises n rows alone: give it at least 256 threads
            config["KS"] = max(config["KS"], 256 // config["RW"])
        config = _fit_work_group(rt, config, 2 if silu else 1, nt, 0)
        del config["CR"]
        kernel = rt.kernel(
            "int8",
            "int8_gemv",
            NT=nt,
            SILU=silu,
            GELU=gelu,
            ADD_NORM=add_norm,
            POST_NORM=post_norm,
            X_IMAGE=x_form == "image",
            X_UNALIGNED=x_form == "unaligned",
            **dict(form),
            **config,
        )
        plan = plans[key] = (kernel, (_round_up(rows, config["RW"]), config["KS"]), (config["RW"], config["KS"]))
    return plan


def _int8_gemv(rt, x, w, out, n, silu=False, epilogue=(), gelu=False, post_weight=None):
    """int4_gemv's counterpart for int8 weights (kernels/int8.cl), n <= SMALL_N tokens: W read once for all of
    them; ``silu``, ``epilogue``, ``gelu`` and ``post_weight`` as there."""
    k = w.shape[1]
    rows = w.shape[0] // 2 if silu else w.shape[0]
    nt = 1 << max(0, (n - 1).bit_length())
    image = rt.image_of(x)
    x_form = "image" if image is not None else ("aligned" if x.offset % 4 == 0 else "unaligned")
    kernel, global_size, local_size = _int8_gemv_plan(
        rt, silu, nt, rows, x_form, bool(epilogue), _form_key(w), gelu, post_weight is not None
    )
    x_arg = (image, x.offset) if image is not None else (x,)
    rt.launch(
        kernel, global_size, local_size, *_int8_weight_args(w), *x_arg, out, n, rows, k, _group_shift(w),
        *epilogue, *_post(post_weight),
    )  # fmt: skip


INT8_MMA = os.environ.get("PERFX_OPENCL_INT8_MMA", "1") != "0"  # 0: int8 prompts on the tiled GEMM (A/B runs)


def _int8_mma(rt, x, w, out):
    """out = x @ W.T for an int8 W on the matrix units (kernels/int8_mma.cl), in the int4 kernel's shape for the
    same matmul (its KW divides k / 32, so it divides the int8 kernel's k / 16 chunks too)."""
    n, rows = out.shape
    k = w.shape[1]
    plans = rt.__dict__.setdefault("_gemv_plans", {})
    unaligned = x.offset % 4 != 0
    key = ("int8_mma", n, rows, k, unaligned, _form_key(w))
    plan = plans.get(key)
    if plan is None:
        shape = _mma_config(rt, n, rows, k, 32)
        config = {name: shape[name] for name in ("MT", "NT8", "KW")}
        while (k // 16) % config["KW"]:  # each warp takes an equal run of the 16-column chunks
            config["KW"] //= 2
        kernel = rt.kernel("int8_mma", "int8_mma", X_UNALIGNED=unaligned, **_int8_options(w), **config)
        global_size = (-(-rows // (16 * config["MT"])) * 32 * config["KW"], -(-n // (8 * config["NT8"])))
        plan = plans[key] = (kernel, global_size, (32 * config["KW"], 1))
    kernel, global_size, local_size = plan
    rt.launch(kernel, global_size, local_size, *_int8_weight_args(w), x, out, n, rows, k, _group_shift(w))


def int8_gemm(rt, x, w, out):
    """A byte-decoded weight's matmul (int8, int5 or int6): the GEMV in passes of SMALL_N tokens up to
    GEMV_PASSES_N; beyond, the matrix units where the runtime has them (a 7B Q4_K_M's Q6_K matmuls of a 512-token
    prefill on the H100: see docs/opencl.md) and the weight has no bias term, else the tiled GEMM
    (kernels/int8_gemm.cl)."""
    n, m = out.shape
    if n <= GEMV_PASSES_N:
        _gemv_passes(rt, x, w, out)
        return
    if INT8_MMA and on_matrix_units(rt, n) and not _has_bias(w):
        _int8_mma(rt, x, _as_int8(rt, w), out)
        return
    tpt = _gemm_tokens_per_thread(rt, n, m)
    rt.launch(
        rt.kernel("int8_gemm", "int8_gemm", TPT=tpt, **_int8_options(w)),
        (_round_up(m, GEMM_ROWS) // 8, _round_up(n, 16 * tpt) // tpt),
        (16, 16),
        *_int8_weight_args(w),
        x,
        out,
        n,
        m,
        w.shape[1],
        _group_shift(w),
    )


int5_gemm = int6_gemm = int8_gemm  # one set of kernels, built per form (_int8_options)


def _as_int8(rt, w):
    """``w`` in the int8 form that the matrix-unit kernel takes: itself, or an int6 / Q5_0 weight expanded into
    scratch buffers (int8.cl to_int8). Expanding reads the weight once and writes 1.25 bytes per weight, a small
    part of a prompt matmul's cost, and keeps the matrix-unit kernel at one load per lane and row (decoding the
    planes there was slower: docs/opencl.md)."""
    if w.kind == "int8":
        return w
    m, k = w.shape
    chunks = k // 16
    view = CLInt8Weight(
        w.shape, 16, rt.scratch("int8_codes", (chunks, m, 16), np.uint8), rt.scratch("int8_scales", (chunks, m))
    )
    kernel = rt.kernel("int8", "to_int8", **_int8_options(w))
    rt.launch(kernel, (m, chunks), None, *_int8_weight_args(w), view.codes.buffer, view.scale.buffer, m)
    return view


def dense_gemm(rt, x, w, out):
    n, m = out.shape
    k = w.shape[1]
    if n <= DENSE_SMALL_N:
        lx, ly = _gemv_shape(rt)
        kernel = rt.kernel("dense", "dense_gemv", **_dense_options(w))
        rt.launch(kernel, (lx, _round_up(m, ly), n), (lx, ly, 1), w.data.buffer, x, out, m, k)
        return
    kernel = rt.kernel("dense", "dense_gemm", **_dense_options(w))
    rt.launch(kernel, (_round_up(m, TILE) // 2, _round_up(n, TILE) // 2), (16, 16), w.data.buffer, x, out, n, m, k)


def _gate_up(rt, x, w_gate_up, out, gelu: bool) -> bool:
    """The gated MLP's first half in the matmul's launch where a kernel takes it; False where none does."""
    if w_gate_up.kind == "int4" and on_matrix_units(rt, out.shape[0]):
        _int4_mma(rt, x, w_gate_up, out, silu=True, gelu=gelu)
    elif w_gate_up.kind in GEMV_KINDS and out.shape[0] <= GEMV_PASSES_N:
        _gemv_passes(rt, x, w_gate_up, out, silu=True, gelu=gelu)
    else:
        return False
    return True


def gate_up_silu(rt, x, w_gate_up, out):
    if not _gate_up(rt, x, w_gate_up, out, gelu=False):
        generic_gate_up_silu(rt, x, w_gate_up, out)


def gate_up_gelu(rt, x, w_gate_up, out):
    if not _gate_up(rt, x, w_gate_up, out, gelu=True):
        generic_gate_up_gelu(rt, x, w_gate_up, out)  # the matmul, then gelu_mul below


def _linear_norm_tail(rt, x, w, residual, weight, eps, out, post_weight=None) -> bool:
    """linear_add_rmsnorm (with ``post_weight``: linear_post_norm_add_rmsnorm) in the matmul's launch, whose kernel
    finishes the job (kernels/add_norm_tail.cl): the GEMV (int4 or byte-decoded) up to SMALL_N tokens, the matrix units
    (int4) up to MMA_ADD_NORM_N. False where no kernel takes it."""
    n = out.shape[0]
    mma = w.kind == "int4" and on_matrix_units(rt, n)
    if mma:
        fused = n <= MMA_ADD_NORM_N and _norm_finishers_cap() != 0
    else:
        fused = n <= SMALL_N
    if w.kind not in GEMV_KINDS or not rt.norm_tails or not fused:
        return False
    delta = rt.scratch("linear_add_rmsnorm", out.shape)
    epilogue = (residual, weight, out, float(eps), rt.zeroed_ints("add_norm_counter", 2))
    if mma:
        _int4_mma(rt, x, w, delta, epilogue=epilogue, post_weight=post_weight)
    else:
        gemv = _int4_gemv if w.kind == "int4" else _int8_gemv
        gemv(rt, x, w, delta, n, epilogue=(*epilogue, 1), post_weight=post_weight)
    return True


def linear_add_rmsnorm(rt, x, w, residual, weight, eps, out):
    """One launch where the matmul kernel can finish the job; else the matmul into ``out``, then add_rmsnorm in
    place there: each of its work-items reads the elements it later writes (add_rmsnorm_token), so no delta
    buffer is needed (a 7B's 512-token prefill chunk: 8 MiB)."""
    if not _linear_norm_tail(rt, x, w, residual, weight, eps, out):
        rt.ops.linear(x, w, out)
        add_rmsnorm(rt, out, residual, weight, eps, out)


def linear_post_norm_add_rmsnorm(rt, x, w, post_weight, residual, weight, eps, out):
    """One launch where the matmul kernel can finish the job; else the matmul, then one norms launch."""
    if _linear_norm_tail(rt, x, w, residual, weight, eps, out, post_weight):
        return
    rt.ops.linear(x, w, out)  # delta in out, normed in place as in linear_add_rmsnorm
    n, d = out.shape
    kernel = rt.kernel("elementwise", "post_norm_add_rmsnorm", NORM_WG=NORM_WG)
    rt.launch(kernel, (NORM_WG * n,), (NORM_WG,), out, post_weight, residual, weight, out, d, float(eps))


def rmsnorm(rt, x, weight, eps, out):
    n, d = out.shape
    rt.launch(
        rt.kernel("elementwise", "rmsnorm", NORM_WG=NORM_WG), (NORM_WG * n,), (NORM_WG,), x, weight, out, d, float(eps)
    )


def add_rmsnorm(rt, x, residual, weight, eps, out):
    n, d = out.shape
    rt.launch(
        rt.kernel("elementwise", "add_rmsnorm", NORM_WG=NORM_WG),
        (NORM_WG * n,),
        (NORM_WG,),
        x,
        residual,
        weight,
        out,
        d,
        float(eps),
    )


def argmax(rt, logits, out):
    n, vocab = logits.shape
    if n:
        kernel = rt.kernel("elementwise", "argmax_rows", ARGMAX_WG=ARGMAX_WG)
        rt.launch(kernel, (ARGMAX_WG * n,), (ARGMAX_WG,), logits, out, vocab)


def sample(rt, logits, rows, out):
    n, vocab = logits.shape
    if n:
        kernel = rt.kernel("elementwise", "sample_rows", ARGMAX_WG=ARGMAX_WG)
        rt.launch(kernel, (ARGMAX_WG * n,), (ARGMAX_WG,), logits, rt.upload_ints("sampling", rows), out, vocab)


def silu_mul(rt, gate_up, out):
    n, f = out.shape
    rt.launch(rt.kernel("elementwise", "silu_mul"), (_round_up(f, 64), n), None, gate_up, out, f)


def gelu_mul(rt, gate_up, out):
    n, f = out.shape
    rt.launch(rt.kernel("elementwise", "gelu_mul"), (_round_up(f, 64), n), None, gate_up, out, f)


def add_bias(rt, x, bias, out):
    n, m = out.shape
    rt.launch(rt.kernel("elementwise", "add_bias"), (_round_up(m, 64), n), None, x, bias, out, m)


def write_columns(rt, x, start, out):
    n, m = x.shape
    rt.launch(rt.kernel("elementwise", "write_columns"), (_round_up(m, 64), n), None, x, out, m, out.shape[1], start)


def _flat(rt, name: str, x, out, value: float) -> None:
    count = int(np.prod(out.shape))
    if count:
        rt.launch(rt.kernel("elementwise", name), (_round_up(count, 256),), None, x, out, count, float(value))


def scale(rt, x, factor, out):
    _flat(rt, "scale", x, out, factor)


def softcap(rt, x, cap, out):
    _flat(rt, "softcap", x, out, cap)


def head_rmsnorm(rt, qkv, q_weight, k_weight, eps, spec, out):
    n = out.shape[0]
    if n:
        heads = spec.n_heads + 2 * spec.n_kv_heads
        kernel = rt.kernel("elementwise", "head_rmsnorm", HEAD_WG=HEAD_WG)
        rt.launch(
            kernel, (HEAD_WG * heads, n), (HEAD_WG, 1), qkv, q_weight, k_weight, out, spec.head_dim, spec.n_heads,
            spec.n_kv_heads, float(eps),
        )  # fmt: skip


def _placement(rt, cache, layer, slots, positions, rope, spec, keys=("slots", "positions")) -> tuple:
    """Where the new rows go and how to read the cache: the leading arguments of every attention kernel. The
    index uploads are named ``keys`` (a prompt's differ from the decode rows' in a mixed step: a recorded step
    replays each from its own input)."""
    hd, c = spec.head_dim, cache.spec
    if hd % 2 or hd > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"the OpenCL attention kernels take an even head_dim up to {MAX_HEAD_DIM}; got {hd}")
    return (
        rt.upload_ints(keys[0], slots),
        rt.upload_ints(keys[1], positions),
        rope.cos,
        rope.sin,
        cache.k.buffer,
        cache.v.buffer,
        layer,
        c.n_slots,
        c.n_kv_heads,
        c.max_seq_len,
    )


def _feature_defines(spec) -> dict:
    """The build options of an attention kernel for the layer's optional features (kernels/kv_layout.cl): a
    sliding window and soft-capping; the third, the score scale, is an argument (spec.score_scale)."""
    defines: dict = {}
    if spec.window is not None:
        defines["WINDOW"] = int(spec.window)
    if spec.softcap is not None:
        defines["SOFTCAP"] = f"{float(spec.softcap)!r}f"
    return defines


def _store_kv(rt, qkv, placement: tuple, spec, rows: int, options: dict) -> None:
    """Write the RoPE'd k and the v of ``rows`` new tokens of qkv into the cache (before attending to them)."""
    rt.launch(
        rt.kernel("attention", "store_kv", **options),
        (_round_up(spec.head_dim // 2, 32), spec.n_kv_heads, rows),
        None,
        qkv,
        *placement,
        spec.head_dim,
        spec.q_dim,
        spec.qkv_dim,
    )


def _attention(rt, qkv, cache, layer, slots, positions, rope, spec, out, keys=("slots", "positions")):
    """Rows r of qkv are new tokens of slot slots[r] at positions[r]: store their k/v, then attend."""
    rows, hd = len(positions), spec.head_dim
    options = {"CACHE_HALF": cache.spec.dtype == "float16"}
    placement = _placement(rt, cache, layer, slots, positions, rope, spec, keys)
    _store_kv(rt, qkv, placement, spec, rows, options)
    parts = decode_signature(positions)[1]  # partitions of the longest row
    partial = rt.scratch("attention_partial", (rows * spec.n_heads * parts * (hd + 2),))
    rt.launch(
        rt.kernel("attention", "attention", PART=ATT_PART, **options, **_feature_defines(spec)),
        (ATT_WG * spec.n_heads, rows, parts),
        (ATT_WG, 1, 1),
        qkv,
        *placement,
        hd,
        spec.n_heads,
        spec.qkv_dim,
        out,
        spec.score_scale,
        partial,
    )
    if parts > 1:
        rt.launch(
            rt.kernel("attention", "attention_merge"),
            (_round_up(hd, 32), spec.n_heads, rows),
            None,
            partial,
            parts,
            hd,
            spec.n_heads,
            out,
        )


def _partitions(last_position: int, part: int) -> int:
    """Attention partitions of ``part`` positions for rows up to ``last_position``, rounded up to 1, 2, 3, 4, 6,
    8, 12, 16, ... (powers of two and 1.5 times them): the extra ones are empty, and a step's recorded graph
    then serves a range of lengths instead of one per partition count, with at most a third more work-groups
    (plain powers of two doubled them: 16 instead of 9 at 520 positions cost ~8% of decode on the H200)."""
    needed = (last_position + part) // part
    if needed <= 2:
        return needed
    power = 1 << (needed - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= needed else power


def decode_signature(positions) -> tuple[int, int]:
    """What of a step's positions changes its launches: the number of attention partitions (of the fused
    decode kernel and of the three-launch path)."""
    last = int(np.max(positions))
    return _partitions(last, DECODE_PART), _partitions(last, ATT_PART)


def attention_decode(rt, qkv, cache, layer, slots, positions, rope, spec, out):
    hd = spec.head_dim
    plan = _decode_plan(rt, cache, positions, spec, DECODE_SCORE_BYTES) if hd % 4 == 0 and rt.fused_tails else None
    if plan is None:
        _attention(rt, qkv, cache, layer, slots, positions, rope, spec, out)  # the general three-launch path
        return
    splits, defines = plan
    rt.launch(
        rt.kernel("attention", "attention_decode_fused", **defines),
        (ATT_WG * spec.n_kv_heads, len(positions), splits),
        (ATT_WG, 1, 1),
        *_decode_arguments(rt, qkv, cache, layer, slots, positions, rope, spec, out, splits),
    )


def _decode_vectors(hd: int, half: bool) -> tuple[int, int]:
    """(cache elements per vector load, lanes per key while scoring) of the decode kernel (kernels/attention.cl
    CV and KL): 16-byte vectors where the head divides into them, and up to 8 lanes on a key's adjacent ones."""
    cv = 8 if half and hd % 8 == 0 else 4
    chunks = hd // cv
    return cv, next(kl for kl in (8, 4, 2, 1) if chunks % kl == 0)


def _decode_local_bytes(hd: int, group: int, max_split: int, half: bool) -> int:
    """attention_decode_fused's local arrays (DECODE_LOCALS): q, a tile's partial dots, the scores, the
    reductions, the P.V partial sums and a flag."""
    cv, kl = _decode_vectors(hd, half)
    passes = max(1, ATT_WG // group // (ATT_WG // kl))
    return 4 * (group * hd + group * passes * ATT_WG + group * max_split + group * ATT_WG + ATT_WG * cv) + 4


def _decode_plan(rt, cache, positions, spec, score_bytes: int) -> tuple[int, dict] | None:
    """(splits, kernel defines) of the fused decode kernel for these rows, or None where its local arrays do
    not fit (the three-launch path then). A function of the batch size and the graph signature's bucket of the
    longest row (decode_signature), so a recorded step stays valid for every step with that signature."""
    hd, group = spec.head_dim, spec.n_heads // spec.n_kv_heads
    half = cache.spec.dtype == "float16"
    max_split = max(16, score_bytes // 4 // group // 16 * 16)
    if _decode_local_bytes(hd, group, max_split, half) > _local_bytes(rt):
        return None
    bucket = decode_signature(positions)[0]  # the longest row has at most bucket * DECODE_PART positions
    fit = -(-bucket * DECODE_PART // max_split)  # splits no longer than max_split
    wanted = DECODE_GROUPS_PER_CU * rt.device.details.get("compute_units", 1)
    fill = -(-wanted // (len(positions) * spec.n_kv_heads))
    splits = max(fit, min(bucket, fill))
    return splits, {"HD": hd, "GROUP": group, "MAX_SPLIT": max_split, "CACHE_HALF": half, **_feature_defines(spec)}


def _decode_arguments(rt, qkv, cache, layer, slots, positions, rope, spec, out, splits: int) -> tuple:
    """attention_decode_fused's arguments (the leading ones of attention_mixed too)."""
    rows, hd = len(positions), spec.head_dim
    return (
        qkv,
        *_placement(rt, cache, layer, slots, positions, rope, spec),
        spec.n_heads,
        spec.qkv_dim,
        out,
        spec.score_scale,
        rt.scratch("attention_partial", (rows * spec.n_heads * splits * (hd + 2),)),
        rt.zeroed_ints("attention_counters", rows * spec.n_kv_heads),
    )


# attention_mixed's one launch pays while the decode rows' attention is short. Each of its work-groups reserves
# both parts' local memory (~31 KB at head_dim 128), so an SM holds fewer decode work-groups than the decode
# kernel alone gets: the launch it saves stops paying for that once there are many of them. H200, 7B, a mixed
# step's attention with a 16-row chunk, one launch vs two, by decode rows x partitions
# (docs/results/h200_attention_mixed_one_vs_two_launches.jsonl): 32 (16 rows at position 100) 1.06 vs 1.40 ms;
# 128 (16 rows at 400; 4 at 2000) 2.97 vs 3.13 and 3.83 vs 3.96; 256 (16 rows at 800) 5.47 vs 5.35; 512 (16 rows
# at 2000) 12.6 vs 11.8.
MIXED_ATTENTION_MAX_GROUPS = 128  # decode rows x attention partitions (per head) up to which it is one launch


def attention_mixed(rt, qkv, cache, layer, slots, positions, slot, start, rope, spec, out):
    """A mixed step's attention: decode rows 0..n-1 and a prompt chunk in rows n.. in one launch (kernel
    attention_mixed) where the chunk stores its own rows (up to PREFILL_STORES_ROWS_MAX) and the decode rows'
    attention is short (MIXED_ATTENTION_MAX_GROUPS), else the two ops."""
    n, hd = len(positions), spec.head_dim
    t = qkv.shape[0] - n
    plan = _decode_plan(rt, cache, positions, spec, MIXED_DECODE_SCORE_BYTES) if n and hd % 4 == 0 else None
    tile = None
    short = plan is not None and n * plan[0] <= MIXED_ATTENTION_MAX_GROUPS
    if short and rt.fused_tails and 0 < t <= PREFILL_STORES_ROWS_MAX:
        splits, defines = plan
        beside = _decode_local_bytes(hd, defines["GROUP"], defines["MAX_SPLIT"], defines["CACHE_HALF"])
        with contextlib.suppress(BackendError):  # the two parts' local arrays side by side must fit
            tile = _prefill_tile(rt, hd, beside)
    if tile is None:
        generic_attention_mixed(rt, qkv, cache, layer, slots, positions, slot, start, rope, spec, out)
        return
    decode_qkv, prompt_qkv = row_view(rt, qkv, 0, n), row_view(rt, qkv, n, t)
    decode_out, prompt_out = row_view(rt, out, 0, n), row_view(rt, out, n, t)
    blocks = -(-t // tile)
    prompt_slots, prompt_positions = prompt_indices(slot, start, t)
    rt.launch(
        rt.kernel("attention", "attention_mixed", QB=tile, KB=tile, **defines),
        (ATT_WG * spec.n_heads, blocks + n, splits),
        (ATT_WG, 1, 1),
        *_decode_arguments(rt, decode_qkv, cache, layer, slots, positions, rope, spec, decode_out, splits),
        prompt_qkv,
        rt.upload_ints(PROMPT_KEYS[0], prompt_slots),
        rt.upload_ints(PROMPT_KEYS[1], prompt_positions),
        t,
        prompt_out,
        blocks,
    )


def _prefill_tile(rt, hd: int, beside: int = 0) -> int:
    """Query rows and key positions per tile of the tiled prefill attention: 16 where its local arrays fit
    (q and K tiles padded a float per row, V, the probabilities) next to ``beside`` more bytes, else 8."""
    for tile in (16, 8):
        floats = 2 * tile * (hd + 1) + tile * hd + tile * (tile + 1) + tile
        if 4 * floats + beside <= _local_bytes(rt):
            return tile
    raise BackendError(f"the tiled prefill attention does not fit this device's local memory at head_dim {hd}")


# Up to this many rows, attention_prefill stores the rows' k and v itself, reading the rows' own keys from qkv
# (RoPE'd per tile): on the H200 (7B) a 16-row chunk's attention went from 0.40 + 0.18 ms (store_kv) to 0.45 ms
# per step, a 25-token prompt's from 0.53 + 0.18 to 0.59. At 512 rows every tile's keys come from qkv, which
# took 11.6 ms against 10.1 + 0.5: long prompts keep store_kv and read the cache.
PREFILL_STORES_ROWS_MAX = 32


# Beyond PREFILL_STORES_ROWS_MAX rows, where the runtime has matrix units and the cache is float16, the prompt's
# attention runs on them (kernels/attention_mma.cl): PREFILL_MMA_WARPS warps of 16 query rows per work-group,
# key tiles of PREFILL_MMA_KEYS positions in local memory. The output rows stay in registers, so head dims up to
# PREFILL_MMA_MAX_HEAD_DIM.
PREFILL_MMA_WARPS = 4
PREFILL_MMA_KEYS = 64
PREFILL_MMA_MAX_HEAD_DIM = 128
PREFILL_MMA = os.environ.get("PERFX_OPENCL_PREFILL_MMA", "1") != "0"  # 0: the tiled kernel (A/B runs)


def _prefill_on_matrix_units(rt, cache, hd: int) -> bool:
    if not (PREFILL_MMA and rt.use_mma) or cache.spec.dtype != "float16" or hd % 16 or hd > PREFILL_MMA_MAX_HEAD_DIM:
        return False
    keys, dims = PREFILL_MMA_KEYS * (hd // 2 + 4), hd * (PREFILL_MMA_KEYS // 2 + 4)  # words, padded rows
    emulation = 0 if rt.native_mma else PREFILL_MMA_WARPS * MMA_EMULATION_FLOATS
    return 4 * (keys + dims + emulation) <= _local_bytes(rt)


def attention_prefill(rt, qkv, cache, layer, slot, start, rope, spec, out):
    """The tiled kernel: each tile of K and V is read once per block of rows; up to PREFILL_STORES_ROWS_MAX rows
    it also stores their k and v, else store_kv first and, on matrix units with a float16 cache, the
    flash-attention kernel (a head_dim that is not a multiple of 4: store_kv, then the per-row kernel)."""
    t, hd = qkv.shape[0], spec.head_dim
    slots, positions = prompt_indices(slot, start, t)
    if hd % 4:
        _attention(rt, qkv, cache, layer, slots, positions, rope, spec, out, PROMPT_KEYS)
        return
    options = {"CACHE_HALF": cache.spec.dtype == "float16"}
    placement = _placement(rt, cache, layer, slots, positions, rope, spec, PROMPT_KEYS)
    stores_rows = t <= PREFILL_STORES_ROWS_MAX
    if not stores_rows:
        _store_kv(rt, qkv, placement, spec, t, options)
        if _prefill_on_matrix_units(rt, cache, hd):
            rt.launch(
                rt.kernel(
                    "attention_mma",
                    "attention_prefill_mma",
                    HD=hd,
                    QW=PREFILL_MMA_WARPS,
                    BK=PREFILL_MMA_KEYS,
                    **_feature_defines(spec),
                ),
                (32 * PREFILL_MMA_WARPS * spec.n_heads, -(-t // (16 * PREFILL_MMA_WARPS))),
                (32 * PREFILL_MMA_WARPS, 1),
                qkv,
                *placement,
                t,
                spec.n_heads,
                spec.qkv_dim,
                out,
                spec.score_scale,
            )
            return
    tile = _prefill_tile(rt, hd)
    rt.launch(
        rt.kernel("attention", "attention_prefill", HD=hd, QB=tile, KB=tile, **options, **_feature_defines(spec)),
        (ATT_WG * spec.n_heads, -(-t // tile)),
        (ATT_WG, 1),
        qkv,
        *placement,
        t,
        spec.n_heads,
        spec.qkv_dim,
        out,
        spec.score_scale,
        int(stores_rows),
    )


# Sliding windows, soft-capping and custom score scales are build options and an argument of every attention kernel.
for _op in (attention_decode, attention_prefill, attention_mixed):
    _op.perfx_features = ATTENTION_FEATURES
