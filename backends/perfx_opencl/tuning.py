"""Per-device tuning of the int4 GEMV (`perfx tune`): search work-group shapes per matmul shape, cache the best.

The cache is one JSON file per (device, driver, backend variant) under the user cache directory
(perfx_core.settings.cache_dir()/opencl-tuning/). Entries carry a hash of kernels/int4.cl and ops.py, so
editing the kernel or its launch geometry makes old results stale instead of wrong. Untuned shapes use
ops.GEMV_TUNING, which is good untuned.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from perfx_core.errors import BackendError, InvalidArgumentError
from perfx_core.settings import cache_dir
from perfx_core.synthetic import cold_copies, random_int4

from .runtime import KERNEL_DIR, KERNEL_PRELUDE

FORMAT = 2  # 2: shapes carry QX
SMALL_NS = (1, 2, 4, 8, 16)  # the GEMV kernel's token counts per pass (NT)


def candidates(nt: int, quick: bool = False, quantized: bool = False) -> list[dict[str, int]]:
    """Work-group shapes worth timing for NT tokens per pass (with several tokens, at most 2 columns per thread:
    each needs NT accumulators and its 32 dequantized weights in registers); with ``quantized`` (the device
    has integer dot products) also the quantized-activation kernel (QX=1)."""
    if quick:
        shapes = [(32, 8, 1, 1, 0, 0), (32, 4, 2, 2, 1, 0)] + ([(32, 16, 1, 2, 0, 1)] if quantized else [])
    elif nt == 1:
        grid = list(itertools.product((8, 16, 32), (1, 2, 4), (1, 2)))
        shapes = [(32, ks, cr, uc, xs, 0) for ks, cr, uc in grid for xs in (0, 1)]
        if quantized:  # XS does not apply: the quantizing pass computes the chunk sums
            shapes += [(32, ks, cr, uc, 0, 1) for ks, cr, uc in grid]
    else:
        # Fewer row lanes put several k-splits in one warp: fewer threads share (re-load) each activation.
        grid = itertools.product((8, 16, 32), (4, 8, 16), (1, 2), (1, 2))
        shapes = [(rw, ks, cr, uc, 0, 0) for rw, ks, cr, uc in grid]
        if quantized:
            grid = itertools.product((16, 32), (4, 8, 16), (1, 2), (1, 2))
            shapes += [(rw, ks, cr, uc, 0, 1) for rw, ks, cr, uc in grid]
    return [dict(zip(("RW", "KS", "CR", "UC", "XS", "QX"), shape, strict=True)) for shape in shapes]


def shape_key(silu: bool, rows: int, k: int, nt: int) -> str:
    return f"{'silu' if silu else 'gemv'}:{rows}x{k}:nt{nt}"


def kernel_hash() -> str:
    """Of the GEMV kernel (with the shared pieces prepended to it) and of ops.py, which turns a tuned shape into
    launch sizes: changing any makes saved shapes stale."""
    digest = hashlib.sha256()
    kernels = [KERNEL_DIR / name for name in (*KERNEL_PRELUDE, "int4.cl")]
    for path in (*kernels, Path(__file__).parent / "ops.py"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:80]


def cache_path(rt) -> Path:
    details = rt.device.details
    name = f"{_slug(rt.device.name)}-{_slug(details.get('driver', ''))}-{rt.variant}.json"
    return cache_dir() / "opencl-tuning" / name


def load(rt) -> dict[str, dict[str, int]]:
    """The tuned GEMV shapes of ``rt``'s device, or {} when none were saved, they are stale or unreadable."""
    try:
        data = json.loads(cache_path(rt).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kernel_hash") != kernel_hash():
        return {}
    entries = data.get("gemv")
    if not isinstance(entries, dict):
        return {}
    return {key: config for key, config in entries.items() if _valid(config)}


def _valid(config: Any) -> bool:
    """A shape the kernels can run (a hand-edited or corrupt file must not hang or crash a launch)."""
    if not isinstance(config, dict) or set(config) != {"RW", "KS", "CR", "UC", "XS", "QX"}:
        return False
    if not all(type(v) is int for v in config.values()):
        return False
    return (
        1 <= config["RW"] <= 1024
        and 1 <= config["KS"] <= 1024
        and 1 <= config["CR"] <= 8
        and 1 <= config["UC"] <= 8
        and config["XS"] in (0, 1)
        and config["QX"] in (0, 1)
    )


def save(rt, entries: dict[str, dict[str, int]]) -> Path:
    """Merge ``entries`` into the device's cache file, written atomically (temporary file + rename)."""
    path = cache_path(rt)
    merged = {**load(rt), **entries}
    data = {
        "format": FORMAT,
        "device": rt.device.name,
        "driver": rt.device.details.get("driver", ""),
        "kernel_hash": kernel_hash(),
        "gemv": merged,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
    ns: Iterable[int] = SMALL_NS,
    quick: bool = False,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Time every candidate shape for each (silu, output columns, k) and token count; returns the best per key.

    Device time from profiling events, weights cycled so none is read from a warm cache. Runs through the
    backend's own launch path (ops.gate_up_silu / int4_gemm) with the candidate forced, so
    what is measured is what a model will run.
    """
    from . import ops

    rng = np.random.default_rng(0)
    best: dict[str, dict[str, int]] = {}
    for silu, cols, k in shapes:
        if k % 32 or cols <= 0:
            raise InvalidArgumentError(f"cannot tune a {cols}x{k} int4 matmul (k must be a multiple of 32)")
        # Copies cycled through, so each call reads its weight from memory as in a model, not from a warm L2.
        copies = cold_copies(rt, random_int4(2 * cols if silu else cols, k, 128 if k % 128 == 0 else 32, rng))
        turn = itertools.count()
        for n in ns:
            x = rt.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
            out = rt.empty((n, cols))
            op = ops.gate_up_silu if silu else ops.int4_gemm

            def call(op=op, x=x, out=out, copies=copies, turn=turn) -> None:
                op(rt, x, copies[next(turn) % len(copies)], out)

            key = shape_key(silu, cols, k, 1 << max(0, (n - 1).bit_length()))  # per NT, as the kernels are built
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
