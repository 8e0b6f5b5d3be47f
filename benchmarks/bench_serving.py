"""Load-test `perfx serve` on localhost: requests/s, output tokens/s, TTFT and inter-token latency per concurrency.

    python benchmarks/bench_serving.py                      # starts its own server (the default model, numpy)
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --api-key KEY
    PERFX_DISABLE_PLUGINS=lowmem-int4 python benchmarks/bench_serving.py --concurrency 1,4,16 --max-tokens 32
    python benchmarks/bench_serving.py --backend opencl --model m.gguf --trace-steps steps.jsonl
    python benchmarks/bench_serving.py --ray-replicas 2 --replica-cpus 1   # perfx serve --ray, two engine replicas

Prints a table per concurrency level: requests, failures, requests/s, output tokens/s, TTFT p50/p99 and inter-token
latency p50/p99 (ms), the share of the wall time the engine was busy, the scheduler's steps by kind, the server's
own inter-token p50/p99; then each level's ratios to concurrency 1 of tokens/s and p99 inter-token latency
(--json: all as JSON).

Bounded on purpose: a fixed number of streaming /v1/completions requests per concurrency level (greedy,
``ignore_eos`` so every request generates exactly --max-tokens tokens), no new requests after --time-limit
seconds, and only loopback addresses. Inter-token latency is the gap between consecutive streamed chunks.

The client is built not to add its own delays to the gaps it measures: at concurrency 16 a step's 16 chunks
arrive together and one Python loop reads them in turn. It reads them with aiohttp (a C HTTP parser), stamps each
line as it arrives and parses the JSON only after the stream ends, and spreads the streams over client
processes (--client-processes, by default one per 4 streams, at most a quarter of the CPUs). The server's own
inter-token histogram, which no client is in, is printed next to it ("server side").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_REQUESTS = 32  # per level by default
STREAMS_PER_CLIENT = 4  # streams one client process reads, by default
STEP_TRACE_DIR = Path(__file__).resolve().parent / "step_trace"  # --trace-steps
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story {i}:"


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> RequestResult:
    body = {
        "prompt": PROMPT.format(i=i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(ok=False)
    arrivals: list[tuple[float, bytes]] = []  # each SSE line with when it arrived; parsed once the stream ends
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return result
        async for line in response.content:
            arrivals.append((time.perf_counter(), line))
    last = None
    for now, raw in arrivals:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:  # the server failed the request mid-stream
            result.error = f"stream error: {str(chunk['error'])[:200]}"
            return result
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            if last is None:
                result.ttft_s = now - start
            else:
                result.gaps_s.append(now - last)
            last = now
    result.ok = result.output_tokens > 0
    return result


async def run_requests(
    url: str, headers: dict, concurrency: int, indices: list[int], max_tokens: int, deadline: float
) -> list[RequestResult]:
    """``concurrency`` workers send the requests ``indices`` one after another until done or past ``deadline``
    (time.monotonic: one clock for every client process)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in indices:
        queue.put_nowait(i)
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=concurrency + 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)  # per read, not per stream: CPU servers are slow
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    results.append(await one_request(session, url, i, max_tokens))
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                    results.append(RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def client_process(*args) -> list[RequestResult]:
    return asyncio.run(run_requests(*args))


def default_client_processes(concurrency: int) -> int:
    """One client process per STREAMS_PER_CLIENT streams, leaving three quarters of the CPUs to the server."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(-(-concurrency // STREAMS_PER_CLIENT), cpus // 4))


def run_level(
    url: str,
    headers: dict,
    concurrency: int,
    n_requests: int,
    max_tokens: int,
    time_limit: float,
    pool: ProcessPoolExecutor | None = None,
    processes: int = 1,
) -> dict:
    """One concurrency level. With ``pool``, its streams are spread over ``processes`` client processes: one
    Python process reading many streams timestamps each chunk only once it gets to it, which adds its own
    queueing to the measured gaps."""
    deadline = time.monotonic() + time_limit
    start = time.perf_counter()
    processes = max(1, min(processes, concurrency)) if pool is not None else 1
    if processes == 1:
        results = asyncio.run(run_requests(url, headers, concurrency, list(range(n_requests)), max_tokens, deadline))
    else:
        shares = [concurrency // processes + (p < concurrency % processes) for p in range(processes)]
        # Requests in proportion to each process's streams, so that all of them run out at about the same time.
        owner = [p for p, share in enumerate(shares) for _ in range(share)]
        requests = [[i for i in range(n_requests) if owner[i % concurrency] == p] for p in range(processes)]
        futures = [
            pool.submit(client_process, url, headers, share, requests[p], max_tokens, deadline)
            for p, share in enumerate(shares)
        ]
        results = [r for future in futures for r in future.result()]
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.gaps_s]

    def pct(values: list[float], q: float) -> float | None:  # ms, to 0.01: the ratios to c1 are taken from these
        return round(float(np.percentile(values, q)) * 1e3, 2) if values else None

    return {
        "concurrency": concurrency,
        "client_processes": processes,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
        "ttft_ms_mean": round(float(np.mean(ttft)) * 1e3, 2) if ttft else None,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(gaps, 50),
        "itl_ms_p99": pct(gaps, 99),
    }


def engine_ceiling(model: str | None, backend: str, batches: list[int], steps: int = 16, repeat: int = 3) -> dict:
    """Decode tokens/s of the bare engine (no server) at each batch size, the median of ``repeat`` timings of
    ``steps`` steps: the most batching can give."""
    import perfx_core

    m = perfx_core.load(model, backend=backend, n_slots=max(batches), context_length=64)
    out = {}
    try:
        for b in batches:
            for slot in range(b):
                m.engine.prefill([1, 2, 3], slot, 0)
            m.engine.decode([5] * b, list(range(b)), [3] * b)  # warm-up
            rates = []
            for _ in range(repeat):
                start = time.perf_counter()
                for i in range(steps):
                    m.engine.decode([5] * b, list(range(b)), [4 + i] * b)
                rates.append(b * steps / (time.perf_counter() - start))
            out[f"batch_{b}_tokens_per_s"] = round(statistics.median(rates), 1)
    finally:
        m.close()
    return out


def engine_seconds(url: str, headers: dict) -> dict[str, float]:
    """Counters read from the server's /metrics: seconds its engine has spent per step kind
    (perfx_engine_step_seconds_sum) with the step counts ("<kind>_steps"), the decode rows run ("decode_rows"),
    the steps recorded as graphs ("recordings"), and the server-side histograms of inter-token gaps ("itl_le",
    by bound) and of step seconds ("step_le", by kind, then bound)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    found: dict = {"itl_le": {}, "step_le": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "perfx_engine_step_seconds_sum":
                found[labels["kind"]] = value
            elif name == "perfx_engine_step_seconds_count":
                found[labels["kind"] + "_steps"] = value
            elif name == "perfx_engine_step_seconds_bucket":
                found["step_le"].setdefault(labels["kind"], {})[float(labels["le"])] = value
            elif name in ("perfx_time_to_first_token_seconds_sum", "perfx_time_to_first_token_seconds_count"):
                found["ttft_" + name.rsplit("_", 1)[1]] = value  # the server's own, from request arrival
            elif name == "perfx_inter_token_latency_seconds_bucket":
                found["itl_le"][float(labels["le"])] = value
            elif name == "perfx_decode_batch_size_sum":
                found["decode_rows"] = value
            elif name == "perfx_engine_step_recordings":
                found["recordings"] = value
    return found


def bucket_delta(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    """A cumulative histogram's counts between two scrapes ({upper bound: count})."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative Prometheus histogram ({upper bound: count}), interpolating linearly
    inside the bucket it falls in (as Prometheus' histogram_quantile does); None when it is empty."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if cumulative[bound] >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative[bound] - below, 1e-12)
        lower, below = bound, cumulative[bound]
    return lower


def step_summary(before: dict, after: dict, wall: float) -> dict:
    """Engine busy share per step kind over a level (decode, mixed: decode rows + a prompt chunk, prefill), and
    its steps: count, mean milliseconds; the mean number of decode rows per decode or mixed step; the steps
    recorded during the level; the server's own inter-token p50/p99 (from its histogram: no client in it)."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after if key not in ("itl_le", "step_le")}
    summary: dict = {"engine_busy": {}, "steps": {}}
    for kind in ("decode", "mixed", "prefill"):
        if kind in delta:
            summary["engine_busy"][kind] = round(delta[kind] / wall, 3)
            count = delta.get(kind + "_steps", 0)
            if count:
                summary["steps"][kind] = {"count": int(count), "mean_ms": round(1e3 * delta[kind] / count, 2)}
                step_buckets = bucket_delta(after["step_le"].get(kind, {}), before["step_le"].get(kind, {}))
                p99 = histogram_quantile(0.99, step_buckets)
                if p99 is not None:
                    summary["steps"][kind]["p99_ms"] = round(1e3 * p99, 2)
    batched = sum(summary["steps"].get(kind, {}).get("count", 0) for kind in ("decode", "mixed"))
    if batched and "decode_rows" in delta:
        summary["decode_rows_per_step"] = round(delta["decode_rows"] / batched, 2)
    if "recordings" in delta:
        summary["steps_recorded"] = int(delta["recordings"])
    if delta.get("ttft_count"):  # against the client's mean: what the HTTP path adds before a first token
        summary["server_ttft_ms_mean"] = round(1e3 * delta["ttft_sum"] / delta["ttft_count"], 2)
    itl = bucket_delta(after["itl_le"], before["itl_le"])
    for q in (50, 99):
        value = histogram_quantile(q / 100, itl)
        if value is not None:
            summary[f"server_itl_ms_p{q}"] = round(1e3 * value, 2)
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "perfx_core.serving",
        "--port",
        str(port),
        "--backend",
        args.backend,
        "--max-running",
        str(args.max_running),
        "--max-queue",
        str(max(args.concurrency)),
        "--context",
        str(args.context),
        "--log-level",
        "warning",
    ]
    if args.model:
        command.insert(3, args.model)
    for flag in ("mixed_steps", "overlap_output"):  # None: the server's default (on for GPU devices)
        value = getattr(args, flag)
        if value is not None:
            command.append(f"--{'' if value else 'no-'}{flag.replace('_', '-')}")
    if args.mixed_chunk is not None:
        command += ["--mixed-chunk", str(args.mixed_chunk)]
    if args.ray_replicas:  # perfx serve --ray: engine replicas on a Ray cluster started for this run
        command += ["--ray", "--replicas", str(args.ray_replicas), "--replica-cpus", str(args.replica_cpus)]
    env = {k: v for k, v in os.environ.items() if k != "PERFX_API_KEY"}
    if args.trace_steps:  # step_trace/sitecustomize.py times every scheduler step of the server (its docstring)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(STEP_TRACE_DIR), env.get("PYTHONPATH"))))
        env["PERFX_TRACE_STEPS"] = os.path.abspath(args.trace_steps)
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url, 300 if args.ray_replicas else 120)  # Ray starts its cluster first
    return process, url


def wait_until_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200; SystemExit if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.terminate()
    raise SystemExit(f"the server did not become healthy within {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server on localhost (default: start one)")
    parser.add_argument("--api-key", default=os.environ.get("PERFX_API_KEY"))
    parser.add_argument("--model", help="model for the server this script starts")
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--max-running", type=int, default=16, help="--max-running of the started server")
    parser.add_argument(
        "--ray-replicas", type=int, help="start `perfx serve --ray` with this many engine replicas instead"
    )
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="--replica-cpus of the --ray server")
    parser.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--mixed-steps / --no-mixed-steps of the started server (default: the server's: on for GPUs)",
    )
    parser.add_argument("--mixed-chunk", type=int, help="--mixed-chunk of the started server (default: the server's)")
    parser.add_argument(
        "--overlap-output",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--overlap-output / --no-overlap-output of the started server (default: the server's: on for GPUs)",
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    parser.add_argument(
        "--requests",
        type=int,
        # A p99 needs samples: 4 requests of 64 tokens at concurrency 1 made it the 3rd-largest of 252 gaps.
        help=f"requests per level (default: max({MIN_REQUESTS}, 2 x concurrency))",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--client-processes",
        type=int,
        help="spread each level's streams over this many client processes (default: one per "
        f"{STREAMS_PER_CLIENT} streams, at most a quarter of the CPUs; 1: one asyncio loop reads every stream, "
        "and its own queueing shows in the gaps it measures at high concurrency)",
    )
    parser.add_argument("--time-limit", type=float, default=120, help="seconds per level before no new requests")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--trace-steps",
        metavar="FILE",
        help="time each scheduler step of the started server into FILE (JSON lines; with PERFX_OPENCL_PROFILE=1 "
        "also its kernels) and print their summary at the end: where a serving step's time goes",
    )
    parser.add_argument(
        "--engine-ceiling",
        nargs="?",
        const="1,8,16",
        metavar="BATCHES",
        help="also time the bare engine's decode at these batch sizes (default 1,8,16; in this process, after "
        "the load)",
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address: this load generator only targets localhost")
    if args.client_processes is not None and args.client_processes < 1:
        parser.error("--client-processes must be at least 1")
    if args.trace_steps and args.url:
        parser.error("--trace-steps times a server this script starts: leave out --url")
    process, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    processes = {c: args.client_processes or default_client_processes(c) for c in args.concurrency}
    most = max(processes.values())
    pool = ProcessPoolExecutor(most) if most > 1 else None
    try:
        warm_up = run_level(url, headers, 1, 1, 4, 60)  # first-call costs out of the numbers
        if warm_up["failed"]:
            raise SystemExit(f"the first request failed: {warm_up['errors'][0] or 'no tokens came back'}")
        if pool is not None:  # start the client processes now, not inside the first level's time
            list(pool.map(time.sleep, [0.2] * most))
        levels = []
        for c in args.concurrency:
            before, start = engine_seconds(url, headers), time.perf_counter()
            n_requests = args.requests or max(MIN_REQUESTS, 2 * c)
            level = run_level(url, headers, c, n_requests, args.max_tokens, args.time_limit, pool, processes[c])
            wall, after = time.perf_counter() - start, engine_seconds(url, headers)
            # The share of the level's wall time the engine was running forwards; the rest is host-side work
            # (sampling, streaming, HTTP) or idle time between requests.
            level.update(step_summary(before, after, wall))
            levels.append(level)
        metrics = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    finally:
        if pool is not None:
            pool.shutdown()
        if process is not None:
            process.terminate()
            process.wait(30)
    ceiling = None
    if args.engine_ceiling:
        ceiling = engine_ceiling(args.model, args.backend, [int(b) for b in args.engine_ceiling.split(",")])
    max_batch = next(
        (line.split()[-1] for line in metrics.splitlines() if line.startswith("perfx_max_decode_batch_size ")), "?"
    )
    if args.json:
        print(json.dumps({"levels": levels, "max_decode_batch_size": max_batch, "engine": ceiling}, indent=2))
        return 0
    print(
        f"{'conc':>5} {'reqs':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    for r in levels:
        busy = " ".join(f"{kind} {share:.0%}" for kind, share in sorted(r["engine_busy"].items()))
        print(
            f"{r['concurrency']:>5} {r['requests']:>5} {r['failed']:>4} {r['requests_per_s']:>7} "
            f"{r['output_tokens_per_s']:>9} {r['ttft_ms_p50']!s:>9} {r['ttft_ms_p99']!s:>9} "
            f"{r['itl_ms_p50']!s:>8} {r['itl_ms_p99']!s:>8}  engine busy: {busy}"
        )
        steps = r["steps"]
        if steps:
            rows = f" (mean decode rows per step {r['decode_rows_per_step']})" if "decode_rows_per_step" in r else ""
            print(
                "      steps: "
                + ", ".join(
                    f"{kind} {v['count']} x {v['mean_ms']} ms (p99 {v.get('p99_ms', '?')})"
                    for kind, v in sorted(steps.items())
                )
                + rows
            )
        if "server_itl_ms_p99" in r:
            print(
                f"      server side: ITL p50 {r['server_itl_ms_p50']} ms, p99 {r['server_itl_ms_p99']} ms; "
                f"TTFT mean {r.get('server_ttft_ms_mean', '?')} ms (client {r['ttft_ms_mean']}); "
                f"steps recorded during the level: {r.get('steps_recorded', '?')}; "
                f"client processes: {r['client_processes']}"
            )
        for error in r["errors"]:
            print(f"      error: {error}")
    by_c = {r["concurrency"]: r for r in levels}
    if 1 in by_c and by_c[1]["output_tokens_per_s"] and by_c[1]["itl_ms_p99"]:
        for c in sorted(c for c in by_c if c > 1):
            speedup = by_c[c]["output_tokens_per_s"] / by_c[1]["output_tokens_per_s"]
            itl_ratio = (by_c[c]["itl_ms_p99"] or 0) / by_c[1]["itl_ms_p99"]
            print(f"concurrency {c} vs 1: {speedup:.2f}x output tokens/s, p99 inter-token latency {itl_ratio:.2f}x")
    print(f"largest decode batch the server ran: {max_batch}")
    if ceiling:
        base = ceiling.get("batch_1_tokens_per_s")
        print(
            "bare engine decode (the ceiling): "
            + ", ".join(
                f"{v} tokens/s at batch {k.split('_')[1]}" + (f" ({v / base:.2f}x batch 1)" if base else "")
                for k, v in ceiling.items()
            )
        )
    if args.trace_steps:
        print(f"scheduler steps (trace in {args.trace_steps}):", flush=True)
        subprocess.run([sys.executable, str(STEP_TRACE_DIR / "summarize_steps.py"), args.trace_steps], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
