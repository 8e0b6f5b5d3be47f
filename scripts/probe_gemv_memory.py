"""What limits the int4 GEMV: its memory access pattern, or its arithmetic? Device time of read-only kernels.

    PERFX_OPENCL_PROFILE=1 python scripts/probe_gemv_memory.py [--device 0]

For an m x k int4 weight (k/32 chunks of 16 bytes per row) it times, cold (cycling through copies larger than
the device cache), kernels that only read the bytes in each order and fold them into one word per thread:
- linear: one contiguous stream (the ceiling);
- chunk_major: the GEMV's order: packed[chunk][row], thread (row, split) reads chunks split, split + KS, ...;
- row_block: packed[row / 32][chunk][row % 32]: the same 512-byte warp reads, each work-group's bytes contiguous;
then the GEMV itself. Prints device microseconds and GB/s per (shape, kernel) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from perfx_core.plugins import get_registry
from perfx_core.synthetic import cold_copies, random_int4

SOURCE = r"""
__kernel void linear(__global const uint4* w, __global uint* out, int n16) {
    uint acc = 0;
    for (int i = get_global_id(0); i < n16; i += get_global_size(0)) {
        const uint4 v = w[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[get_global_id(0)] = acc;
}

// local (32, KS): thread (row lane, split); rows per work-group 32.
__kernel void chunk_major(__global const uint4* w, __global uint* out, int m, int chunks) {
    const int row = get_global_id(0), split = get_local_id(1), ks = get_local_size(1);
    uint acc = 0;
    for (int c = split; c < chunks; c += ks) {
        const uint4 v = w[(size_t)c * m + row];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[get_global_id(1) * get_global_size(0) + row] = acc;
}

__kernel void row_block(__global const uint4* w, __global uint* out, int m, int chunks) {
    const int row = get_global_id(0), split = get_local_id(1), ks = get_local_size(1);
    const size_t block = (size_t)(row >> 5) * chunks * 32 + (row & 31);
    uint acc = 0;
    for (int c = split; c < chunks; c += ks) {
        const uint4 v = w[block + (size_t)c * 32];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[get_global_id(1) * get_global_size(0) + row] = acc;
}
"""

LINEAR_THREADS = 256 * 1024  # enough to fill a large GPU
SHAPES = ((12288, 4096), (4096, 4096), (4096, 11008), (22016, 4096))
if os.environ.get("PROBE_SMALL"):
    SHAPES = ((256, 256),)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    parser.add_argument("--ks", type=int, default=16)
    args = parser.parse_args()
    if not os.environ.get("PERFX_OPENCL_PROFILE"):
        raise SystemExit("set PERFX_OPENCL_PROFILE=1 (device times come from profiling events)")
    rt = get_registry().open_runtime("opencl", args.device)
    program = rt.build(SOURCE, label="probe_gemv_memory.cl")
    rng = np.random.default_rng(0)
    for m, k in SHAPES:
        copies = cold_copies(rt, random_int4(m, k, 128, rng))
        for name, run in _kernels(rt, program, m, k, args.ks, rng).items():
            rt.kernel_seconds()
            for i in range(3 * len(copies)):
                run(copies[i % len(copies)])
            total = sum(rt.kernel_seconds().values()) / (3 * len(copies))
            row = {"m": m, "k": k, "kernel": name, "device_us": round(total * 1e6, 2)}
            print(json.dumps({**row, "GB/s": round(m * k // 2 / total / 1e9, 1)}), flush=True)


def _kernels(rt, program, m: int, k: int, ks: int, rng: np.random.Generator) -> dict:
    """name -> function(prepared weight) that queues one kernel reading that weight."""
    chunks, nbytes = k // 32, m * k // 2
    out = rt.empty((max(ks * m, LINEAR_THREADS),), np.uint32)
    x = rt.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    y = rt.empty((1, m))
    linear, chunk_major, row_block = program.linear, program.chunk_major, program.row_block
    return {
        "linear": lambda w: rt.launch(linear, (LINEAR_THREADS,), (256,), w.packed.buffer, out.buffer, nbytes // 16),
        "chunk_major": lambda w: rt.launch(chunk_major, (m, ks), (32, ks), w.packed.buffer, out.buffer, m, chunks),
        "row_block": lambda w: rt.launch(row_block, (m, ks), (32, ks), w.packed.buffer, out.buffer, m, chunks),
        "gemv": lambda w: rt.ops.int4_gemv(x, w, y),
    }


if __name__ == "__main__":
    main()
