#!/usr/bin/env python
"""Time to first token of a request whose prompt shares a long prefix with the previous one (prefix caching).

    python benchmarks/bench_prefix_cache.py                       # starts `perfx serve` (bundled SmolLM2, numpy)
    python benchmarks/bench_prefix_cache.py --url http://127.0.0.1:8000 --prefix-tokens 800 --trials 5

Each trial takes a new ~``--prefix-tokens`` prefix (consecutive passages of the held-out text perfx ships, so no
slot holds it yet), sends ``prefix + A`` (cold: the whole prompt is prefilled), then ``prefix + B`` (warm: only
what follows the prefix is), both streamed with max_tokens 1, and reads the time from sending to the first
chunk. Prints each trial, the medians and warm / cold, and the server's cached-token counter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_serving import wait_until_healthy  # this folder is on sys.path when a script here runs

HELDOUT = Path(__file__).resolve().parents[1] / "perfx_core" / "data" / "heldout.txt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", help="model for the server this script starts (default: the bundled one)")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--prefix-tokens", type=int, default=800, help="about this many tokens of shared prefix")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def first_token_seconds(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def cached_tokens(client: httpx.Client, url: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith("perfx_prompt_tokens_cached_total "):
            return float(line.split()[1])
    return 0.0


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = 8765
    command = [sys.executable, "-m", "perfx_core.serving", "--port", str(port), "--backend", args.backend]
    command += ["--max-running", "2", "--log-level", "warning", *([args.model] if args.model else [])]
    server = subprocess.Popen(command, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(server, url, 300)
    return server, url


def main(argv=None) -> int:
    args = parse_args(argv)
    server, url = (None, args.url) if args.url else start_server(args)
    words = HELDOUT.read_text().split()
    per_prefix = int(args.prefix_tokens * 0.75)  # ~1.3 tokens a word in English
    try:
        with httpx.Client(timeout=300) as client:
            tokenize = client.post(url + "/tokenize", json={"prompt": " ".join(words[:per_prefix])})
            first_token_seconds(client, url, "Warm-up.")  # first-request costs out of the measured ones
            cold, warm = [], []
            cached_before = cached_tokens(client, url)
            for trial in range(args.trials):
                start = (trial * per_prefix) % max(1, len(words) - per_prefix)
                prefix = f"[{trial}] " + " ".join(words[start : start + per_prefix])
                cold.append(first_token_seconds(client, url, prefix + " First question: why?"))
                warm.append(first_token_seconds(client, url, prefix + " Second question: how?"))
                print(f"trial {trial}: cold {cold[-1] * 1000:.1f} ms, warm {warm[-1] * 1000:.1f} ms", file=sys.stderr)
            cached = cached_tokens(client, url) - cached_before
    finally:
        if server is not None:
            server.terminate()
            server.wait(15)
    result = {
        "prefix_tokens": tokenize.json().get("count") if tokenize.status_code == 200 else None,
        "cold_ttft_ms": [round(t * 1000, 2) for t in cold],
        "warm_ttft_ms": [round(t * 1000, 2) for t in warm],
        "median_cold_ms": round(statistics.median(cold) * 1000, 2),
        "median_warm_ms": round(statistics.median(warm) * 1000, 2),
        "warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 3),
        "cached_tokens_per_warm_request": cached / max(1, args.trials),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"prefix {result['prefix_tokens']} tokens: TTFT cold {result['median_cold_ms']} ms, warm "
            f"{result['median_warm_ms']} ms, warm/cold {result['warm_over_cold']}x "
            f"({result['cached_tokens_per_warm_request']:.0f} prompt tokens from the cache per warm request)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
