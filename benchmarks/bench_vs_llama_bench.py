#!/usr/bin/env python
"""perfx bench next to llama.cpp's llama-bench on one GGUF: prefill 512 and 2048, decode of 128 tokens after
512 and 2048 (llama-bench's tg128 at that depth), peak GPU memory, each with the perfx / llama.cpp ratio.

    python benchmarks/bench_vs_llama_bench.py --model 7b.gguf --llama-bench llama.cpp/build/bin/llama-bench \\
        --backend opencl --repeat 3 [--llama-args "-ngl 99 -fa 1"] [--json out.json]

The two run one after the other in this order, each in its own processes: llama-bench's prompt tests
(``-p 512,2048 -n 0``), its decode tests (``-p 0 -n 128 -d 512,2048``), then ``perfx bench -p 512 -g 128`` and
``-p 2048 -g 128`` (``--repeat`` runs each; llama-bench reports the mean, perfx bench the median). Where
``nvidia-smi`` exists, the GPU memory in use is sampled every 0.1 s and each phase's peak is printed (the
driver's own use, measured before anything starts, is shown too: it is in both engines' peaks). On a CPU the
same script compares the two on threads instead: pass ``--backend numpy`` and ``--llama-args "-t 2"``.

The table it prints is the one docs/opencl.md quotes; docs/results/h200_side_by_side_7b_q4_0.txt holds a run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time

PROMPTS = (512, 2048)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF both engines run")
    p.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    p.add_argument("--llama-args", default="-ngl 99 -fa 1", help="more llama-bench options (default: %(default)s)")
    p.add_argument("--backend", default="opencl", help="perfx backend (default: opencl)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each test in both engines (default: 3)")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


class GpuMemory:
    """nvidia-smi's memory.used (MiB) sampled in a thread; peak(phase) over the samples taken during a phase."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.phases: dict[str, tuple[float, float]] = {}
        self._proc = None
        if shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "100"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), float(line.split()[0])))
            except (ValueError, IndexError):
                continue

    def phase(self, name: str, fn):
        start = time.time()
        try:
            return fn()
        finally:
            time.sleep(0.3)  # the last samples of the phase
            self.phases[name] = (start, time.time())

    def peak(self, name: str) -> float | None:
        start, end = self.phases[name]
        inside = [mib for t, mib in self.samples if start <= t <= end]
        return max(inside) if inside else None

    def idle(self) -> float | None:
        return self.samples[0][1] if self.samples else None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def llama_bench(args, tests: list[str]) -> list[dict]:
    cmd = [args.llama_bench, "-m", args.model, "-r", str(args.repeat), "-o", "json", *tests]
    cmd += shlex.split(args.llama_args)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def perfx_bench(args, prompt_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "perfx_core.cli", "bench", "-m", args.model, "-b", args.backend, "--json", "-q"]
    cmd += ["-p", str(prompt_tokens), "-g", str(args.gen_tokens), "-r", str(args.repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"perfx bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def llama_speed(results: list[dict], prompt: int, gen: int, depth: int) -> float:
    for r in results:
        if (r.get("n_prompt"), r.get("n_gen"), r.get("n_depth", 0)) == (prompt, gen, depth):
            return float(r["avg_ts"])
    raise SystemExit(f"llama-bench gave no result for n_prompt={prompt} n_gen={gen} n_depth={depth}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    memory = GpuMemory()
    time.sleep(0.5)
    try:
        prompts = ",".join(map(str, PROMPTS))
        depths = ",".join(map(str, PROMPTS))
        lp = memory.phase("llama prefill", lambda: llama_bench(args, ["-p", prompts, "-n", "0"]))
        ld = memory.phase(
            "llama decode", lambda: llama_bench(args, ["-p", "0", "-n", str(args.gen_tokens), "-d", depths])
        )
        px = {p: memory.phase(f"perfx {p}", lambda p=p: perfx_bench(args, p)) for p in PROMPTS}
    finally:
        memory.close()
    rows = []
    for p in PROMPTS:
        rows.append((f"prefill {p}, tok/s", llama_speed(lp, p, 0, 0), px[p]["prefill_tokens_per_s"]))
    for p in PROMPTS:
        rows.append(
            (
                f"decode tg{args.gen_tokens} at depth {p}, tok/s",
                llama_speed(ld, 0, args.gen_tokens, p),
                px[p]["decode_tokens_per_s"],
            )
        )
    peaks = {"llama": max(filter(None, (memory.peak("llama prefill"), memory.peak("llama decode"))), default=None)}
    peaks["perfx"] = max(filter(None, (memory.peak(f"perfx {p}") for p in PROMPTS)), default=None)
    if memory.samples:  # a GPU (nvidia-smi) to sample
        rows.append(("peak GPU memory, MiB (nvidia-smi)", peaks["llama"], peaks["perfx"]))

    print(f"{'':44} {'llama.cpp':>12} {'perfx':>12} {'perfx / llama.cpp':>18}")
    for name, llama, perfx in rows:
        shown = [f"{v:,.1f}" if v is not None else "-" for v in (llama, perfx)]
        print(f"{name:44} {shown[0]:>12} {shown[1]:>12} {ratio(perfx, llama):>18}")
    if memory.samples:
        print(f"(GPU memory before either ran: {memory.idle()} MiB, in both peaks)")
    llama_build = f"{lp[0].get('build_commit', '?')} on {lp[0].get('backends', '?')}"
    print(f"perfx load_s {px[PROMPTS[0]]['load_s']:.2f}; llama.cpp build {llama_build}")
    result = {
        "model": args.model,
        "backend": args.backend,
        "rows": [{"measure": n, "llama_cpp": a, "perfx": b} for n, a, b in rows],
        "llama_bench": lp + ld,
        "perfx_bench": {str(p): px[p] for p in PROMPTS},
        "gpu_memory_idle_mib": memory.idle(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
