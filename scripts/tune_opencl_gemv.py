"""Sweep the OpenCL int4 GEMV's work-group shape (RW rows x KS threads per row) on one device.

    python scripts/tune_opencl_gemv.py [--device 0]

Prints achieved GB/s per shape and configuration (device time with PERFX_OPENCL_PROFILE=1);
the best goes into perfx_opencl.ops.GEMV_TUNING.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import copy_bandwidth, matmul_case  # noqa: E402
from perfx_opencl.ops import clear_plans, gemv_tuning  # noqa: E402

from perfx_core.plugins import get_registry  # noqa: E402

SHAPES = ((12288, 4096, 1), (4096, 11008, 1), (22016, 4096, 1), (12288, 4096, 8))
CONFIGS = ("RW=32,KS=8", "RW=32,KS=16", "RW=32,KS=32", "RW=64,KS=8", "RW=64,KS=16", "RW=128,KS=4")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    args = parser.parse_args()
    rt = get_registry().open_runtime("opencl", args.device)
    copy_gbs = copy_bandwidth(rt)
    print(json.dumps({"device": rt.device.name, "copy_GB/s": round(copy_gbs, 1)}))
    rng = np.random.default_rng(0)
    for config in CONFIGS:
        os.environ["PERFX_OPENCL_GEMV"] = config
        gemv_tuning.cache_clear()  # the ops read the variable once; make them read it again
        clear_plans(rt)
        for m, k, n in SHAPES:
            row = matmul_case(rt, m, k, n, rng)
            row.update(config=config, of_copy_bw=round(row["GB/s"] / copy_gbs, 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
