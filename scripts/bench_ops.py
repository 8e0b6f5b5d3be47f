"""Benchmark int4 GEMV/GEMM at the issue's shapes and a Llama-2-7B-shaped model end to end, on any backend.

    python scripts/bench_ops.py --backend opencl [--device 0] [--quick] [--json out.json]

Weights are random int4 g128 (perfx_core.synthetic): timing does not depend on their values. Figures:
achieved GB/s (weight + activation bytes moved per call) and GFLOP/s per shape, the fraction of the
device's copy bandwidth, then prefill (512 tokens) and decode (128 tokens) tok/s with device memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from perfx_core.model import LlamaModel
from perfx_core.plugins import get_registry
from perfx_core.synthetic import LLAMA2_7B, random_int4, random_llama_weights

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


def copy_bandwidth(rt, nbytes: int = 1 << 30) -> float | None:
    """Device copy bandwidth in GB/s (read + write), when the runtime can measure it."""
    measure = getattr(rt, "copy_bandwidth_gbs", None)
    return measure(nbytes) if measure else None


def matmul_case(rt, m: int, k: int, n: int, rng: np.random.Generator) -> dict:
    weight = random_int4(m, k, 128, rng)
    w = rt.prepare_weight(weight)
    x = rt.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
    out = rt.empty((n, m))
    op = rt.ops.int4_gemv if n == 1 else rt.ops.int4_gemm
    kernel_seconds = getattr(rt, "kernel_seconds", None) if getattr(rt, "kernel_events", None) is not None else None
    if kernel_seconds:
        kernel_seconds()  # drop earlier records
    seconds = timed(rt, lambda: op(x, w, out))
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


def end_to_end(rt, quick: bool) -> dict:
    config = LLAMA2_7B
    build = time.perf_counter()
    weights = random_llama_weights(config, seed=0)
    engine = LlamaModel(config, weights, rt, max_seq_len=1024, prefill_chunk=512)
    del weights
    build_s = time.perf_counter() - build
    prompt_len, gen = (64, 16) if quick else (512, 128)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len).tolist()
    engine.prefill(prompt[:8], slot=0)  # warm-up: builds kernels and lazy layouts
    engine.decode([1], [0], [8])
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
        result["decode_device_ms_per_token_by_kernel"] = {
            k: round(1e3 * v / 8, 3) for k, v in sorted(kernel_seconds().items(), key=lambda kv: -kv[1])
        }
    profile = rt.ops.start_profiling()
    for i in range(min(gen, 16)):
        engine.decode([token], [0], [prompt_len + gen + i])
    rt.ops.stop_profiling()
    steps = min(gen, 16)
    op_s = sum(profile.seconds.values()) / steps
    result["decode_ms_per_token_by_op"] = {k: round(1e3 * v / steps, 3) for k, v in profile.seconds.items()}
    result["decode_ms_per_token_in_ops_profiled"] = round(1e3 * op_s, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--device")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and tokens (a smoke run)")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    device = int(args.device) if args.device and args.device.isdigit() else args.device
    rt = get_registry().open_runtime(args.backend, device)
    rng = np.random.default_rng(0)
    report: dict = {"backend": args.backend, "device": rt.device.name, "ops": dict(rt.ops.sources)}
    report["copy_GB/s"] = copy_bandwidth(rt)
    tiny_in, tiny_out = rt.from_numpy(np.ones((1, 2), np.float32)), rt.empty((1, 1))
    report["tiny_launch_us"] = round(1e6 * timed(rt, lambda: rt.ops.silu_mul(tiny_in, tiny_out), batch=200), 2)
    print(json.dumps({k: report[k] for k in ("device", "copy_GB/s", "tiny_launch_us")}), flush=True)
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
        report["end_to_end"] = end_to_end(rt, args.quick)
        print(json.dumps(report["end_to_end"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
