#!/usr/bin/env python
"""Cost of one layer's decode attention on the CPU backend, by head shape, rows and context length.

    PERFX_NUMBA_PARALLEL=never python benchmarks/bench_cpu_attention.py
    python benchmarks/bench_cpu_attention.py --heads 9/3x64 --rows 1,8 --positions 100,600,2000 --kv-dtype float16

Runs ``rt.ops.attention_decode`` of the NumPy backend's runtime (the numba plugin's kernel where it is installed)
on a random cache: each of ``rows`` sequences writes its new token at the given position and attends to all before
it. Prints one JSON object per case: microseconds per call, the least over ``--rounds`` batches of calls (wall
time: run single-threaded, or on an idle machine, for A/B figures). Default head shapes: SmolLM2's (9 query heads,
3 kv heads of 64) and Gemma 3 270M's (4, 1 of 256).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from perfx_core.backend import RopeTable
from perfx_core.plugins import get_registry
from perfx_core.specs import AttentionSpec, KVCacheSpec


def parse_heads(text: str) -> tuple[int, int, int]:
    """'9/3x64' -> (query heads, kv heads, head size)."""
    heads, _, hd = text.partition("x")
    n_heads, _, n_kv = heads.partition("/")
    return int(n_heads), int(n_kv), int(hd)


def time_case(rt, heads, rows: int, position: int, kv_dtype: str, rounds: int, calls: int) -> float:
    n_heads, n_kv, hd = heads
    rng = np.random.default_rng(0)
    seq = position + 1
    spec = AttentionSpec(n_heads, n_kv, hd)
    angles = rng.uniform(0, 6.3, (seq, hd // 2))
    rope = RopeTable(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    cache = rt.new_kv_cache(KVCacheSpec(1, rows, seq, n_kv, hd, kv_dtype))
    history = rng.standard_normal((2, 1, rows, n_kv, seq, hd)).astype(np.float32)
    rt.kv_cache_from_numpy(cache, *history)
    slots = np.arange(rows, dtype=np.int32)
    positions = np.full(rows, position, np.int32)
    qkv = rng.standard_normal((rows, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    out = np.empty((rows, n_heads * hd), np.float32)

    def call() -> None:
        rt.ops.attention_decode(qkv, cache, 0, slots, positions, rope, spec, out)

    call()  # compiled, caches touched
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", action="append", help="query/kv heads x head size, e.g. 9/3x64 (repeatable)")
    p.add_argument("--rows", default="1,8", help="sequences per step (comma)")
    p.add_argument("--positions", default="100,600,2000", help="the new token's position (comma)")
    p.add_argument("--kv-dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    rt = get_registry().open_runtime("numpy")
    for text in args.heads or ["9/3x64", "4/1x256"]:
        heads = parse_heads(text)
        for rows in map(int, args.rows.split(",")):
            for position in map(int, args.positions.split(",")):
                seconds = time_case(rt, heads, rows, position, args.kv_dtype, args.rounds, args.calls)
                row = {"heads": text, "rows": rows, "position": position, "kv_dtype": args.kv_dtype}
                row["op"] = rt.ops.sources["attention_decode"]
                print(json.dumps({**row, "us_per_call": round(seconds * 1e6, 1)}), flush=True)


if __name__ == "__main__":
    main()
