"""Benchmark int4 GEMV/GEMM at the issue's shapes and a Llama-2-7B-shaped model end to end, on any backend.

    python benchmarks/bench_ops.py --backend opencl [--device 0] [--quick] [--json out.json]

Weights are random int4 g128 (perfx_core.synthetic): timing does not depend on their values; each shape cycles
through enough copies of its weight to miss the device cache, as a model does (cold_copies). Prints one JSON
object per line: the device's copy bandwidth and the cost of a tiny launch; per matmul shape (n = 1..512 tokens
at 12288x4096, then Llama-2-7B's layers at n = 1) the time per call, achieved GB/s (weight + activation bytes)
and GFLOP/s, the fraction of the copy bandwidth; then prefill (512 tokens) and decode (128 tokens) tok/s of the
whole model with device memory, launches per token and time per op. PERFX_OPENCL_PROFILE=1 adds device times.

OpenCL-only questions the kernels' design rests on, one mode each (benchmarks/opencl_probes.py):
    --read-floor [--gemv-floor]   how fast any kernel reads N bytes (fixed cost + rate fit); the GEMV against it
    --launch-cost                 host us per kernel enqueue, alone and beside a busy Python thread
    --sweep-mma [--ns ...]        every matrix-unit tile shape per token count, next to the GEMV / tiled GEMM
    --check-mma                   the matrix-unit kernel against float64 over forced shapes (exit 1 on a mismatch)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np

from perfx_core.model import LlamaModel
from perfx_core.plugins import get_registry
from perfx_core.synthetic import LLAMA2_7B, cold_copies, random_int4, random_llama_weights

SWEEP_M, SWEEP_K = 12288, 4096
SWEEP_N = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# (name, m, k) of Llama-2-7B's matmuls, with QKV and gate|up fused as perfx runs them.
LAYER_SHAPES = (
    ("wq/wo 4096x4096", 4096, 4096),
    ("qkv 12288x4096", 12288, 4096),
    ("gate_up 22016x4096", 22016, 4096),
    ("up/gate 11008x4096", 11008, 4096),
    ("down 4096x11008", 4096, 11008),
    ("lm_head 32000x4096", 32000, 4096),
)


def timed(rt, fn, batch: int = 20, min_seconds: float = 0.3, max_batches: int = 50) -> float:
    """Median seconds per call over batches of ``batch`` back-to-back calls with one wait at the end.

    Waiting after every call would time the queue's completion latency (~100+ us on some drivers), not the
    kernel; a model also queues its kernels back to back.
    """
    fn()
    rt.synchronize()
    samples = []
    total = time.perf_counter()
    while len(samples) < max_batches and (time.perf_counter() - total < min_seconds or len(samples) < 3):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        rt.synchronize()
        samples.append((time.perf_counter() - start) / batch)
    return statistics.median(samples)


def host_seconds_per_call(rt, fn, calls: int = 200) -> float:
    """Host time per call to queue ``fn`` without waiting for the device: the launch path's own cost. When
    it is below the back-to-back time per call (``timed``), the device is the limit, not the host."""
    fn()
    rt.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    rt.synchronize()
    return seconds


def copy_bandwidth(rt, nbytes: int = 1 << 30) -> float | None:
    """Device copy bandwidth in GB/s (read + write), when the runtime can measure it."""
    measure = getattr(rt, "copy_bandwidth_gbs", None)
    return measure(nbytes) if measure else None


def matmul_case(rt, m: int, k: int, n: int, rng: np.random.Generator, group: int = 128) -> dict:
    weight = random_int4(m, k, group, rng)
    copies = cold_copies(rt, weight)  # cycled through: each call reads its weight from memory, as in a model
    turn = itertools.count()
    x = rt.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
    out = rt.empty((n, m))
    gemm = rt.ops.int4_gemv if n == 1 else rt.ops.int4_gemm
    kernel_seconds = getattr(rt, "kernel_seconds", None) if getattr(rt, "kernel_events", None) is not None else None
    if kernel_seconds:
        kernel_seconds()  # drop earlier records
    seconds = timed(rt, lambda: gemm(x, copies[next(turn) % len(copies)], out))
    moved = weight.nbytes + 4 * n * (k + m)
    row = {
        "m": m,
        "k": k,
        "n": n,
        "us": round(seconds * 1e6, 2),
        "GB/s": round(moved / seconds / 1e9, 1),
        "GFLOP/s": round(2 * m * k * n / seconds / 1e9, 1),
    }
    if kernel_seconds:  # device time alone (PERFX_OPENCL_PROFILE=1): what the kernel achieves without the host
        records = rt.kernel_events
        calls = len(records)
        device = sum(kernel_seconds().values()) / max(1, calls)
        row.update({"device_us": round(device * 1e6, 2), "device_GB/s": round(moved / device / 1e9, 1)})
    return row


def ms_by_kernel(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Device milliseconds per step of each kernel (kernel_seconds() over ``steps`` steps), largest first."""
    return {name: round(1e3 * s / steps, 3) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def end_to_end(rt, quick: bool, kv_dtype: str = "float32") -> dict:
    config = LLAMA2_7B
    build = time.perf_counter()
    weights = random_llama_weights(config, seed=0)
    engine = LlamaModel(config, weights, rt, max_seq_len=1024, prefill_chunk=512, kv_dtype=kv_dtype)
    del weights
    build_s = time.perf_counter() - build
    prompt_len, gen = (64, 16) if quick else (512, 128)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len).tolist()
    engine.prefill(prompt, slot=0)  # warm-up at full size: builds every kernel and lazy layout the runs use
    engine.decode([1], [0], [prompt_len])
    start = time.perf_counter()
    logits = engine.prefill(prompt, slot=0)
    rt.synchronize()
    prefill_s = time.perf_counter() - start
    token = int(np.argmax(logits))
    launches_before = getattr(rt, "launch_count", None)
    start = time.perf_counter()
    for i in range(gen):
        token = int(np.argmax(engine.decode([token], [0], [prompt_len + i])[0]))
    rt.synchronize()
    decode_s = time.perf_counter() - start
    result = {
        "model": config.name,
        "kv_cache": kv_dtype,
        "build_and_upload_s": round(build_s, 1),
        "prefill_tokens": prompt_len,
        "prefill_tok_s": round(prompt_len / prefill_s, 1),
        "decode_tokens": gen,
        "decode_tok_s": round(gen / decode_s, 2),
        "device_bytes": rt.allocated_bytes,
        "device_peak_bytes": rt.peak_allocated_bytes,
    }
    if launches_before is not None:
        result["launches_per_token"] = (rt.launch_count - launches_before) / gen
    kernel_seconds = getattr(rt, "kernel_seconds", None)
    if kernel_seconds is not None and rt.kernel_events is not None:
        kernel_seconds()  # clear, then record device time per kernel over a few decode steps
        for i in range(8):
            engine.decode([token], [0], [prompt_len + gen + i])
        result["decode_device_ms_per_token_by_kernel"] = ms_by_kernel(kernel_seconds(), 8)
    profile = rt.ops.start_profiling()
    for i in range(min(gen, 16)):
        engine.decode([token], [0], [prompt_len + gen + i])
    rt.ops.stop_profiling()
    steps = min(gen, 16)
    op_s = sum(profile.seconds.values()) / steps
    result["decode_ms_per_token_by_op"] = {k: round(1e3 * v / steps, 3) for k, v in profile.seconds.items()}
    result["decode_ms_per_token_in_ops_profiled"] = round(1e3 * op_s, 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--device")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and tokens (a smoke run)")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--e2e-only", action="store_true", help="only the end-to-end model run")
    parser.add_argument(
        "--kv-dtype", default="float32", choices=("float32", "float16"), help="KV cache of the model run"
    )
    parser.add_argument("--json", help="also write the report here")
    probes = parser.add_argument_group("OpenCL modes (instead of the benchmark above)")
    mode = probes.add_mutually_exclusive_group()
    mode.add_argument("--read-floor", action="store_true", help="read-only kernels by size, and their fit")
    mode.add_argument("--launch-cost", action="store_true", help="host cost of queueing one kernel")
    mode.add_argument("--sweep-mma", action="store_true", help="time every matrix-unit kernel shape")
    mode.add_argument("--check-mma", action="store_true", help="matrix-unit kernel vs float64 over forced shapes")
    probes.add_argument("--gemv-floor", action="store_true", help="--read-floor: also the int4 GEMV against it")
    probes.add_argument("--sizes-mb", default="2,4,8,12,16,24,32,48,64,128,256,512", help="--read-floor sizes")
    probes.add_argument("--ns", default="2,4,8,16,32,64,128,512", help="--sweep-mma token counts")
    probes.add_argument("--m", type=int, default=SWEEP_M, help="--sweep-mma output columns")
    probes.add_argument("--k", type=int, default=SWEEP_K, help="--sweep-mma inner dimension")
    probes.add_argument("--group", type=int, default=128, help="--sweep-mma group size (GGUF Q4_0: 32)")
    probes.add_argument("--uc", default="1", help="--sweep-mma chunks loaded ahead to try, e.g. 1,2,4")
    probes.add_argument("--default-tiles", action="store_true", help="--sweep-mma: only the default MT and NT8")
    args = parser.parse_args()
    device = int(args.device) if args.device and args.device.isdigit() else args.device
    probe = args.read_floor or args.launch_cost or args.sweep_mma or args.check_mma
    if probe:
        if args.backend not in ("opencl", "opencl-adreno"):
            parser.error("--read-floor, --launch-cost, --sweep-mma and --check-mma need --backend opencl")
        os.environ.setdefault("PERFX_OPENCL_PROFILE", "1")  # device times from profiling events
        if args.check_mma:
            os.environ.setdefault("PERFX_OPENCL_MMA", "1")  # the portable emulation where it is not native
        return run_probe(args, device)
    rt = get_registry().open_runtime(args.backend, device)
    report: dict = {"backend": args.backend, "device": rt.device.name, "ops": dict(rt.ops.sources)}
    report["copy_GB/s"] = copy_bandwidth(rt)
    tiny_in, tiny_out = rt.from_numpy(np.ones((1, 2), np.float32)), rt.empty((1, 1))
    report["tiny_launch_us"] = round(1e6 * timed(rt, lambda: rt.ops.silu_mul(tiny_in, tiny_out), batch=200), 2)
    report["tiny_launch_host_us"] = round(
        1e6 * host_seconds_per_call(rt, lambda: rt.ops.silu_mul(tiny_in, tiny_out)), 2
    )
    print(
        json.dumps({k: report[k] for k in ("device", "copy_GB/s", "tiny_launch_us", "tiny_launch_host_us")}), flush=True
    )
    if args.e2e_only:
        report["end_to_end"] = end_to_end(rt, args.quick, args.kv_dtype)
        print(json.dumps(report["end_to_end"]), flush=True)
    else:
        run_sweeps(rt, report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_probe(args: argparse.Namespace, device) -> int:
    """One of the OpenCL modes; with --json its lines are also appended to that file."""
    import opencl_probes

    if args.json:
        emit = opencl_probes.emit

        def emit_and_save(row: dict) -> None:
            emit(row)
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

        opencl_probes.emit = emit_and_save
    registry = get_registry()
    if args.sweep_mma:
        ns = [int(v) for v in args.ns.split(",")]
        ucs = [int(v) for v in args.uc.split(",")]
        rows = opencl_probes.sweep_mma(
            lambda: registry.open_runtime(args.backend, device),
            matmul_case,
            ns,
            args.m,
            args.k,
            args.group,
            ucs,
            args.default_tiles,
        )
        for row in rows:
            opencl_probes.emit(row)
        return 0
    rt = registry.open_runtime(args.backend, device)
    try:
        if args.read_floor:
            sizes = [float(v) for v in args.sizes_mb.split(",")]
            opencl_probes.read_floor(rt, sizes, gemv=args.gemv_floor)
        elif args.launch_cost:
            opencl_probes.launch_cost(rt)
        else:
            return 1 if opencl_probes.check_mma(rt) else 0
    finally:
        rt.close()
    return 0


def run_sweeps(rt, report: dict, args: argparse.Namespace) -> None:
    """The matmul sweep and layer shapes, then (unless --skip-e2e) the model run, into ``report``."""
    rng = np.random.default_rng(0)
    sweep_n = SWEEP_N[:4] if args.quick else SWEEP_N
    report["sweep"] = [matmul_case(rt, SWEEP_M, SWEEP_K, n, rng) for n in sweep_n]
    report["layers_n1"] = [dict(matmul_case(rt, m, k, 1, rng), name=name) for name, m, k in LAYER_SHAPES]
    if report["copy_GB/s"]:
        for row in report["sweep"] + report["layers_n1"]:
            row["of_copy_bw"] = round(row["GB/s"] / report["copy_GB/s"], 3)
            if "device_GB/s" in row:
                row["device_of_copy_bw"] = round(row["device_GB/s"] / report["copy_GB/s"], 3)
    for row in report["sweep"] + report["layers_n1"]:
        print(json.dumps(row), flush=True)
    if not args.skip_e2e:
        report["end_to_end"] = end_to_end(rt, args.quick, args.kv_dtype)
        print(json.dumps(report["end_to_end"]), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # opencl_probes, beside this file
    sys.exit(main())
