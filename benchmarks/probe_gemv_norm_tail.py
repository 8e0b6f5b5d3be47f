"""What the fused add + RMSNorm tail costs a decode GEMV (docs/results/h200_gemv_norm_tail_cost.jsonl).

    python benchmarks/probe_gemv_norm_tail.py   # an OpenCL device

For each 7B matmul shape (weights as GGUF Q4_0 blocks, cycled through cold copies): the GEMV alone, the GEMV
with its fused tail (linear_add_rmsnorm), the GEMV then a separate add_rmsnorm launch, and add_rmsnorm alone.
Device microseconds per call (profiling events), and wall microseconds per call back to back.
"""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
from perfx_opencl import ops
from perfx_opencl.tuner import device_seconds

from perfx_core.plugins import get_registry
from perfx_core.synthetic import cold_copies, random_q4_0_weight

SHAPES = ((4096, 4096), (4096, 11008), (12288, 4096))


def cases(rt, m: int, k: int, rng: np.random.Generator) -> dict:
    copies = cold_copies(rt, random_q4_0_weight(m, k, rng))
    turn = itertools.count()
    x = rt.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    out, delta = rt.empty((1, m)), rt.empty((1, m))
    residual = rt.from_numpy(rng.standard_normal((1, m), dtype=np.float32))
    norm = rt.from_numpy(np.ones(m, np.float32))

    def weight():
        return copies[next(turn) % len(copies)]

    def gemv_then_add_rmsnorm():
        ops.int4_gemm(rt, x, weight(), delta)
        ops.add_rmsnorm(rt, delta, residual, norm, 1e-5, out)

    return {
        "gemv": lambda: ops.int4_gemm(rt, x, weight(), out),
        "gemv_fused_tail": lambda: ops.linear_add_rmsnorm(rt, x, weight(), residual, norm, 1e-5, out),
        "gemv_then_add_rmsnorm": gemv_then_add_rmsnorm,
        "add_rmsnorm_alone": lambda: ops.add_rmsnorm(rt, delta, residual, norm, 1e-5, out),
    }


def wall_seconds(rt, fn, calls: int = 200) -> float:
    fn()
    rt.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    rt.synchronize()
    return (time.perf_counter() - start) / calls


def main() -> None:
    rt = get_registry().open_runtime("opencl")
    rng = np.random.default_rng(0)
    for m, k in SHAPES:
        for name, fn in cases(rt, m, k, rng).items():
            with rt.profiling():
                device = device_seconds(rt, fn, calls=20)
            row = {"m": m, "k": k, "case": name, "device_us": round(device * 1e6, 2)}
            row["wall_us_back_to_back"] = round(wall_seconds(rt, fn) * 1e6, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
