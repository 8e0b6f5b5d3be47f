#!/usr/bin/env python
"""CPU time and Python calls per decode token of one model on one backend: the host side of a step.

    PERFX_NUMBA_PARALLEL=never python benchmarks/host_cost_per_token.py --model gemma-3-270m-q4_k_m.gguf

Prefills ``--prompt-tokens`` tokens, warms up, then times ``--rounds`` rounds of ``--tokens`` greedy decode steps
(argmax on the engine) and prints the process's CPU milliseconds per token (minimum and median of the rounds) next
to the wall milliseconds, then the Python function calls per token (one more round under cProfile). Run
single-threaded (``PERFX_NUMBA_PARALLEL=never``) the CPU time is the work itself: neighbours on a shared machine
change wall time far more than it, so an A/B of host-side changes (two trees alternating on PYTHONPATH) shows
differences of a few percent that tok/s figures hide.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model file or directory (default: the bundled model)")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--tokens", type=int, default=60, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    import perfx_core

    model = perfx_core.load(
        args.model, backend=args.backend, context_length=args.prompt_tokens + (args.rounds + 2) * args.tokens + 20
    )
    engine = model.engine
    position = args.prompt_tokens
    engine.prefill([100 + i % 1000 for i in range(args.prompt_tokens)], slot=0)

    def steps(count: int) -> None:
        nonlocal position
        for _ in range(count):
            engine.decode([5], [0], [position], argmax=True)
            position += 1

    steps(20)  # kernels compiled, layouts built
    cpu, wall = [], []
    for _ in range(args.rounds):
        c, t = time.process_time(), time.perf_counter()
        steps(args.tokens)
        cpu.append(1e3 * (time.process_time() - c) / args.tokens)
        wall.append(1e3 * (time.perf_counter() - t) / args.tokens)
    profiler = cProfile.Profile()
    profiler.enable()
    steps(args.tokens)
    profiler.disable()
    calls = pstats.Stats(profiler).total_calls / args.tokens
    print(
        json.dumps(
            {
                "model": str(model.path),
                "backend": args.backend,
                "cpu_ms_per_token_min": round(min(cpu), 3),
                "cpu_ms_per_token_median": round(statistics.median(cpu), 3),
                "wall_ms_per_token_min": round(min(wall), 3),
                "python_calls_per_token": round(calls, 1),
            }
        )
    )
    model.close()


if __name__ == "__main__":
    main()
