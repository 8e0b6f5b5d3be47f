"""Cost per row of x of the CPU backend's quantized matmuls, by the number of rows (batched decode's question).

    python benchmarks/bench_cpu_rows.py                                  # SmolLM2's shapes, the default CPU ops
    PERFX_NUMBA_PARALLEL=never python benchmarks/bench_cpu_rows.py       # the numba kernels on one thread
    python benchmarks/bench_cpu_rows.py --rows 1,8 --shape int4:3072x576 --shape int8:49152x576

Each shape is a random weight (int4 with 32-column groups as in SmolLM2's Q4_1 file, int5 as GGUF Q5_0/Q5_1/Q5_K
load (float16 scale and bias per 32 columns), int6 as GGUF Q6_K loads, int8g16 as Q6_K's int8 form (float32 scale
per 16 columns), or int8 codes with a
float16 scale per 32 columns as in its Q8_0 LM head) multiplied through ``rt.ops.linear`` of the NumPy backend's
runtime, i.e. by whatever op implementation is installed (the numba plugin's where it is). Prints one JSON object
per shape and row count: microseconds per call (the best of --repeat batches, CPU time of this process, which
other jobs on a shared machine disturb less than wall time), per row, and per row relative to one row. A batch's
rows cost less than one row each where a kernel reads or decodes a weight once for several rows.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from perfx_core.plugins import get_registry
from perfx_core.split_weights import pack_int5, pack_int6
from perfx_core.weights import Int4Weight, Int5Weight, Int6Weight, Int8Weight

SMOLLM2_SHAPES = ("int4:1728x576", "int4:3072x576", "int4:576x1536", "int8:49152x576")


def random_weight(kind: str, m: int, k: int, rng: np.random.Generator):
    if kind == "int4":
        return Int4Weight(
            rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
            rng.uniform(-0.05, 0.05, (m, k // 32)).astype(np.float16),
            rng.normal(0.0, 0.1, (m, k // 32)).astype(np.float32),
            32,
        )
    if kind == "int8":
        return Int8Weight(
            rng.integers(-128, 128, (m, k), dtype=np.int8), rng.uniform(-0.02, 0.02, (m, k // 32)).astype(np.float16)
        )
    if kind == "int5":
        groups = (m, k // 32)
        return Int5Weight(
            *pack_int5(rng.integers(0, 32, (m, k), dtype=np.uint8)),
            rng.uniform(-0.02, 0.02, groups).astype(np.float16),
            rng.uniform(-0.3, 0.3, groups).astype(np.float16),
        )
    if kind == "int6":
        return Int6Weight(
            *pack_int6(rng.integers(0, 64, (m, k), dtype=np.uint8)),
            rng.integers(-128, 128, (m, k // 16), dtype=np.int8),
            rng.uniform(1e-4, 1e-3, (m, k // 256)).astype(np.float16),
        )
    if kind == "int8g16":  # GGUF Q6_K in int8 form: codes -32..31, a float32 scale per 16 columns
        return Int8Weight(
            rng.integers(-32, 32, (m, k), dtype=np.int8), rng.uniform(-0.02, 0.02, (m, k // 16)).astype(np.float32), 16
        )
    raise SystemExit(f"unknown weight kind {kind!r}: int4, int5, int6, int8 or int8g16")


def cpu_seconds_per_call(call, repeat: int, min_seconds: float = 0.2) -> float:
    call()  # first call: compiles or loads the kernels, builds the weight's layout
    best = float("inf")
    for _ in range(repeat):
        calls, start = 0, time.process_time()
        while calls < 3 or time.process_time() - start < min_seconds:
            call()
            calls += 1
        best = min(best, (time.process_time() - start) / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="rows of x per call, comma-separated")
    parser.add_argument(
        "--shape",
        action="append",
        help=f"KIND:MxK, repeatable (default: SmolLM2's, {', '.join(SMOLLM2_SHAPES)})",
    )
    parser.add_argument("--repeat", type=int, default=5, help="batches of calls per point; the best is kept")
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    rt = get_registry().open_runtime("numpy")
    rng = np.random.default_rng(0)
    for shape in args.shape or SMOLLM2_SHAPES:
        kind, dims = shape.split(":")
        m, k = (int(v) for v in dims.lower().split("x"))
        w = rt.prepare_weight(random_weight(kind, m, k, rng))
        one_row = None
        for n in rows:
            x = rng.standard_normal((n, k)).astype(np.float32)
            out = np.empty((n, m), dtype=np.float32)
            seconds = cpu_seconds_per_call(lambda x=x, w=w, out=out: rt.ops.linear(x, w, out), args.repeat)
            per_row = seconds / n
            one_row = per_row if n == 1 else one_row
            print(
                json.dumps(
                    {
                        "shape": shape,
                        "op": rt.ops.sources["linear"],
                        "rows": n,
                        "us_per_call": round(seconds * 1e6, 1),
                        "us_per_row": round(per_row * 1e6, 1),
                        "per_row_vs_one_row": round(per_row / one_row, 3) if one_row else None,
                    }
                ),
                flush=True,
            )
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
