"""Sweep the matrix-unit int4 kernel's shape (kernels/int4_mma.cl: MT row tiles, NT8 token tiles, KW k-warps)
over token counts at 12288x4096 int4 g128, next to the GEMV / tiled GEMM it replaces.

    PERFX_OPENCL_PROFILE=1 python scripts/sweep_opencl_mma.py [--ns 2,4,8,16,32,64,128,512] [--json out.jsonl]

Device time per call from OpenCL profiling events (weights cycled through cold copies, as bench_ops.py does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_ops import matmul_case  # noqa: E402

from perfx_core.plugins import get_registry  # noqa: E402


def shapes(n: int):
    if n <= 16:
        return [{"MT": mt, "NT8": 1 if n <= 8 else 2, "KW": kw} for mt, kw in itertools.product((1, 2, 4), (4, 8, 16))]
    return [{"MT": mt, "NT8": nt8, "KW": kw} for mt, nt8, kw in itertools.product((2, 4), (2, 4), (1, 2, 4, 8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="2,4,8,16,32,64,128,512")
    parser.add_argument("--m", type=int, default=12288)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--json", help="append one JSON line per measurement here")
    args = parser.parse_args()
    from perfx_opencl import ops

    rng = np.random.default_rng(0)
    out = open(args.json, "a") if args.json else None
    for n in (int(v) for v in args.ns.split(",")):
        rows = []
        os.environ["PERFX_OPENCL_MMA"] = "0"
        rt = get_registry().open_runtime("opencl")
        rows.append(dict(matmul_case(rt, args.m, args.k, n, rng), kernel="gemv/gemm"))
        rt.close()
        os.environ["PERFX_OPENCL_MMA"] = "1"
        rt = get_registry().open_runtime("opencl")
        for shape in shapes(n):
            os.environ["PERFX_OPENCL_MMA_SHAPE"] = ",".join(f"{k}={v}" for k, v in shape.items())
            ops.mma_overrides.cache_clear()
            ops.clear_plans(rt)
            rows.append(dict(matmul_case(rt, args.m, args.k, n, rng), kernel="mma", **shape))
        rt.close()
        os.environ.pop("PERFX_OPENCL_MMA_SHAPE")
        ops.mma_overrides.cache_clear()
        for row in sorted(rows, key=lambda r: r.get("device_us", r["us"])):
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
