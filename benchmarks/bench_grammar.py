#!/usr/bin/env python
"""The grammar engine's cost per token (structured output, perfx_core.grammar) on a real model's vocabulary.

    python benchmarks/bench_grammar.py                   # the bundled SmolLM2 (49,152 tokens), numpy backend
    python benchmarks/bench_grammar.py --runs 5 --max-tokens 96 --json

For each grammar (any JSON object, a JSON schema, tool calls of two functions, tools with ``auto``), the model
generates ``--runs`` outputs under it (temperature 1, one seed each). Those token sequences are then replayed
through fresh constraints with nothing else running, timing per token:
- ``mask_us``: computing the mask of allowed next tokens (llguidance's work for the state the output left);
- ``apply_us``: unpacking it and setting the disallowed logits to -inf (perfx's numpy part);
- ``mask_cpu_us``, ``apply_cpu_us``: the same as this thread's CPU time, which other jobs on a busy machine
  inflate far less than the wall-clock figures;
- ``batch8_mask_us``: masks of 8 sequences computed together (``prefetch_masks``, the server's batched decode),
  per sequence.
It also prints the model's own decode time per token with and without the grammar (noisy on a shared machine),
and the one-off cost of building the engine's view of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import perfx_core
from perfx_core.grammar import engine_tokenizer, json_object_grammar, json_schema_grammar, prefetch_masks
from perfx_core.tools import tool_choice

MOVIE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "actors": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
    },
    "required": ["title", "year", "genre", "actors"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model (default: the bundled SmolLM2)")
    p.add_argument("--runs", type=int, default=3, help="outputs generated per grammar")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(ordered), 1),
        "p50": round(ordered[len(ordered) // 2], 1),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1),
    }


def replay(grammar, sequences: list[list[int]], vocab: int) -> dict:
    """Per-token mask and apply times over ``sequences``, then the batched masks."""
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    mask_us, mask_cpu_us, apply_us, apply_cpu_us = [], [], [], []
    for tokens in sequences:
        constraint = grammar.constraint()
        for token in tokens:
            start, cpu = time.perf_counter(), time.thread_time()
            constraint._packed()
            mask_us.append((time.perf_counter() - start) * 1e6)
            mask_cpu_us.append((time.thread_time() - cpu) * 1e6)
            start, cpu = time.perf_counter(), time.thread_time()
            masked = constraint.mask_logits(logits)
            apply_us.append((time.perf_counter() - start) * 1e6)
            apply_cpu_us.append((time.thread_time() - cpu) * 1e6)
            assert np.isfinite(masked[token]), "a replayed token must be allowed"
            constraint.accept(token)
    batch_us = []
    longest = max(len(t) for t in sequences)
    group = [grammar.constraint() for _ in range(8)]
    tokens_of = [sequences[i % len(sequences)] for i in range(8)]
    for step in range(longest):
        live = [(c, t[step]) for c, t in zip(group, tokens_of, strict=True) if step < len(t)]
        start = time.perf_counter()
        prefetch_masks([c for c, _ in live])
        if len(live) > 1:
            batch_us.append((time.perf_counter() - start) * 1e6 / len(live))
        for c, token in live:
            c.accept(token)
    return {
        "tokens": len(mask_us),
        "mask_us": percentiles(mask_us),
        "mask_cpu_us": percentiles(mask_cpu_us),
        "apply_us": percentiles(apply_us),
        "apply_cpu_us": percentiles(apply_cpu_us),
        "batch8_mask_us": percentiles(batch_us) if batch_us else None,
    }


def decode_ms_per_token(model, prompt: list[int], max_tokens: int, seed: int, **kwargs) -> tuple[float, list[int]]:
    generation = model.generate(prompt, max_tokens=max_tokens, temperature=1.0, seed=seed, **kwargs)
    generation.run()
    stats = generation.stats
    ms = 1000 / stats.decode_tokens_per_s if stats.decode_tokens_per_s else float("nan")
    return ms, generation.token_ids


def main(argv=None) -> int:
    args = parse_args(argv)
    model = perfx_core.load(args.model, context_length=1024)
    tok = model.tokenizer
    start = time.perf_counter()
    engine_tokenizer(tok)
    view_s = time.perf_counter() - start
    tools_required = tool_choice(TOOLS, "required")
    tools_auto = tool_choice(TOOLS, "auto")
    cases = {
        "json_object": (json_object_grammar(tok), "Describe a cat as a JSON object.", None),
        "json_schema": (json_schema_grammar(MOVIE, tok), "Give me a movie as JSON.", None),
        "tools_required": (tools_required.grammar(tok), "What is the weather in Paris?", tools_required),
        "tools_auto": (tools_auto.grammar(tok), "What is the weather in Paris?", tools_auto),
    }
    results: dict = {"model": model.path.name, "vocab": tok.vocab_size, "engine_tokenizer_s": round(view_s, 3)}
    for name, (grammar, question, tools) in cases.items():
        messages = [{"role": "user", "content": question}]
        prompt = model.chat_prompt_ids(messages, tools=tools)
        sequences, with_ms, without_ms = [], [], []
        for seed in range(args.runs):
            ms, tokens = decode_ms_per_token(model, prompt, args.max_tokens, seed, grammar=grammar)
            with_ms.append(ms)
            sequences.append(tokens)
            without_ms.append(decode_ms_per_token(model, prompt, args.max_tokens, seed)[0])
        results[name] = {
            **replay(grammar, sequences, tok.vocab_size),
            "decode_ms_per_token_with_grammar": round(statistics.median(with_ms), 2),
            "decode_ms_per_token_without": round(statistics.median(without_ms), 2),
        }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{results['model']}: {results['vocab']} tokens; engine tokenizer built in {view_s:.2f} s")
        for name in cases:
            r = results[name]
            mask, cpu, batch = r["mask_us"], r["mask_cpu_us"], r["batch8_mask_us"]
            print(
                f"{name:15s} {r['tokens']:4d} tokens  mask {mask['mean']:7.1f} us (p50 {mask['p50']:.1f},"
                f" p99 {mask['p99']:.1f}; CPU {cpu['mean']:.1f}, p50 {cpu['p50']:.1f})"
                f"  apply {r['apply_us']['mean']:5.1f} us (CPU {r['apply_cpu_us']['mean']:.1f})"
                f"  batch-8 mask {batch['mean'] if batch else float('nan'):6.1f} us/seq"
                f"  decode {r['decode_ms_per_token_with_grammar']:.1f} ms/token"
                f" (without {r['decode_ms_per_token_without']:.1f})"
            )
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
