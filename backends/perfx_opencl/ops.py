"""The OpenCL backends' ops (contract in perfx_core/ops.py and docs/ops.md): kernel launches.

Shared by ``opencl`` and ``opencl-adreno``; the runtime's variant picks the kernel build options.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

from perfx_core.errors import InvalidArgumentError
from perfx_core.ops import PRIMITIVE_OPS, generic_gate_up_silu

OPS = PRIMITIVE_OPS + ("gate_up_silu",)  # gate_up_silu: fused for int4 weights and small n

SMALL_N = 16  # up to this many tokens an int4 matmul uses the GEMV kernel, which reads W once for all of them
DENSE_SMALL_N = 4  # the dense GEMV re-reads W per token, so it only pays for very small batches
GEMV_TUNING = {"RW": 32, "KS": 16}  # rows per work-group x threads per row (measured: docs/opencl.md)
ADRENO_GEMV_TUNING = {"RW": 64, "KS": 4}  # Adreno waves are 64+ wide
TILE = 32  # output tile of the dense GEMM kernel (kernels/dense.cl)
GEMM_TOKENS = 64  # tokens per int4 GEMM work-group (kernels/int4.cl), 4 per thread
NORM_WG = 512  # threads per row of the norm kernels (kernels/elementwise.cl): one work-group per row
ATT_WG = 128  # kernels/attention.cl
ATT_PART = 128  # key positions per attention work-group: long contexts split over more work-groups
MAX_HEAD_DIM = 256


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


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
        kernel = rt.kernel("int4", "embedding_int4")
        rt.launch(
            kernel,
            (_round_up(d, 64), n),
            None,
            table.packed.buffer,
            table.scale.buffer,
            table.bias.buffer,
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
def gemv_tuning(variant: str) -> dict[str, int]:
    """Work-group shape of the int4 GEMV (RW rows x KS k-splits); PERFX_OPENCL_GEMV="RW=32,KS=8" overrides.

    Read once per variant (this sits on the per-launch path); a tuner that changes the variable calls
    ``gemv_tuning.cache_clear()`` and ``clear_plans(rt)``.
    """
    tuning = dict(ADRENO_GEMV_TUNING if variant == "adreno" else GEMV_TUNING)
    for item in filter(None, os.environ.get("PERFX_OPENCL_GEMV", "").split(",")):
        key, _, value = item.partition("=")
        tuning[key.strip()] = int(value)
    return tuning


def clear_plans(rt) -> None:
    """Forget the launch plans of ``rt`` (after changing the tuning)."""
    rt.__dict__.pop("_gemv_plans", None)


def _gemv_plan(rt, name: str, nt: int, rows: int, image: bool) -> tuple[Any, tuple[int, int], tuple[int, int]]:
    """(kernel, global size, local size) of a GEMV launch, worked out once per shape and kept on the runtime."""
    plans = rt.__dict__.setdefault("_gemv_plans", {})
    plan = plans.get((name, nt, rows, image))
    if plan is None:
        shape = gemv_tuning(rt.variant)
        kernel = rt.kernel("int4", name, NT=nt, X_IMAGE=image, **shape)
        plan = plans[(name, nt, rows, image)] = (
            kernel,
            (_round_up(rows, shape["RW"]), shape["KS"]),
            (shape["RW"], shape["KS"]),
        )
    return plan


def _int4_gemv(rt, x, w, out, n, name="int4_gemv", rows=None):
    """GEMV over ``rows`` output rows (default: all of W's) for n <= SMALL_N tokens, W read once."""
    k = w.shape[1]
    rows = w.shape[0] if rows is None else rows
    nt = 1 << max(0, (n - 1).bit_length())  # tokens per pass: n rounded up to a power of two
    image = rt.image_of(x)
    kernel, global_size, local_size = _gemv_plan(rt, name, nt, rows, image is not None)
    x_arg = (image, x.offset) if image is not None else (x,)
    rt.launch(
        kernel,
        global_size,
        local_size,
        w.packed.buffer,
        w.scale.buffer,
        w.bias.buffer,
        *x_arg,
        out,
        n,
        rows,
        k,
        w.group_size.bit_length() - 1,
    )


def int4_gemv(rt, x, w, out):
    _int4_gemv(rt, x, w, out, 1)


def int4_gemm(rt, x, w, out):
    n, m = out.shape
    k = w.shape[1]
    if n <= SMALL_N:
        _int4_gemv(rt, x, w, out, n)
        return
    # 8 rows per thread reuse each activation more (H200: +8% at n=512) but make too few work-groups at small n.
    default_rpt = 8 if n >= 256 else 4
    rows_per_thread = int(os.environ.get("PERFX_OPENCL_GEMM_RPT", default_rpt))
    kernel = rt.kernel("int4", "int4_gemm", RPT=rows_per_thread)
    rt.launch(
        kernel,
        (_round_up(m, 16 * rows_per_thread) // rows_per_thread, _round_up(n, GEMM_TOKENS) // 4),
        (16, 16),
        w.packed.buffer,
        w.scale.buffer,
        w.bias.buffer,
        x,
        out,
        n,
        m,
        k,
        w.group_size.bit_length() - 1,
    )


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


def gate_up_silu(rt, x, w_gate_up, out):
    n, f = out.shape
    if w_gate_up.kind == "int4" and n <= SMALL_N:
        _int4_gemv(rt, x, w_gate_up, out, n, name="int4_gemv_silu", rows=f)
    else:
        generic_gate_up_silu(rt, x, w_gate_up, out)


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


def silu_mul(rt, gate_up, out):
    n, f = out.shape
    rt.launch(rt.kernel("elementwise", "silu_mul"), (_round_up(f, 64), n), None, gate_up, out, f)


def _attention(rt, qkv, cache, layer, slots, positions, rope, spec, out):
    """Rows r of qkv are new tokens of slot slots[r] at positions[r]: store their k/v, then attend."""
    rows = len(positions)
    hd = spec.head_dim
    if hd % 2 or hd > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"the OpenCL attention kernels take an even head_dim up to {MAX_HEAD_DIM}; got {hd}")
    c = cache.spec
    options = {"CACHE_HALF": c.dtype == "float16"}
    # Where the new rows go and how to read the cache: the same leading arguments for both kernels.
    placement = (
        rt.upload_ints("slots", slots),
        rt.upload_ints("positions", positions),
        rope.cos,
        rope.sin,
        cache.k.buffer,
        cache.v.buffer,
        layer,
        c.n_slots,
        c.n_kv_heads,
        c.max_seq_len,
        hd,
    )
    rt.launch(
        rt.kernel("attention", "store_kv", **options),
        (_round_up(hd // 2, 32), spec.n_kv_heads, rows),
        None,
        qkv,
        *placement,
        spec.q_dim,
        spec.qkv_dim,
    )
    parts = (int(np.max(positions)) + ATT_PART) // ATT_PART  # partitions of the longest row
    partial = rt.scratch("attention_partial", (rows * spec.n_heads * parts * (hd + 2),))
    rt.launch(
        rt.kernel("attention", "attention", PART=ATT_PART, **options),
        (ATT_WG * spec.n_heads, rows, parts),
        (ATT_WG, 1, 1),
        qkv,
        *placement,
        spec.n_heads,
        spec.qkv_dim,
        out,
        1.0 / math.sqrt(hd),
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


def attention_decode(rt, qkv, cache, layer, slots, positions, rope, spec, out):
    _attention(rt, qkv, cache, layer, slots, positions, rope, spec, out)


def attention_prefill(rt, qkv, cache, layer, slot, start, rope, spec, out):
    t = qkv.shape[0]
    _attention(
        rt,
        qkv,
        cache,
        layer,
        np.full(t, slot, dtype=np.int32),
        np.arange(start, start + t, dtype=np.int32),
        rope,
        spec,
        out,
    )
