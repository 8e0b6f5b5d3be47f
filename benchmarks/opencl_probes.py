"""The OpenCL-only modes of bench_ops.py (--read-floor, --launch-cost, --sweep-mma, --check-mma).

Each answers a question the OpenCL kernels' design rests on, and prints one JSON object per line:
- read_floor: how fast can any kernel read N bytes here, and how close does the int4 GEMV get to that?
- launch_cost: what queueing one kernel costs the host, alone and with a busy Python thread (as in a server);
  whether the driver has command buffers, which would replay a step in one call.
- sweep_mma: which matrix-unit tile shape (ops._mma_config's MT, NT8, KW, UC) is fastest per token count.
- check_mma: does the matrix-unit kernel match float64 over forced shapes (UC > 1 runs only where it is native).
Device times come from OpenCL profiling events: these need PERFX_OPENCL_PROFILE=1 (bench_ops.py sets it).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from perfx_core import reference
from perfx_core.synthetic import cold_copies, random_int4

READ_SOURCE = r"""
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

__kernel void bump(__global float* a, int n) {
    const int i = get_global_id(0);
    if (i < n) a[i] += 1.0f;
}
"""
# (m, k) of GEMVs timed against the floor: the 7B layer shapes (down, gate or up, QKV, o), then taller ones.
GEMV_SHAPES = ((4096, 11008), (11008, 4096), (12288, 4096), (4096, 4096), (22016, 4096), (44032, 4096), (16384, 11008))
DEFAULT_SIZES_MB = (2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
COLD_TOTAL_BYTES = 512 << 20  # copies cycled per size: far beyond a 50-60 MB L2
GROUP = 256


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# -- read floor ------------------------------------------------------------------------------------------------


def read_floor(rt, sizes_mb: list[float], repeats: int = 5, gemv: bool = False) -> None:
    """Read-only kernels over buffers cycled beyond the cache, per size: ``empty`` (a launch's fixed cost),
    ``one_pass`` (one 16-byte load per thread), ``stride_x4`` (a grid of 1024 or 2048 threads per compute unit,
    four loads in flight each); then the fit seconds = fixed + bytes / rate. With ``gemv``, the int4 GEMV (n = 1)
    at GEMV_SHAPES next to the fastest read of its bytes (``of_floor``)."""
    program = rt.build(READ_SOURCE, label="read_floor.cl")
    copy_gbs = rt.copy_bandwidth_gbs(1 << 30)
    units = int(rt.device.details["compute_units"])
    emit({"device": rt.device.name, "compute_units": units, "copy_GB/s": round(copy_gbs, 1)})
    best: dict[int, float] = {}
    for size_mb in sizes_mb:
        nbytes = int(size_mb * 1e6) // (16 * GROUP) * 16 * GROUP
        for row in _time_reads(rt, program, nbytes, units, repeats):
            if "GB/s" in row:
                row["of_copy_bw"] = round(row["GB/s"] / copy_gbs, 3)
                best[nbytes] = min(best.get(nbytes, 1.0), row["device_us"] / 1e6)
            emit(row)
    emit(_fit("read-only, fastest kernel", best, copy_gbs))
    if not gemv:
        return
    rng = np.random.default_rng(0)
    times: dict[int, float] = {}
    for m, k in GEMV_SHAPES:
        weight = random_int4(m, k, 128, rng)
        copies, nbytes = cold_copies(rt, weight), weight.nbytes
        floor = min(
            r["device_us"]
            for r in _time_reads(rt, program, nbytes // (16 * GROUP) * 16 * GROUP, units, 3)
            if "GB/s" in r
        )
        x, y = rt.from_numpy(rng.standard_normal((1, k), dtype=np.float32)), rt.empty((1, m))
        seconds = _device_seconds(
            rt, lambda turn, x=x, y=y, copies=copies: rt.ops.int4_gemv(x, copies[turn], y), len(copies)
        )
        times[nbytes] = seconds
        gbs = nbytes / seconds / 1e9
        emit(
            {
                "gemv": f"{m}x{k}",
                "MB": round(nbytes / 1e6, 2),
                "device_us": round(seconds * 1e6, 2),
                "GB/s": round(gbs, 1),
                "of_copy_bw": round(gbs / copy_gbs, 3),
                "floor_us": floor,
                "of_floor": round(floor / (seconds * 1e6), 3),
            }
        )
        del copies
    emit(_fit("int4 GEMV n=1", times, copy_gbs))


def _device_seconds(rt, call: Callable[[int], None], copies: int, rounds: int = 3) -> float:
    """Device seconds per call of ``call(turn)`` over ``rounds`` passes over ``copies`` (the first call untimed)."""
    call(copies - 1)
    rt.synchronize()
    rt.kernel_seconds()
    for i in range(rounds * copies):
        call(i % copies)
    return sum(rt.kernel_seconds().values()) / (rounds * copies)


def _time_reads(rt, program, nbytes: int, units: int, repeats: int) -> list[dict]:
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

        def call(turn, kernel=kernel, threads=threads, reads=reads) -> None:
            arguments = (copies[turn].buffer, out.buffer, n16) if reads else (out.buffer,)
            rt.launch(kernel, (threads,), (GROUP,), *arguments)

        seconds = _device_seconds(rt, call, len(copies), repeats)
        row = {"MB": round(nbytes / 1e6, 2), "kernel": name, "device_us": round(seconds * 1e6, 2)}
        if reads:
            row["GB/s"] = round(nbytes / seconds / 1e9, 1)
        rows.append(row)
    return rows


def _fit(what: str, seconds_by_bytes: dict[int, float], copy_gbs: float) -> dict:
    """seconds = fixed + bytes / rate, least squares over the sizes measured."""
    sizes = np.array(sorted(seconds_by_bytes), dtype=np.float64)
    slope, fixed = np.polyfit(sizes, np.array([seconds_by_bytes[int(s)] for s in sizes]), 1)
    rate = 1 / slope / 1e9
    return {
        "fit": what,
        "model": "seconds = fixed + bytes / rate",
        "fixed_us": round(fixed * 1e6, 2),
        "rate_GB/s": round(rate, 1),
        "rate_of_copy_bw": round(rate / copy_gbs, 3),
    }


# -- launch cost -----------------------------------------------------------------------------------------------


def launch_cost(rt, launches: int = 2000) -> None:
    """Host microseconds per enqueue of a tiny kernel through pyopencl (8 kernel objects with their arguments set
    once, as the runtime's launch cache keeps them), flushing never or every 16 or 64 launches, then while a
    second Python thread spins at three GIL switch intervals (the native replayer exists because of this)."""
    cl, queue = rt.cl, rt.queue
    program = rt.build(READ_SOURCE, label="read_floor.cl")
    target = rt.empty((4096,))
    kernels = []
    for _ in range(8):
        kernel = cl.Kernel(program, "bump")
        kernel.set_args(target.buffer, np.int32(4096))
        kernels.append(kernel)
    extensions = rt.cl_device.extensions.split()
    emit({"device": rt.device.name, "command_buffers": [e for e in extensions if "command_buffer" in e]})

    def per_launch_us(flush_every: int) -> tuple[float, float]:
        queue.finish()
        start = time.perf_counter()
        for i in range(launches):
            cl.enqueue_nd_range_kernel(queue, kernels[i % 8], (4096,), (128,))
            if flush_every and i % flush_every == flush_every - 1:
                queue.flush()
        queued = time.perf_counter() - start
        queue.finish()
        return 1e6 * queued / launches, 1e6 * (time.perf_counter() - start) / launches

    for flush_every in (0, 16, 64):
        per_launch_us(flush_every)  # warm-up
        queued, finished = per_launch_us(flush_every)
        emit({"flush_every": flush_every, "queued_us": round(queued, 2), "finished_us": round(finished, 2)})
    default_interval = sys.getswitchinterval()
    try:
        for interval in (0.005, 0.001, 0.0002):
            sys.setswitchinterval(interval)
            with _busy_thread():
                queued, _ = per_launch_us(16)
            emit({"busy_thread_switch_interval_ms": 1e3 * interval, "flush_every": 16, "queued_us": round(queued, 2)})
    finally:
        sys.setswitchinterval(default_interval)


class _busy_thread:
    """A second Python thread counting in a loop while the block runs."""

    def __enter__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        time.sleep(0.01)

    def _spin(self) -> None:
        while not self.stop.is_set():
            pass

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


# -- matrix-unit kernel shapes ---------------------------------------------------------------------------------


def _mma_shapes(n: int, ucs: list[int], default_tiles: dict | None) -> list[dict]:
    """Every tile shape (or only the default rule's ``default_tiles``) x KW x UC worth timing for n tokens."""
    if default_tiles:
        tiles = [(default_tiles["MT"], default_tiles["NT8"])]
    elif n <= 16:
        tiles = [(mt, 1 if n <= 8 else 2) for mt in (1, 2, 4)]
    else:
        tiles = list(itertools.product((2, 4), (2, 3, 4)))
    kws = (4, 8, 16) if n <= 16 else (1, 2, 4, 8)
    return [{"MT": mt, "NT8": nt8, "KW": kw, "UC": uc} for (mt, nt8), kw, uc in itertools.product(tiles, kws, ucs)]


class _forced_mma_shape:
    """PERFX_OPENCL_MMA_SHAPE set to ``shape`` inside the block, with the ops' caches of it cleared."""

    def __init__(self, rt, shape: str):
        self.rt, self.shape = rt, shape

    def __enter__(self) -> None:
        os.environ["PERFX_OPENCL_MMA_SHAPE"] = self.shape
        self._clear()

    def __exit__(self, *exc) -> None:
        os.environ.pop("PERFX_OPENCL_MMA_SHAPE", None)
        self._clear()

    def _clear(self) -> None:
        from perfx_opencl import ops

        ops.mma_overrides.cache_clear()
        ops.clear_plans(self.rt)


def sweep_mma(
    open_runtime: Callable[[], object],
    matmul_case: Callable[..., dict],
    ns: list[int],
    m: int,
    k: int,
    group: int,
    ucs: list[int],
    default_tiles: bool,
) -> Iterator[dict]:
    """Per token count: the GEMV / tiled GEMM (PERFX_OPENCL_MMA=0), then the matrix-unit kernel at every shape
    (PERFX_OPENCL_MMA=1), fastest first. ``matmul_case`` is bench_ops.py's timing of one matmul."""
    from perfx_opencl import ops

    rng = np.random.default_rng(0)
    saved = os.environ.get("PERFX_OPENCL_MMA")
    try:
        for n in ns:
            os.environ["PERFX_OPENCL_MMA"] = "0"
            rt = open_runtime()
            rows = [dict(matmul_case(rt, m, k, n, rng, group), kernel="gemv/gemm", group=group)]
            rt.close()
            os.environ["PERFX_OPENCL_MMA"] = "1"
            rt = open_runtime()
            tiles = ops._mma_config(rt, n, m, k, group) if default_tiles else None
            for shape in _mma_shapes(n, ucs, tiles):
                with _forced_mma_shape(rt, ",".join(f"{key}={value}" for key, value in shape.items())):
                    built = ops._mma_config(rt, n, m, k, group)  # after the caps (KW, UC), not as asked
                    rows.append(dict(matmul_case(rt, m, k, n, rng, group), kernel="mma", group=group, **built))
            rt.close()
            yield from sorted(rows, key=lambda r: r.get("device_us", r["us"]))
    finally:
        if saved is None:
            os.environ.pop("PERFX_OPENCL_MMA", None)
        else:
            os.environ["PERFX_OPENCL_MMA"] = saved


# rows, k, group, tokens, SiLU: partial row and token tiles, 32/64/128-column groups, gate|up
MMA_CASES = (
    (4096, 11008, 128, 16, False),
    (300, 11008, 128, 31, False),
    (200, 4096, 64, 9, True),
    (72, 4096, 32, 5, False),
    (72, 1152, 128, 20, True),
    (150, 4096, 128, 2, True),
    (72, 1152, 128, 24, False),
)
MMA_FORCED = ("UC=1", "", "UC=2", "UC=4,KW=8", "UC=4,MT=1,NT8=4", "KW=2,UC=4", "NT8=3,UC=4", "MT=4,NT8=3,KW=2")


def check_mma(rt) -> int:
    """Each MMA_CASES matmul at each MMA_FORCED shape ("": the default rule) against float64: one line per case,
    ``ok`` when NMSE < 1e-6. Returns the number that are not. Needs PERFX_OPENCL_MMA=1 where it is not native."""
    from perfx_opencl import ops

    emit({"device": rt.device.name, "matrix_units": "native" if rt.native_mma else "emulated (UC = 1 only)"})
    rng = np.random.default_rng(0)
    failures = 0
    for rows, k, group, n, silu in MMA_CASES:
        weight = random_int4(2 * rows if silu else rows, k, group, rng)
        x = rng.standard_normal((n, k)).astype(np.float32)
        want = reference.gate_up_silu(x, weight) if silu else reference.matmul(x, weight)
        w = rt.prepare_weight(weight)
        for shape in MMA_FORCED:
            with _forced_mma_shape(rt, shape):
                out = rt.empty((n, rows))
                (ops.gate_up_silu if silu else ops.int4_gemm)(rt, rt.from_numpy(x), w, out)
                got = rt.to_numpy(out)
                built = ops._mma_config(rt, n, rows, k, group, silu)
            nmse = float(((got - want) ** 2).sum() / (want**2).sum())
            failures += nmse >= 1e-6
            case = {"m": rows, "k": k, "group": group, "n": n, "silu": silu, "forced": shape or "default"}
            emit({**case, "built": built, "nmse": float(f"{nmse:.3g}"), "ok": nmse < 1e-6})
    emit({"cases": len(MMA_CASES) * len(MMA_FORCED), "failed": failures})
    return failures


if __name__ == "__main__":
    raise SystemExit("these are modes of bench_ops.py: python benchmarks/bench_ops.py --backend opencl --help")
