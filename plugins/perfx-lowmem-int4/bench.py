"""Measure perfx-lowmem-int4 against the NumPy backend's own int4_gemv: time per call and bytes held.

    python plugins/perfx-lowmem-int4/bench.py

Each side runs in a fresh registry (the plugin enabled, then disabled with PERFX_DISABLE_PLUGINS).
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from perfx_core.plugins import get_registry
from perfx_core.weights import Int4Weight

SHAPES = ((1536, 576), (4096, 4096))  # (m, k): a SmolLM2-135M MLP matrix and a Llama-7B attention matrix


def random_int4(rng: np.random.Generator, m: int, k: int, group: int = 64) -> Int4Weight:
    return Int4Weight(
        rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
        rng.uniform(-0.05, 0.05, (m, k // group)).astype(np.float16),
        rng.normal(0.0, 0.1, (m, k // group)).astype(np.float32),
        group,
    )


def measure(m: int, k: int, n: int, disabled: bool, repeats: int = 50) -> tuple[float, int, str]:
    """(median seconds per call, bytes the runtime gained across the first call, op source)."""
    if disabled:
        os.environ["PERFX_DISABLE_PLUGINS"] = "lowmem-int4"
    else:
        os.environ.pop("PERFX_DISABLE_PLUGINS", None)
    rt = get_registry(refresh=True).open_runtime("numpy")
    rng = np.random.default_rng(0)
    w = rt.prepare_weight(random_int4(rng, m, k))
    x = rt.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    out = rt.empty((n, m))
    op = rt.ops.int4_gemv if n == 1 else rt.ops.int4_gemm
    before = rt.allocated_bytes
    op(x, w, out)
    gained = rt.allocated_bytes - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op(x, w, out)
        times.append(time.perf_counter() - start)
    source = rt.ops.sources["int4_gemv" if n == 1 else "int4_gemm"]
    return float(np.median(times)), gained, source


def main() -> None:
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}")
    for m, k in SHAPES:
        for n in (1, 16):
            packed = m * k // 2 + m * (k // 64) * 6
            (t_low, b_low, s_low), (t_np, b_np, s_np) = measure(m, k, n, False), measure(m, k, n, True)
            print(
                f"m={m} k={k} n={n}: lowmem {t_low * 1e3:.2f} ms (+{b_low / 2**20:.2f} MiB), "
                f"numpy {t_np * 1e3:.2f} ms (+{b_np / 2**20:.2f} MiB); packed weight {packed / 2**20:.2f} MiB "
                f"[{s_low} vs {s_np}]"
            )


if __name__ == "__main__":
    main()
