"""Where a step's time goes: prompt prefills and batched decode steps of a Llama-2-7B-shaped int4 model (random
weights built on the machine), wall time per step next to the device time of each kernel.

    python benchmarks/profile_steps.py --backend opencl [--prompts 25,512] [--batches 1,16] [--kv-dtype float16]
        [--pick argmax,sample]  # decode steps also draw with the default filters (temperature, top-k, top-p, min-p)
        [--mixed 8,16]  # also mixed steps: each batch's decode rows plus a prompt chunk of each size (the server's)
        [--position 2000]  # the decode rows' position (their context length), 100 unless given
        [--group 32 --symmetric]  # weights as a GGUF Q4_0 file holds them (default: AWQ's 128-column groups)

Wall time is the median of several steps, each ending with its results read back (as the server does). Device
time per kernel comes from OpenCL profiling events over the same steps; wall minus device time is what the
host and the queue add. Each decode batch also gets a "decode_chained" line: wall time per step when each step
is queued before the previous one's picks are read and takes its ids from them on the device (how Generation and
perfx bench decode). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_ops import ms_by_kernel  # noqa: E402

from perfx_core.model import MIXED_PROMPT_ROWS, LlamaModel  # noqa: E402
from perfx_core.plugins import get_registry  # noqa: E402
from perfx_core.sampling import Sampler, SamplingParams  # noqa: E402
from perfx_core.synthetic import LLAMA2_7B, random_llama_weights  # noqa: E402


def measure(rt, step: Callable[[], object], repeats: int) -> dict:
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    row = {"wall_ms": round(1e3 * statistics.median(walls), 3)}
    profiling = getattr(rt, "profiling", None)
    if profiling is not None:
        with profiling():
            rt.kernel_seconds()
            for _ in range(repeats):
                step()
            by_kernel = rt.kernel_seconds()
        row["device_ms"] = round(1e3 * sum(by_kernel.values()) / repeats, 3)
        row["device_ms_by_kernel"] = ms_by_kernel(by_kernel, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="opencl")
    parser.add_argument("--device")
    parser.add_argument("--prompts", default="25,512", help="prompt lengths to prefill")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes")
    parser.add_argument("--kv-dtype", default="float16", choices=("float32", "float16"))
    parser.add_argument("--group", type=int, default=128, help="int4 group size (GGUF Q4_0's is 32)")
    parser.add_argument(
        "--symmetric", action="store_true", help="weights as GGUF Q4_0 blocks: no zero point (needs --group 32)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pick", default="argmax", help="how decode steps pick: argmax, sample or both (comma)")
    parser.add_argument(
        "--mixed", default="", help="prompt tokens of the mixed steps per batch (comma; none by default)"
    )
    parser.add_argument("--position", type=int, default=100, help="the decode rows' position in their sequence")
    parser.add_argument("--layers", type=int, help="fewer layers than Llama-2-7B's 32 (smoke runs)")
    args = parser.parse_args()
    mixed = [int(v) for v in args.mixed.split(",") if v]
    if not all(1 <= m <= MIXED_PROMPT_ROWS for m in mixed):
        parser.error(f"--mixed takes 1..{MIXED_PROMPT_ROWS} prompt tokens (a mixed step's most)")
    rt = get_registry().open_runtime(args.backend, args.device)
    prompts = [int(v) for v in args.prompts.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    config = dataclasses.replace(LLAMA2_7B, n_layers=args.layers) if args.layers else LLAMA2_7B
    engine = LlamaModel(
        config,
        random_llama_weights(config, group_size=args.group, seed=0, symmetric=args.symmetric),
        rt,
        n_slots=max(batches) + bool(mixed),
        max_seq_len=max(1024, args.position + 1, *prompts),
        prefill_chunk=max(*prompts, max(batches) + max(mixed, default=0)),  # a mixed step's rows fit too
        kv_dtype=args.kv_dtype,
    )
    rng = np.random.default_rng(0)
    for length in prompts:
        prompt = rng.integers(0, config.vocab_size, length).tolist()
        engine.prefill(prompt, slot=0)  # kernels built, graph recorded
        row = measure(rt, lambda prompt=prompt: engine.prefill(prompt, slot=0), args.repeats)
        print(json.dumps({"step": "prefill", "tokens": length, **row}), flush=True)
    for batch in batches:
        tokens, slots, positions = [1] * batch, list(range(batch)), [args.position] * batch
        chunks = [(list(rng.integers(0, config.vocab_size, size)), batch, 0) for size in mixed]
        kinds = [("decode", None)] + [("mixed", chunk) for chunk in chunks]
        for (kind, prompt), pick in itertools.product(
            kinds, args.pick.split(",")
        ):  # mixed: the same rows plus a prompt chunk into the next slot, one pass
            picks = pick_arguments(pick, batch + (prompt is not None))

            def step(t=tokens, s=slots, p=positions, c=prompt, picks=picks) -> None:
                engine.decode(t, s, p, prompt=c, **picks)

            step()  # built and recorded
            row = measure(rt, step, args.repeats)
            extra = {"prompt": len(prompt[0])} if prompt else {}
            if args.position != 100:
                extra["position"] = args.position
            print(json.dumps({"step": kind, "batch": batch, **extra, "pick": pick, **row}), flush=True)
            if prompt is None:  # the same steps chained: each queued before the previous one's picks are read
                row = {"wall_ms": chained_wall_ms(engine, tokens, slots, positions, picks, args.repeats)}
                print(json.dumps({"step": "decode_chained", "batch": batch, **extra, "pick": pick, **row}), flush=True)


def chained_wall_ms(engine, tokens, slots, positions, picks, steps: int) -> float:
    """Wall ms per decode step when each step takes its ids from the previous step's picks (queue_decode with
    the previous QueuedRows, as Generation and perfx bench decode): the median of three runs of ``steps``."""
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        queued = engine.queue_decode(tokens, slots, positions, **picks)
        for _ in range(steps - 1):
            queued = engine.queue_decode(queued, slots, positions, **picks)
        queued.result()
        runs.append((time.perf_counter() - start) / steps)
    return round(1e3 * statistics.median(runs), 3)


def pick_arguments(pick: str, rows: int) -> dict:
    """decode()'s keyword for ``pick``: argmax, or one draw per row with the default SamplingParams filters."""
    if pick == "argmax":
        return {"argmax": True}
    if pick != "sample":
        raise SystemExit(f"--pick takes argmax and/or sample; got {pick!r}")
    return {"sampling": np.stack([Sampler(SamplingParams(seed=i)).engine_row() for i in range(rows)])}


if __name__ == "__main__":
    main()
