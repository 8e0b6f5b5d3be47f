"""What the desktop app's "Profile ops" costs: decode speed of chat replies with and without per-op profiling.

Profiles as the app's GenerationWorker does (OpTable.start_profiling after the first token, stop at the end), in
alternating runs so that a change in the machine's load hits both sides alike. Prints wall-clock tokens/s and CPU
milliseconds per token (process time: less disturbed than wall time by other jobs on a shared machine), medians
and the relative cost, then the same as JSON.

    python benchmarks/gui_profile_cost.py [--backend numpy] [--pairs 10] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import perfx_core


def decode_run(model, tokens: int, profile: bool) -> tuple[float, float]:
    """(decode tokens/s, CPU ms per decoded token) of one greedy reply of ``tokens`` tokens."""
    messages = [{"role": "user", "content": "Count from one to one hundred."}]
    generation = model.chat(messages, max_tokens=tokens, temperature=0, ignore_eos=True)
    started = False
    for _ in generation:
        if not started:
            started = True
            wall, cpu = time.perf_counter(), time.process_time()
            if profile:
                model.runtime.ops.start_profiling()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profile:
        model.runtime.ops.stop_profiling()
    steps = generation.stats.generated_tokens - 1
    return steps / wall, 1e3 * cpu / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--device", default=None)
    parser.add_argument("--pairs", type=int, default=10, help="alternating (plain, profiled) runs")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per reply")
    args = parser.parse_args()
    model = perfx_core.load(backend=args.backend, device=args.device, context_length=512)
    for profile in (False, True):  # warm-up: one-time work of each path
        decode_run(model, args.tokens, profile)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.pairs):
        for profile in (False, True):
            runs[profile].append(decode_run(model, args.tokens, profile))
    model.close()
    result = {"backend": args.backend, "pairs": args.pairs, "tokens": args.tokens}
    for profile, name in ((False, "plain"), (True, "profiled")):
        tps = statistics.median(r[0] for r in runs[profile])
        cpu = statistics.median(r[1] for r in runs[profile])
        result[name] = {"tokens_per_s": round(tps, 2), "cpu_ms_per_token": round(cpu, 3)}
        print(f"{name:9s} {tps:8.2f} tok/s  {cpu:8.3f} CPU ms/token  (medians of {args.pairs})")
    result["wall_cost"] = round(1 - result["profiled"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 4)
    result["cpu_cost"] = round(result["profiled"]["cpu_ms_per_token"] / result["plain"]["cpu_ms_per_token"] - 1, 4)
    print(f"profiling: {100 * result['wall_cost']:.1f} % fewer tok/s, {100 * result['cpu_cost']:+.1f} % CPU per token")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
