"""Session-10 experiments on a mixed step (decode rows + a prompt chunk, LlamaModel.decode(prompt=...)) of a
Llama-2-7B-shaped int4 model (random weights built here), device ms per step from OpenCL profiling. Each
experiment switches an ops setting, forgets the recorded steps and launch plans, and times the same steps:

    python scripts/probe_mixed_steps.py attention [--cases 16:100,16:2000]
        # attention_mixed as one launch vs the two kernels, by decode rows:position (MIXED_ATTENTION_MAX_GROUPS)
    python scripts/probe_mixed_steps.py norm-tail [--cases 15:8,15:16]
        # linear_add_rmsnorm at 17-32 rows, by decode rows:prompt rows: the separate add_rmsnorm launch, the mma
        # tail with the 16-token shape in two groups (the default), the tail with the 3-4 tile shape
    python scripts/probe_mixed_steps.py add-rmsnorm
        # the add_rmsnorm launch alone (d = 4096) by work-group size and rows

One JSON line per measurement (docs/opencl.md, session 10; docs/results/h200_*_session10.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from profile_steps import measure  # noqa: E402

from perfx_core.model import LlamaModel  # noqa: E402
from perfx_core.plugins import get_registry  # noqa: E402
from perfx_core.synthetic import LLAMA2_7B, random_llama_weights  # noqa: E402

ATTENTION_CASES = "16:100,16:200,16:400,16:800,4:1000,8:1000,2:2000,4:2000"
NORM_TAIL_CASES = "16:0,15:8,15:16,7:16"


@contextmanager
def patched(module, **values) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",")]


def time_steps(rt, engine, ops, variants: dict, cases: list[tuple[int, int]], chunk_rows, position) -> None:
    """Each variant (ops settings) over each case (decode rows, x): a mixed step's device ms per kernel."""
    rng = np.random.default_rng(0)
    for name, settings in variants.items():
        with patched(ops, **settings):
            ops.clear_plans(rt)
            for batch, x in cases:
                engine._graphs.clear()  # recorded under the other settings
                rows = chunk_rows(x)
                chunk = (list(rng.integers(0, engine.config.vocab_size, rows)), batch, 0) if rows else None
                positions = [position(x)] * batch

                def step(batch=batch, positions=positions, chunk=chunk) -> None:
                    engine.decode([1] * batch, list(range(batch)), positions, prompt=chunk, argmax=True)

                step()
                row = measure(rt, step, 10)
                print(json.dumps({"variant": name, "batch": batch, "prompt": rows, "position": positions[0], **row}))
        ops.clear_plans(rt)


def add_rmsnorm_launches(rt, ops) -> None:
    d, rng = 4096, np.random.default_rng(0)
    for n in (1, 16, 32):
        x, residual = (rt.from_numpy(rng.standard_normal((n, d)).astype(np.float32)) for _ in range(2))
        weight, out = rt.from_numpy(rng.standard_normal(d).astype(np.float32)), rt.empty((n, d))
        for wg in (128, 256, 512, 1024):
            with patched(ops, NORM_WG=wg):
                ops.add_rmsnorm(rt, x, residual, weight, 1e-5, out)
                samples = []
                with rt.profiling():
                    for _ in range(5):
                        rt.kernel_seconds()
                        for _ in range(64):
                            ops.add_rmsnorm(rt, x, residual, weight, 1e-5, out)
                        samples.append(sum(rt.kernel_seconds().values()) / 64 * 1e6)
            print(json.dumps({"rows": n, "NORM_WG": wg, "us_per_launch": round(statistics.median(samples), 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=("attention", "norm-tail", "add-rmsnorm"))
    parser.add_argument("--cases", help="decode rows:position (attention) or decode rows:prompt rows (norm-tail)")
    parser.add_argument("--layers", type=int, help="fewer layers than Llama-2-7B's 32 (smoke runs)")
    parser.add_argument("--group", type=int, default=32, help="int4 group size (GGUF Q4_0's is 32)")
    args = parser.parse_args()
    from perfx_opencl import ops

    rt = get_registry().open_runtime("opencl")
    if args.experiment == "add-rmsnorm":
        add_rmsnorm_launches(rt, ops)
        return
    config = dataclasses.replace(LLAMA2_7B, n_layers=args.layers) if args.layers else LLAMA2_7B
    weights = random_llama_weights(config, group_size=args.group, seed=0)
    engine = LlamaModel(config, weights, rt, n_slots=17, max_seq_len=2048, prefill_chunk=48, kv_dtype="float16")
    if args.experiment == "attention":
        variants = {
            "one launch": {"MIXED_ATTENTION_MAX_GROUPS": 1 << 30},
            "two launches": {"MIXED_ATTENTION_MAX_GROUPS": 0},
        }
        cases = pairs(args.cases or ATTENTION_CASES)
        time_steps(rt, engine, ops, variants, cases, chunk_rows=lambda x: 16, position=lambda x: x)
    else:
        variants = {
            "separate add_rmsnorm": {"MMA_ADD_NORM_N": 16},
            "tail, 2 tiles x 2 groups": {},
            "tail, 3-4 tiles": {"MMA_ADD_NORM_SHAPE_N": 32},
        }
        cases = pairs(args.cases or NORM_TAIL_CASES)
        time_steps(rt, engine, ops, variants, cases, chunk_rows=lambda x: x, position=lambda x: 100)


if __name__ == "__main__":
    main()
