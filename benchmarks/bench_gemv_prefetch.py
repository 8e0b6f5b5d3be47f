#!/usr/bin/env python
"""Device time of the single-token int4 GEMVs of Llama-2-7B with and without PERFX_OPENCL_GEMV_PREFETCH
(the quantized-activation kernel issuing its first weight loads before it quantizes x), alternating.

    python benchmarks/bench_gemv_prefetch.py [--device D] [--group 32 --symmetric] [--rounds 7] [--json F]

Each shape runs in the shape the model would use on this device (its `perfx tune` result or the shipped one;
PERFX_CACHE_DIR picks another tuning cache), on weight copies cycled beyond the last-level cache. Prints one
JSON line per shape: the least device time per call of each arm over the rounds and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="OpenCL device index or name (default: the backend's best)")
    parser.add_argument("--group", type=int, default=32, choices=(32, 128), help="weight group size (default 32)")
    parser.add_argument(
        "--symmetric",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GGUF Q4_0 weights (default; needs --group 32)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per shape (default 7)")
    parser.add_argument("--json", help="also append the lines to this file")
    args = parser.parse_args()

    from perfx_opencl import ops, tuner, tuning

    from perfx_core.plugins import get_registry
    from perfx_core.synthetic import LLAMA2_7B, cold_copies, random_int4, random_q4_0_weight

    rt = get_registry().open_runtime("opencl", args.device)
    rng = np.random.default_rng(0)
    form = tuning.weight_form(args.group, args.symmetric)
    out = open(args.json, "a", encoding="utf-8") if args.json else None
    try:
        if not rt.native_int_dot:
            print(f"{rt.device.name} has no integer dot products: the GEMV never quantizes x", file=sys.stderr)
            return 1
        for silu, cols, k in tuner.model_shapes(LLAMA2_7B):
            rows = 2 * cols if silu else cols
            weight = (
                random_q4_0_weight(rows, k, rng) if args.symmetric else random_int4(rows, k, args.group, rng)
            )
            copies = cold_copies(rt, weight)
            x = rt.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
            y = rt.empty((1, cols))
            op = ops.gate_up_silu if silu else ops.int4_gemm
            turn = iter(range(1 << 62))
            config = ops.gemv_tuning(rt, silu, cols, k, 1, form)
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for prefetch in (False, True):
                    ops.GEMV_PREFETCH = prefetch
                    ops.clear_plans(rt)  # the next launch builds (or finds) the kernel of this arm
                    with rt.profiling():
                        seconds = tuner.device_seconds(
                            rt, lambda: op(rt, x, copies[next(turn) % len(copies)], y), rounds=3
                        )
                    best[prefetch] = min(best[prefetch], seconds)
            row = {
                "device": rt.device.name,
                "shape": tuning.shape_key(silu, cols, k, 1, form),
                **config,
                "plain_us": round(best[False] * 1e6, 2),
                "prefetch_us": round(best[True] * 1e6, 2),
                "prefetch/plain": round(best[True] / best[False], 3),
            }
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
            del copies
    finally:
        if out:
            out.close()
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
