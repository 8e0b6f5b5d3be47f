"""How fast can one kernel read N bytes on this device? The floor under any GEMV of that size.

    PERFX_OPENCL_PROFILE=1 python scripts/probe_read_floor.py [--device 0] [--sizes-mb 4,8,...]

For each size it times (device time, profiling events) read-only kernels over buffers cycled through copies
larger than the device cache, so every read comes from memory as a decode step's weights do:
- empty: a kernel that reads nothing (launch, ramp-up and drain: the fixed cost every kernel pays);
- one_pass: one thread per 16 bytes (many work-groups, one load each);
- stride_x4: a grid of 1024 or 2048 threads per compute unit walking the buffer, 4 independent 16-byte loads
  in flight per thread (scripts/probe_gemv_memory.py's `linear` is the one-load version: slower).
With --gemv it also times the int4 GEMV (n = 1, group 128) at the Llama-2-7B shapes and at taller ones,
next to the read-only kernels over the same number of bytes (weights + scales + biases): `of_floor` is the
fastest read-only time over the GEMV's time, and the fit over the GEMV's rows gives its streaming rate.
Prints JSON lines: size, kernel, device microseconds, GB/s and the fraction of the copy bandwidth (measured
first, by the runtime's copy kernel over 1 GiB). A fit time = fixed + bytes / rate over the sizes is printed
last: when `fixed` is a few microseconds, a 23 MB read cannot reach a large fraction of the copy bandwidth
whatever the kernel does.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from perfx_core.plugins import get_registry
from perfx_core.synthetic import cold_copies, random_int4

SOURCE = r"""
__kernel void empty(__global uint* out) {
    if (get_global_id(0) == 0x7fffffff) out[0] = 1;
}

__kernel void one_pass(__global const uint4* w, __global uint* out, int n16) {
    const int i = get_global_id(0);
    if (i < n16) {
        const uint4 v = w[i];
        if ((v.x ^ v.y ^ v.z ^ v.w) == 0x9e3779b9u) out[0] = i;  // keeps the load; never true in practice
    }
}

__kernel void stride_x4(__global const uint4* w, __global uint* out, int n16) {
    const int gs = get_global_size(0);
    int i = get_global_id(0);
    uint acc = 0;
    for (; i + 3 * gs < n16; i += 4 * gs) {  // four loads issued before any is used
        const uint4 a = w[i], b = w[i + gs], c = w[i + 2 * gs], d = w[i + 3 * gs];
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^ (d.x ^ d.y ^ d.z ^ d.w);
    }
    for (; i < n16; i += gs) {
        const uint4 v = w[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[get_global_id(0)] = acc;
}
"""

# (m, k) of the GEMV rows: the 7B layer shapes (down, gate or up, QKV, o), then taller ones for the fit.
GEMV_SHAPES = ((4096, 11008), (11008, 4096), (12288, 4096), (4096, 4096), (22016, 4096), (44032, 4096), (16384, 11008))
DEFAULT_SIZES_MB = (2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
COLD_TOTAL_BYTES = 512 << 20  # copies cycled per size: far beyond a 50-60 MB L2
GROUP = 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    parser.add_argument("--sizes-mb", default=",".join(map(str, DEFAULT_SIZES_MB)))
    parser.add_argument("--gemv", action="store_true", help="also time the int4 GEMV against the floor")
    parser.add_argument("--gemv-shapes", help="m:k,m:k,... instead of GEMV_SHAPES")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the copies per size")
    args = parser.parse_args()
    if not os.environ.get("PERFX_OPENCL_PROFILE"):
        raise SystemExit("set PERFX_OPENCL_PROFILE=1 (device times come from profiling events)")
    rt = get_registry().open_runtime("opencl", args.device)
    program = rt.build(SOURCE, label="probe_read_floor.cl")
    copy_gbs = rt.copy_bandwidth_gbs(1 << 30)
    units = int(rt.device.details["compute_units"])
    print(json.dumps({"device": rt.device.name, "compute_units": units, "copy_GB/s": round(copy_gbs, 1)}), flush=True)
    best: dict[int, float] = {}
    for size_mb in (float(s) for s in args.sizes_mb.split(",")):
        nbytes = int(size_mb * 1e6) // (16 * GROUP) * 16 * GROUP
        for row in time_size(rt, program, nbytes, units, args.repeats):
            if "GB/s" in row:
                row["of_copy_bw"] = round(row["GB/s"] / copy_gbs, 3)
                best[nbytes] = min(best.get(nbytes, 1.0), row["device_us"] / 1e6)
            print(json.dumps(row), flush=True)
    print_fit("read-only, fastest kernel", best, copy_gbs)
    if args.gemv:
        gemv: dict[int, float] = {}
        rng = np.random.default_rng(0)
        shapes = (
            [tuple(map(int, v.split(":"))) for v in args.gemv_shapes.split(",")] if args.gemv_shapes else GEMV_SHAPES
        )
        for m, k in shapes:
            weight = random_int4(m, k, 128, rng)
            copies, nbytes = cold_copies(rt, weight), weight.nbytes
            floor = min(
                r["device_us"]
                for r in time_size(rt, program, nbytes // (16 * GROUP) * 16 * GROUP, units, 3)
                if "GB/s" in r
            )
            x, y = rt.from_numpy(rng.standard_normal((1, k), dtype=np.float32)), rt.empty((1, m))
            runs = 3 * len(copies)
            rt.ops.int4_gemv(x, copies[-1], y)  # built, and its first launch (slower on some drivers) not timed
            rt.synchronize()
            rt.kernel_seconds()
            for i in range(runs):
                rt.ops.int4_gemv(x, copies[i % len(copies)], y)
            seconds = sum(rt.kernel_seconds().values()) / runs
            gemv[nbytes] = seconds
            gbs = nbytes / seconds / 1e9
            row = {
                "gemv": f"{m}x{k}",
                "MB": round(nbytes / 1e6, 2),
                "device_us": round(seconds * 1e6, 2),
                "GB/s": round(gbs, 1),
                "of_copy_bw": round(gbs / copy_gbs, 3),
                "floor_us": floor,
                "of_floor": round(floor / (seconds * 1e6), 3),
            }
            print(json.dumps(row), flush=True)
            del copies
        print_fit("int4 GEMV n=1", gemv, copy_gbs)


def print_fit(what: str, seconds_by_bytes: dict[int, float], copy_gbs: float) -> None:
    """seconds = fixed + bytes / rate, least squares over the sizes measured."""
    sizes = np.array(sorted(seconds_by_bytes), dtype=np.float64)
    slope, fixed = np.polyfit(sizes, np.array([seconds_by_bytes[int(s)] for s in sizes]), 1)
    rate = 1 / slope / 1e9
    print(
        json.dumps(
            {
                "fit": what,
                "model": "seconds = fixed + bytes / rate",
                "fixed_us": round(fixed * 1e6, 2),
                "rate_GB/s": round(rate, 1),
                "rate_of_copy_bw": round(rate / copy_gbs, 3),
            }
        ),
        flush=True,
    )


def time_size(rt, program, nbytes: int, units: int, repeats: int) -> list[dict]:
    """Device time of each read-only kernel over ``nbytes``, cycling through copies beyond the cache."""
    n16 = nbytes // 16
    copies = [rt.empty((nbytes // 4,), np.uint32) for _ in range(max(2, -(-COLD_TOTAL_BYTES // nbytes)))]
    out = rt.empty((max(n16, 2048 * units),), np.uint32)
    kernels = (  # name, kernel, threads, reads the buffer
        ("empty", program.empty, GROUP, False),
        ("one_pass", program.one_pass, n16, True),
        ("stride_x4_1k", program.stride_x4, 1024 * units, True),
        ("stride_x4_2k", program.stride_x4, 2048 * units, True),
    )
    rows = []
    for name, kernel, threads, reads in kernels:
        runs = repeats * len(copies)
        rt.launch(kernel, (threads,), (GROUP,), *((copies[-1].buffer, out.buffer, n16) if reads else (out.buffer,)))
        rt.synchronize()  # the first launch (slower on some drivers) is not timed
        rt.kernel_seconds()
        for i in range(runs):
            arguments = (copies[i % len(copies)].buffer, out.buffer, n16) if reads else (out.buffer,)
            rt.launch(kernel, (threads,), (GROUP,), *arguments)
        seconds = sum(rt.kernel_seconds().values()) / runs
        row = {"MB": round(nbytes / 1e6, 2), "kernel": name, "device_us": round(seconds * 1e6, 2)}
        if reads:
            row["GB/s"] = round(nbytes / seconds / 1e9, 1)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
