#!/usr/bin/env python
"""What the OpenCL runtime holds on the device during ``perfx bench``, buffer by buffer, and (on an NVIDIA GPU) what
nvidia-smi says this process uses beside it: the driver's own share (context, kernels' code and local memory).

    python benchmarks/opencl_memory.py --model 7b.gguf -p 2048 -g 128 [--backend opencl] [--json out.json]

Every device buffer the runtime allocates is recorded with the call chain that asked for it; at each stage (device
opened, model loaded, warmed up, prompt prefilled, tokens decoded) it prints the live bytes by call chain, the
largest buffers, and this process's GPU memory from ``nvidia-smi --query-compute-apps`` where that exists. The
runs are the ones ``perfx bench -p P -g G -r 1`` makes (a 16-token warm-up, then the prompt and the decode).
PERFX_OPENCL_* variables apply as usual; ``--prefill-chunk`` and ``--kv-dtype`` force what a GPU would choose
when this runs on PoCL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import weakref

import numpy as np

# the runtime's own memory helpers: a buffer is named by who called them
_HELPERS = {"_allocate", "empty", "from_numpy", "scratch", "zeroed_ints", "upload_ints", "_transposed", "view"}


def _site() -> str:
    names = []
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.name in _HELPERS and not names:
            continue
        names.append(frame.name)
        if len(names) == 3:
            break
    return " < ".join(names)


class Recorder:
    def __init__(self):
        self.live: dict[int, tuple[str, int, tuple]] = {}
        self.total = 0
        self.peak = 0
        self.peak_by_site: dict[str, int] = {}
        self._n = 0

    def add(self, alloc, nbytes: int, site: str, shape: tuple) -> None:
        self._n += 1
        key = self._n
        self.live[key] = (site, nbytes, shape)
        self.total += nbytes
        weakref.finalize(alloc, self._drop, key)
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_site = self.by_site()

    def _drop(self, key: int) -> None:
        site, nbytes, _ = self.live.pop(key)
        self.total -= nbytes

    def by_site(self) -> dict[str, int]:
        sites: dict[str, int] = {}
        for site, nbytes, _ in self.live.values():
            sites[site] = sites.get(site, 0) + nbytes
        return sites


def gpu_mib() -> float | None:
    """This process's GPU memory (MiB) as nvidia-smi reports it, or None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    time.sleep(0.2)
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="opencl")
    p.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    p.add_argument("-g", "--gen-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the runtime's")
    p.add_argument("--kv-dtype", default=None, help="default: the runtime's")
    p.add_argument("--top", type=int, default=12, help="largest live buffers listed per stage")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from perfx_core.api import load
    from perfx_core.plugins import get_registry
    from perfx_opencl import runtime as clrt

    rec = Recorder()
    allocate = clrt.OpenCLRuntime._allocate

    def recorded(self, nbytes, hostbuf=None):
        alloc = allocate(self, nbytes, hostbuf)
        rec.add(alloc, nbytes, _site(), tuple(hostbuf.shape) if hostbuf is not None else (nbytes,))
        return alloc

    clrt.OpenCLRuntime._allocate = recorded
    stages = []

    def stage(name: str, rt=None) -> None:
        if rt is not None:
            rt.synchronize()
        import gc

        gc.collect()
        entry = {"stage": name, "tracked_bytes": rec.total, "gpu_mib": gpu_mib(), "by_site": rec.by_site()}
        stages.append(entry)
        tracked = rec.total / 2**20
        gpu = entry["gpu_mib"]
        print(f"\n== {name}: runtime buffers {tracked:,.1f} MiB; nvidia-smi {gpu} MiB"
              + (f" (driver's own {gpu - tracked:,.1f})" if gpu else ""))
        for site, nbytes in sorted(entry["by_site"].items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {nbytes / 2**20:10.2f} MiB  {site}")

    print(f"before opening: nvidia-smi {gpu_mib()} MiB")
    # The device alone (context and probe kernels), before any model: what a process costs the driver.
    rt0 = get_registry().open_runtime(args.backend, None)
    stage("device opened", rt0)
    model = load(
        args.model,
        backend=args.backend,
        context_length=args.prompt_tokens + args.gen_tokens,
        prefill_chunk=args.prefill_chunk,
        kv_dtype=args.kv_dtype,
    )
    engine = model.engine
    print(f"KV cache {engine.cache_spec.shape} {engine.cache_spec.dtype}; prefill chunk {engine.prefill_chunk}")
    stage("loaded", engine.rt)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, size=args.prompt_tokens).tolist()

    def run(tokens, gen):
        logits = engine.prefill(tokens, slot=0)
        token = int(np.argmax(logits))
        for i in range(gen - 1):
            token = int(np.argmax(engine.decode([token], [0], [len(tokens) + i])[0]))

    run(prompt[:16], 3)
    stage("warmed up (16 + 3 tokens)", engine.rt)
    engine.prefill(prompt, slot=0)
    stage(f"prefilled {args.prompt_tokens}", engine.rt)
    run(prompt, args.gen_tokens)
    stage(f"prefill {args.prompt_tokens} + decode {args.gen_tokens}", engine.rt)
    print(f"\n== peak of runtime buffers: {rec.peak / 2**20:,.1f} MiB; there, by call chain:")
    for site, nbytes in sorted(rec.peak_by_site.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {nbytes / 2**20:10.2f} MiB  {site}")
    largest = sorted(rec.live.values(), key=lambda v: -v[1])[: args.top]
    print("\n== largest live buffers at the end")
    for site, nbytes, shape in largest:
        print(f"  {nbytes / 2**20:10.2f} MiB  {shape}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": stages, "peak_bytes": rec.peak, "peak_by_site": rec.peak_by_site}, f, indent=1)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
