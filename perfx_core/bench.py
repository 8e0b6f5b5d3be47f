"""``perfx bench``: prefill and decode speed, time to first token and memory of one model on one backend.

The prompt is seeded random token ids (speed does not depend on which tokens), decode is greedy as `perfx run`
decodes (the engine's argmax, each step queued before the previous token is read) and ignores end-of-sequence so
every run does the same work. A short warm-up first lets backends finish
one-time work (compiling kernels, building weight layouts) outside the timed runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from . import progress, row_parts
from .errors import InvalidArgumentError
from .measure import peak_host_bytes


def _timed_run(engine, prompt: list[int], gen_tokens: int, profile: bool) -> dict[str, Any]:
    ops = engine.rt.ops
    start = time.perf_counter()
    logits = engine.prefill(prompt, slot=0)
    token = int(np.argmax(logits))
    engine.rt.synchronize()
    prefill_s = time.perf_counter() - start
    if profile:
        ops.start_profiling()
    try:
        decode_start = time.perf_counter()
        # Greedy decode as `perfx run` does it: the argmax picked by the engine (on the device where it can),
        # each step queued before the previous one's token is read and fed from its pick.
        steps = gen_tokens - 1
        ahead = engine.queue_decode([token], [0], [len(prompt)], argmax=True) if steps > 0 else None
        for i in range(steps):
            step = ahead
            if i + 1 < steps:
                ahead = engine.queue_decode(step, [0], [len(prompt) + i + 1], argmax=True)
            token = int(step.result()[0])
        engine.rt.synchronize()
        decode_s = time.perf_counter() - decode_start
    finally:
        profile_data = ops.stop_profiling() if profile else None
    result: dict[str, Any] = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": len(prompt) / prefill_s,
        "decode_tokens_per_s": (gen_tokens - 1) / decode_s if gen_tokens > 1 else None,
        "time_to_first_token_s": prefill_s,
    }
    if profile_data is not None:
        steps = max(1, gen_tokens - 1)
        result["decode_op_profile_ms_per_token"] = {
            name: round(1e3 * v["seconds"] / steps, 4) for name, v in profile_data.as_dict().items()
        }
    return result


def weight_bytes(engine) -> dict[str, dict[str, float]] | None:
    """Per kind of matrix, after the runs (layouts and copies the ops made on first use included): how many
    weights, the bytes the backend holds for them, and bytes per weight. None where the backend cannot tell."""
    layers = engine.layers
    kinds = {
        "qkv": [layer.w_qkv for layer in layers],
        "wo": [layer.wo for layer in layers],
        "gate_up": [layer.w_gate_up for layer in layers],
        "down": [layer.w_down for layer in layers],
        "embedding": [engine.embedding],
    }
    if engine.output is not engine.embedding:
        kinds["output"] = [engine.output]
    report = {}
    for kind, handles in kinds.items():
        sizes = [row_parts.weight_bytes(engine.rt, h) for h in handles]
        if any(s is None for s in sizes):
            return None
        weights = sum(h.shape[0] * h.shape[1] for h in handles)
        report[kind] = {"weights": weights, "bytes": sum(sizes), "bytes_per_weight": round(sum(sizes) / weights, 3)}
    return report


def held_weight_bytes(model_path: str, backend: str) -> dict[str, dict[str, float]] | None:
    """weight_bytes of ``model_path`` on ``backend`` once every layout exists. The NumPy backend's ops (the numba
    plugin's) make theirs on first use, so it is measured after a short run; the others place every weight at
    load, and are measured without running (on PoCL a run would first compile every kernel)."""
    if backend == "numpy":
        return run_bench(model_path, backend=backend, prompt_tokens=8, gen_tokens=2, repeat=1)["weight_bytes"]
    from .api import load

    model = load(model_path, backend=backend, context_length=64)
    try:
        return weight_bytes(model.engine)
    finally:
        model.close()


def run_bench(
    model_path: str | None = None,
    backend: str = "numpy",
    device: int | str | None = None,
    prompt_tokens: int = 128,
    gen_tokens: int = 64,
    repeat: int = 3,
    profile: bool = False,
    seed: int = 0,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Load the model, warm up, then time ``repeat`` runs; returns a JSON-ready dict (medians and each run)."""
    from .api import load

    for name, value, low in (("prompt_tokens", prompt_tokens, 1), ("gen_tokens", gen_tokens, 1), ("repeat", repeat, 1)):
        if not isinstance(value, int) or value < low:
            raise InvalidArgumentError(f"{name} must be an integer >= {low}; got {value!r}")
    load_start = time.perf_counter()
    model = load(
        model_path, backend=backend, device=device, context_length=prompt_tokens + gen_tokens, kv_dtype=kv_dtype
    )
    load_s = time.perf_counter() - load_start
    try:
        engine = model.engine
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, model.config.vocab_size, size=prompt_tokens).tolist()

        warm_start = progress.begin("warming up (first calls build kernels and weight layouts)")
        # One whole prefill chunk (the timed prompts' shape: a backend may take another path for it than for a few
        # tokens, e.g. the numba plugin's BLAS path past 32 rows), then at most gen_tokens: the context holds
        # prompt_tokens + gen_tokens positions and no more.
        warm_prompt = prompt[: min(prompt_tokens, engine.prefill_chunk)]
        _timed_run(engine, warm_prompt, min(gen_tokens, 3), profile=False)
        warmup_s = time.perf_counter() - warm_start
        progress.end("warmed up", warm_start)
        load_stats = dict(getattr(engine.rt, "load_stats", {}))  # the backend's share of load_s and warmup_s
        runs = []
        for i in range(repeat):
            runs.append(_timed_run(engine, prompt, gen_tokens, profile))
            decode = runs[-1]["decode_tokens_per_s"]
            progress.log.info(
                "run %d/%d: prefill %.1f tok/s, decode %s tok/s",
                i + 1,
                repeat,
                runs[-1]["prefill_tokens_per_s"],
                "n/a" if decode is None else f"{decode:.1f}",
            )

        def median(key: str) -> float | None:
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else None

        rt = engine.rt
        report: dict[str, Any] = {
            "model": str(model.path),
            "backend": backend,
            "device": rt.device.name,
            "ops": dict(rt.ops.sources),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens,
            "repeat": repeat,
            "kv_dtype": engine.cache_spec.dtype,
            "load_s": load_s,
            # e.g. OpenCL: programs built or read from its program cache, seconds placing weights; the rest of
            # load_s is opening the device and reading and converting the model file.
            "backend_load_stats": load_stats,
            "warmup_s": warmup_s,
            "prefill_tokens_per_s": median("prefill_tokens_per_s"),
            "decode_tokens_per_s": median("decode_tokens_per_s"),
            "time_to_first_token_s": median("time_to_first_token_s"),
            "peak_host_bytes": peak_host_bytes(),
            "backend_bytes": rt.allocated_bytes,
            "backend_peak_bytes": rt.peak_allocated_bytes,
            "weight_bytes": weight_bytes(engine),
            "runs": runs,
        }
    finally:
        model.close()
    return report
