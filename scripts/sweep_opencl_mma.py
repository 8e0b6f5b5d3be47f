"""Sweep the matrix-unit int4 kernel's shape (kernels/int4_mma.cl: MT row tiles, NT8 token tiles, KW k-warps,
UC chunks loaded ahead) over token counts at 12288x4096 int4 (g128 unless --group), next to the GEMV / tiled GEMM
it replaces.

    PERFX_OPENCL_PROFILE=1 python scripts/sweep_opencl_mma.py [--ns 2,4,8,16,32,64,128,512] [--uc 1,2,4]
        [--default-tiles] [--m 12288 --k 4096] [--json out.jsonl]

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


def shapes(n: int, ucs: list[int], default_tiles: dict | None):
    """The shapes to time: every tile shape (or only the default rule's ``default_tiles``) x KW x UC."""
    if default_tiles:
        tiles = [(default_tiles["MT"], default_tiles["NT8"])]
    elif n <= 16:
        tiles = [(mt, 1 if n <= 8 else 2) for mt in (1, 2, 4)]
    else:
        tiles = list(itertools.product((2, 4), (2, 3, 4)))
    kws = (4, 8, 16) if n <= 16 else (1, 2, 4, 8)
    return [{"MT": mt, "NT8": nt8, "KW": kw, "UC": uc} for (mt, nt8), kw, uc in itertools.product(tiles, kws, ucs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="2,4,8,16,32,64,128,512")
    parser.add_argument("--m", type=int, default=12288)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--group", type=int, default=128, help="quantization group size (GGUF Q4_0: 32)")
    parser.add_argument("--uc", default="1", help="chunks loaded ahead per warp to try, e.g. 1,2,4")
    parser.add_argument("--default-tiles", action="store_true", help="only the default rule's MT and NT8")
    parser.add_argument("--json", help="append one JSON line per measurement here")
    args = parser.parse_args()
    from perfx_opencl import ops

    rng = np.random.default_rng(0)
    out = open(args.json, "a") if args.json else None
    for n in (int(v) for v in args.ns.split(",")):
        rows = []
        os.environ["PERFX_OPENCL_MMA"] = "0"
        rt = get_registry().open_runtime("opencl")
        rows.append(dict(matmul_case(rt, args.m, args.k, n, rng, args.group), kernel="gemv/gemm", group=args.group))
        rt.close()
        os.environ["PERFX_OPENCL_MMA"] = "1"
        rt = get_registry().open_runtime("opencl")
        tiles = ops._mma_config(rt, n, args.m, args.k, args.group) if args.default_tiles else None
        todo = shapes(n, [int(v) for v in args.uc.split(",")], tiles)
        for shape in todo:
            os.environ["PERFX_OPENCL_MMA_SHAPE"] = ",".join(f"{k}={v}" for k, v in shape.items())
            ops.mma_overrides.cache_clear()
            ops.clear_plans(rt)
            built = ops._mma_config(rt, n, args.m, args.k, args.group)  # after the caps (KW, UC), not as asked
            rows.append(
                dict(matmul_case(rt, args.m, args.k, n, rng, args.group), kernel="mma", group=args.group, **built)
            )
        rt.close()
        os.environ.pop("PERFX_OPENCL_MMA_SHAPE")
        ops.mma_overrides.cache_clear()
        for row in sorted(rows, key=lambda r: r.get("device_us", r["us"])):
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
