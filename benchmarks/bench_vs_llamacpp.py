#!/usr/bin/env python
"""perfx next to llama.cpp on the same GGUF and thread count: prefill and decode speed, side by side.

    python benchmarks/bench_vs_llamacpp.py                      # bundled SmolLM2, 2 threads, 512 + 128 tokens
    python benchmarks/bench_vs_llamacpp.py --model m.gguf --threads 4 --repeat 5 --json out.json

Both engines run in this process, loaded once and warmed up, then timed in alternating runs (perfx,
llama.cpp, perfx, ...) so that a noisy neighbour hits both alike; the medians are compared.

- prefill: ``--prompt-tokens`` seeded random token ids in one call (perfx ``engine.prefill``, llama.cpp
  ``Llama.eval``), from an empty context, including the last token's logits.
- decode: ``--gen-tokens`` single-token steps after that prompt, each returning logits and taking the
  argmax as the next token (perfx ``engine.decode``, llama.cpp ``Llama.eval([token])``).

Prints a table of prefill and decode tok/s per engine (medians), the perfx / llama.cpp ratio of the medians and the
range of that ratio over the run pairs, then the result as JSON (--json also writes it, with every run, to a file).

llama.cpp comes from the llama-cpp-python binding, a benchmark-only dependency:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

INSTALL_HINT = (
    "llama-cpp-python is not installed; install it (a benchmark-only dependency, ~7 minutes to build) with:\n"
    '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python'
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: $PERFX_MODEL or the bundled SmolLM2)")
    p.add_argument("--backend", default="numpy", help="perfx backend (default: numpy)")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default: 2)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each engine, alternating (default: 3)")
    p.add_argument(
        "--kv-dtype",
        choices=("float16", "float32"),
        default=None,
        help="perfx's KV cache (default: the backend's; llama.cpp's is float16)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def perfx_run(engine, prompt, gen_tokens):
    import numpy as np

    start = time.perf_counter()
    logits = engine.prefill(prompt, slot=0)
    token = int(np.argmax(logits))
    engine.rt.synchronize()
    prefill_s = time.perf_counter() - start
    position = len(prompt)
    start = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(np.argmax(engine.decode([token], [0], [position])[0]))
        position += 1
    engine.rt.synchronize()
    return prefill_s, time.perf_counter() - start


def _llama_last_logits(llm):
    """The logits of the last evaluated token (Llama.eval keeps them in the context, not in ``scores``,
    unless logits_all=True)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_run(llm, prompt, gen_tokens):
    import numpy as np

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = int(np.argmax(_llama_last_logits(llm)))
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(gen_tokens):
        llm.eval([token])
        token = int(np.argmax(_llama_last_logits(llm)))
    return prefill_s, time.perf_counter() - start


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which platform.processor() leaves empty on Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv=None) -> int:
    args = parse_args(argv)
    # Thread counts must be set before NumPy/numba start their pools.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    try:
        import llama_cpp
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    import numpy as np

    import perfx_core
    from perfx_core.default_model import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    context = args.prompt_tokens + args.gen_tokens + 1

    t0 = time.perf_counter()
    model = perfx_core.load(model_path, backend=args.backend, context_length=context, kv_dtype=args.kv_dtype)
    perfx_load_s = time.perf_counter() - t0
    engine = model.engine
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=model_path,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=max(1024, context),
        n_batch=max(512, args.prompt_tokens),
        verbose=False,
    )
    llama_load_s = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, model.config.vocab_size, size=args.prompt_tokens).tolist()
    # Warm-up: one-time work (kernel compilation, weight layouts, buffer allocation) outside the timings, on
    # the timed shapes: a shorter prompt would run other paths (perfx: prompts of 9-32 tokens build float32
    # weight copies that later prefills reuse; decode below position ~170 skips the parallel attention), and
    # enough decode steps for numba-cpu's single-threaded kernels (right after a prefill) and parallel ones.
    perfx_run(engine, prompt, 32)
    llama_run(llm, prompt, 32)
    load_before = os.getloadavg()

    runs = {"perfx": [], "llama.cpp": []}
    for i in range(args.repeat):
        for name, fn, obj in (("perfx", perfx_run, engine), ("llama.cpp", llama_run, llm)):
            prefill_s, decode_s = fn(obj, prompt, args.gen_tokens)
            runs[name].append({"prefill_s": prefill_s, "decode_s": decode_s})
            print(
                f"run {i + 1}/{args.repeat} {name:9s}: prefill {args.prompt_tokens / prefill_s:7.1f} tok/s, "
                f"decode {args.gen_tokens / decode_s:6.1f} tok/s",
                file=sys.stderr,
            )

    def summary(name):
        r = runs[name]
        prefill_s = statistics.median(x["prefill_s"] for x in r)
        decode_s = statistics.median(x["decode_s"] for x in r)
        return {
            "prefill_tokens_per_s": args.prompt_tokens / prefill_s,
            "decode_tokens_per_s": args.gen_tokens / decode_s,
            "time_to_first_token_s": prefill_s,
            "decode_ms_per_token": 1e3 * decode_s / args.gen_tokens,
        }

    load_after = os.getloadavg()
    perfx_s, llama_s = summary("perfx"), summary("llama.cpp")
    result = {
        "model": model_path,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "cpu_model": _cpu_model(),
        },
        # 1-minute load averages around the timed runs (this process adds ~threads while it runs).
        "load_average": {"before": load_before[0], "after": load_after[0]},
        "perfx_numba_parallel": os.environ.get("PERFX_NUMBA_PARALLEL", "auto"),
        "perfx": {
            **perfx_s,
            "backend": args.backend,
            "kv_dtype": engine.cache_spec.dtype,
            "load_s": perfx_load_s,
            "ops": dict(engine.rt.ops.sources),
        },
        "llama.cpp": {
            **llama_s,
            "load_s": llama_load_s,
            "version": getattr(llama_cpp, "__version__", "?"),
            # which instruction sets the build uses: an AVX2 build and a native (AVX-512, VNNI) one differ a lot
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        },
        "ratio_perfx_over_llamacpp": {
            "decode": perfx_s["decode_tokens_per_s"] / llama_s["decode_tokens_per_s"],
            "prefill": perfx_s["prefill_tokens_per_s"] / llama_s["prefill_tokens_per_s"],
        },
        "runs": runs,
    }
    model.close()

    rows = [
        (f"decode ({args.gen_tokens} tokens), tok/s", "decode_tokens_per_s", "decode"),
        (f"prefill ({args.prompt_tokens} tokens), tok/s", "prefill_tokens_per_s", "prefill"),
    ]
    print(
        f"\n{os.path.basename(model_path)}, {args.threads} threads, perfx KV cache {engine.cache_spec.dtype}, "
        f"median of {args.repeat} alternating runs, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after"
    )
    header = f"| {'metric':32s} | {'perfx':>9s} | {'llama.cpp':>9s} | {'perfx / llama.cpp':>17s} |"
    print(header + f" {'ratio of each run pair':>22s} |")
    print(f"| {'-' * 32} | {'-' * 9} | {'-' * 9} | {'-' * 17} | {'-' * 22} |")
    for label, key, ratio in rows:
        seconds = f"{ratio}_s"  # a pair is one perfx run and the llama.cpp run right after it
        pairs = [b[seconds] / a[seconds] for a, b in zip(runs["perfx"], runs["llama.cpp"], strict=True)]
        print(
            f"| {label:32s} | {perfx_s[key]:9.1f} | {llama_s[key]:9.1f} | "
            f"{result['ratio_perfx_over_llamacpp'][ratio]:17.2f} | {min(pairs):9.2f} - {max(pairs):<10.2f} |"
        )
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
