"""The search behind `perfx tune`: time every candidate GEMV shape per matmul shape and keep the fastest.

It runs the ops themselves with each candidate forced (ops.forced_gemv_tuning), so what is timed is what a model
runs; the results go to the device's tuning cache (tuning.py), which the ops read from then on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from perfx_core.errors import BackendError, InvalidArgumentError
from perfx_core.synthetic import cold_copies, random_int4, random_q4_0_weight

from . import ops, tuning


def tune(
    rt,
    config,
    quick: bool = False,
    progress: Callable[[dict[str, Any]], None] | None = None,
    group_size: int = 128,
    symmetric: bool = False,
) -> dict[str, Any]:
    """Tune the GEMV for ``config``'s matmul shapes on ``rt``, for weights of ``group_size`` (``symmetric``:
    GGUF Q4_0, no bias array), and save the result; returns the best shapes and the cache file. The caller
    forgets what it built with the old shapes (OpenCLRuntime.tune)."""
    # Token counts that reach the GEMV: with the matrix-unit kernel only single tokens do.
    ns = [n for n in tuning.SMALL_NS if not ops.on_matrix_units(rt, n)]
    best = tune_gemv(rt, model_shapes(config), ns, quick, progress, group_size, symmetric)
    path = tuning.save(rt, best)
    ops.clear_plans(rt)  # later launches on this runtime use the new shapes
    return {"device": rt.device.name, "cache": str(path), "best": best}


def candidates(nt: int, quick: bool = False, quantized: bool = False) -> list[dict[str, int]]:
    """Work-group shapes worth timing for NT tokens per pass (with several tokens, at most 2 columns per thread:
    each needs NT accumulators and its 32 dequantized weights in registers); with ``quantized`` (the device
    has integer dot products) also the quantized-activation kernel (QX=1). For one token, also fewer row lanes
    and four chunks in flight."""
    if quick:
        shapes = [(32, 8, 1, 1, 0, 0), (32, 4, 2, 2, 1, 0)] + ([(32, 16, 1, 2, 0, 1)] if quantized else [])
    elif nt == 1:
        grid = list(itertools.product((8, 16, 32), (1, 2, 4), (1, 2)))
        shapes = [(32, ks, cr, uc, xs, 0) for ks, cr, uc in grid for xs in (0, 1)]
        if quantized:  # XS does not apply: the quantizing pass computes the chunk sums
            shapes += [(32, ks, cr, uc, 0, 1) for ks, cr, uc in grid]
        # A decode GEMV's work-groups run as one wave: fewer rows per group (RW x CR) spread a matrix over more
        # compute units. 8 and 16 row lanes won 3 of the 5 Llama-2-7B shapes on an H100 (4% faster decode,
        # docs/results/h100_tune_gemv_7b_row_lanes.txt); tried in the device's preferred kernel only.
        wide = itertools.product((8, 16, 32), (128, 256, 512), (1, 2, 4), (1, 2, 4))
        shapes += [(rw, threads // rw, cr, uc, 0, int(quantized)) for rw, threads, cr, uc in wide]
        shapes = list(dict.fromkeys(shapes))
    else:
        # Fewer row lanes put several k-splits in one warp: fewer threads share (re-load) each activation.
        grid = itertools.product((8, 16, 32), (4, 8, 16), (1, 2), (1, 2))
        shapes = [(rw, ks, cr, uc, 0, 0) for rw, ks, cr, uc in grid]
        if quantized:
            grid = itertools.product((16, 32), (4, 8, 16), (1, 2), (1, 2))
            shapes += [(rw, ks, cr, uc, 0, 1) for rw, ks, cr, uc in grid]
    return [dict(zip(("RW", "KS", "CR", "UC", "XS", "QX"), shape, strict=True)) for shape in shapes]


def device_seconds(rt, fn: Callable[[], None], calls: int = 10, rounds: int = 5) -> float:
    """Least device time per call of ``fn`` (its kernels' profiled time) over ``rounds`` batches of calls."""
    fn()
    rt.kernel_seconds()
    best = float("inf")
    for _ in range(rounds):
        for _ in range(calls):
            fn()
        best = min(best, sum(rt.kernel_seconds().values()) / calls)
    return best


def tune_gemv(
    rt,
    shapes: Iterable[tuple[bool, int, int]],
    ns: Iterable[int] = tuning.SMALL_NS,
    quick: bool = False,
    progress: Callable[[dict[str, Any]], None] | None = None,
    group_size: int = 128,
    symmetric: bool = False,
) -> dict[str, dict[str, int]]:
    """Time every candidate shape for each (silu, output columns, k) and token count; returns the best per key.

    Device time from profiling events, weights cycled so none is read from a warm cache. Runs through the
    backend's own launch path (ops.gate_up_silu / int4_gemm) with the candidate forced, so
    what is measured is what a model will run.
    """
    if symmetric and group_size != 32:
        raise InvalidArgumentError("symmetric int4 weights (GGUF Q4_0) have 32-column groups")
    rng = np.random.default_rng(0)
    best: dict[str, dict[str, int]] = {}
    for silu, cols, k in shapes:
        if k % 32 or cols <= 0:
            raise InvalidArgumentError(f"cannot tune a {cols}x{k} int4 matmul (k must be a multiple of 32)")
        group = group_size if k % group_size == 0 else 32
        rows = 2 * cols if silu else cols
        weight = random_q4_0_weight(rows, k, rng) if symmetric else random_int4(rows, k, group, rng)
        form = tuning.weight_form(group, symmetric)
        # Copies cycled through, so each call reads its weight from memory as in a model, not from a warm L2.
        copies = cold_copies(rt, weight)
        turn = itertools.count()
        for n in ns:
            x = rt.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
            out = rt.empty((n, cols))
            op = ops.gate_up_silu if silu else ops.int4_gemm

            def call(op=op, x=x, out=out, copies=copies, turn=turn) -> None:
                op(rt, x, copies[next(turn) % len(copies)], out)

            key = tuning.shape_key(silu, cols, k, 1 << max(0, (n - 1).bit_length()), form)  # per NT, as built
            timings = []
            for config in candidates(n, quick, rt.native_int_dot):
                try:
                    with ops.forced_gemv_tuning(rt, config), rt.profiling():
                        seconds = device_seconds(rt, call)
                except BackendError as exc:  # e.g. out of resources for this shape on this device: skip it
                    if progress:
                        progress({"shape": key, **config, "error": str(exc)})
                    continue
                timings.append((seconds, config))
                if progress:
                    progress({"shape": key, **config, "us": round(seconds * 1e6, 2)})
            if not timings:
                raise BackendError(f"no GEMV shape could run {key} on {rt.device.name}")
            best[key] = min(timings, key=lambda item: item[0])[1]
    return best


def model_shapes(config) -> list[tuple[bool, int, int]]:
    """(silu, output columns, k) of the int4 matmuls of a Llama model, fused the way perfx runs them."""
    d, f = config.dim, config.ffn_dim
    q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return [
        (False, q_dim + 2 * kv_dim, d),
        (False, d, q_dim),
        (True, f, d),
        (False, d, f),
        (False, config.vocab_size, d),
    ]
