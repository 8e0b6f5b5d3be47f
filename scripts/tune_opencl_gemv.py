"""Tune the OpenCL int4 GEMV for the Llama-2-7B shapes on one device, print every timing, save the best.

    python scripts/tune_opencl_gemv.py [--device 0] [--ns 1,2,4,8,16] [--ptx out.ptx]

The same search as `perfx tune` (perfx_opencl.tuning), with every candidate printed as JSON (achieved GB/s of
weight bytes and the fraction of the copy bandwidth), for docs/opencl.md. The best shapes go into the
device's tuning cache, which later runs on that device use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import copy_bandwidth  # noqa: E402
from perfx_opencl import tuning  # noqa: E402

from perfx_core.plugins import get_registry  # noqa: E402
from perfx_core.synthetic import LLAMA2_7B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    parser.add_argument("--ns", default="1,2,4,8,16", help="token counts to tune")
    parser.add_argument("--ptx", help="write the device binary of the n=1 GEMV (PTX on NVIDIA) here")
    args = parser.parse_args()
    rt = get_registry().open_runtime("opencl", args.device)
    copy_gbs = copy_bandwidth(rt)
    print(json.dumps({"device": rt.device.name, "copy_GB/s": round(copy_gbs, 1)}), flush=True)
    shapes = tuning.model_shapes(LLAMA2_7B)
    weight_bytes = {
        tuning.shape_key(s, c, k, 0).rsplit(":", 1)[0]: (2 * c if s else c) * k * (0.5 + 6 / 128) for s, c, k in shapes
    }

    def report(row: dict) -> None:
        moved = weight_bytes[row["shape"].rsplit(":", 1)[0]]
        gbs = moved / (row["us"] * 1e-6) / 1e9
        print(json.dumps({**row, "GB/s": round(gbs, 1), "of_copy_bw": round(gbs / copy_gbs, 3)}), flush=True)

    best = tuning.tune_gemv(rt, shapes, [int(n) for n in args.ns.split(",")], progress=report)
    print(json.dumps({"best": best, "saved": str(tuning.save(rt, best))}), flush=True)
    if args.ptx:
        kernel = rt.kernel("int4", "int4_gemv", NT=1, ADD_NORM=True, RW=32, KS=16, CR=2, UC=1)
        binary = kernel.program.get_info(rt.cl.program_info.BINARIES)[0]
        Path(args.ptx).write_bytes(binary)


if __name__ == "__main__":
    main()
