#!/usr/bin/env python
"""How long a model takes to load until its first token can be generated, and until `perfx serve` is healthy.

    python benchmarks/bench_load.py MODEL.gguf --backend opencl --starts 2 --serve

Each start is a new Python process (as `perfx run` is): it times the import, ``perfx_core.load`` (reading and
placing the weights; the backend's share is ``backend_load_stats``), and the first prefill (which builds or reads
the compiled kernels: the first start on a machine builds them, later ones read the program cache). It prints
one JSON line per start with the peak host memory (RSS, mapped file pages included) and the device bytes
allocated, then, with ``--serve``, the seconds from starting `perfx serve` until /health answers 200. Put the
file in the page cache first (``cat MODEL > /dev/null``) to time what llama.cpp's figures assume.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

ONE_START = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import perfx_core
out = {"import_s": time.perf_counter() - t0}
t = time.perf_counter()
model = perfx_core.load(sys.argv[1], backend=sys.argv[2], context_length=int(sys.argv[3]))
out["load_s"] = time.perf_counter() - t
t = time.perf_counter()
model.engine.prefill([model.tokenizer.bos_id or 0], slot=0)
model.engine.rt.to_numpy(model.engine.norm)  # waits for the device
out["first_token_s"] = time.perf_counter() - t
out["ready_s"] = time.perf_counter() - t0
out["backend_load_stats"] = dict(getattr(model.engine.rt, "load_stats", {}))
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out["device_bytes"] = model.engine.rt.allocated_bytes
print(json.dumps(out))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model file or directory")
    p.add_argument("--backend", default="numpy", help="backend name (see `perfx backends`)")
    p.add_argument("--context", type=int, default=2176, help="KV-cache length in tokens")
    p.add_argument("--starts", type=int, default=2, help="processes started one after another (default 2)")
    p.add_argument("--serve", action="store_true", help="also time `perfx serve` until /health is 200")
    p.add_argument("--port", type=int, default=8897, help="port for --serve")
    return p.parse_args(argv)


def time_serve(args) -> float:
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "perfx_core.cli", "serve", args.model, "--backend", args.backend,
         "--port", str(args.port), "--context", str(args.context)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"perfx serve exited with {server.returncode} before it was healthy")
    finally:
        server.terminate()
        server.wait(30)


def main(argv=None) -> None:
    args = parse_args(argv)
    for start in range(1, args.starts + 1):
        run = subprocess.run(
            [sys.executable, "-c", ONE_START, args.model, args.backend, str(args.context)],
            capture_output=True, text=True, env=os.environ,
        )  # fmt: skip
        if run.returncode:
            raise SystemExit(f"start {start} failed:\n{run.stderr[-4000:]}")
        print(json.dumps({"start": start, **json.loads(run.stdout.strip().splitlines()[-1])}), flush=True)
    if args.serve:
        print(json.dumps({"serve_healthy_s": round(time_serve(args), 2)}), flush=True)


if __name__ == "__main__":
    main()
