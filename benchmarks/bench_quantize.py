"""Peak memory and time of `perfx quantize` on a synthetic 1B-shaped Hugging Face checkpoint.

Builds a Llama-3.2-1B-shaped directory (random fp16 weights, written shard by shard with safetensors, so
building it never holds the whole model either), then quantizes it in a fresh process per method and reports
that process's peak memory: tracemalloc's peak (NumPy and Python heap) and ru_maxrss (which also counts pages
of the memory-mapped source that were read, reclaimable page cache rather than memory the run needs).

    python benchmarks/bench_quantize.py [--dir /tmp/perfx-bench-1b] [--awq-layers 2] [--calib-tokens 128] [--json]

AWQ's cost grows with depth and calibration tokens; by default it runs on the first 2 blocks (a separate
directory of the same shape) with 128 calibration tokens, and the per-block time is reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from perfx_core.config import LlamaConfig

LLAMA_1B = LlamaConfig(
    vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
    norm_eps=1e-5, rope_theta=500000.0, context_length=8192, tied_embeddings=True, name="llama-3.2-1b-shape",
)  # fmt: skip

CHILD = r"""
import json, resource, sys, time, tracemalloc
tracemalloc.start()
from perfx_core.quant import quantize
src, out, method, samples, seqlen, calib = sys.argv[1:7]
t = time.perf_counter()
quantize(src, out, method=method, n_samples=int(samples), seqlen=int(seqlen), calib=calib or None, overwrite=True)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "tracemalloc_peak_mib": tracemalloc.get_traced_memory()[1] / 2**20,
                  "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def build(directory: Path, config: LlamaConfig, seed: int = 0) -> None:
    """A random fp16 HF directory, one shard per block (written and released before the next)."""
    from perfx_core.formats.hf import expected_shapes
    from perfx_core.formats.hf_export import write_hf_checkpoint

    if (directory / "config.json").is_file():
        return
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(config)

    def layer(i: int) -> dict[str, np.ndarray]:
        out = {}
        for name, shape in shapes.items():
            if name.endswith("norm"):
                out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float16)
            else:
                out[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float16)
        return out

    def top() -> dict[str, np.ndarray]:
        emb = np.empty((config.vocab_size, config.dim), np.float16)
        for r in range(0, config.vocab_size, 8192):
            emb[r : r + 8192] = (
                rng.standard_normal((min(8192, config.vocab_size - r), config.dim), dtype=np.float32) * 0.02
            )
        return {"token_embedding": emb, "norm": np.ones(config.dim, np.float16)}

    write_hf_checkpoint(directory, config, layer, top, np.float16, layers_per_shard=1)


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A byte-level vocabulary (256 byte tokens, filler names after them, no merges): enough for calibration."""
    from perfx_core.formats.hf_export import write_bpe_tokenizer

    printable = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)]
    printable += [chr(c) for c in range(ord("®"), ord("ÿ") + 1)] + [chr(256 + i) for i in range(68)]
    tokens = printable + [f"<filler_{i}>" for i in range(vocab - len(printable))]
    write_bpe_tokenizer({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []}, directory)


def run(src: Path, out: Path, method: str, samples: int, seqlen: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), method, str(samples), str(seqlen), ""],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"quantize {method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to build the synthetic model (default: a temporary directory)")
    p.add_argument("--awq-layers", type=int, default=2, help="blocks in the AWQ run (0 skips AWQ)")
    p.add_argument("--calib-tokens", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        base = args.dir or Path(tmp)
        results: dict = {"shape": LLAMA_1B.name}
        t = time.perf_counter()
        full = base / "hf-1b"
        if not (full / "config.json").is_file():
            build_dir(full, LLAMA_1B)
        results["build_s"] = time.perf_counter() - t
        results["source_gib"] = sum(f.stat().st_size for f in full.glob("*.safetensors")) / 2**30
        results["rtn"] = run(full, base / "out-rtn", "rtn", 1, 2)
        results["rtn"]["output_gib"] = (base / "out-rtn" / "model.safetensors").stat().st_size / 2**30
        if args.awq_layers:
            part = base / f"hf-1b-{args.awq_layers}l"
            if not (part / "config.json").is_file():
                build_dir(part, replace(LLAMA_1B, n_layers=args.awq_layers))
            seqlen = min(args.calib_tokens, 256)
            awq = run(part, base / "out-awq", "awq", max(1, args.calib_tokens // seqlen), seqlen)
            awq["blocks"] = args.awq_layers
            awq["calibration_tokens"] = args.calib_tokens
            awq["seconds_per_block"] = awq["seconds"] / args.awq_layers
            results["awq"] = awq
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            print(f"{k}: {v}")
    return 0


def build_dir(directory: Path, config: LlamaConfig) -> None:
    build(directory, config)
    write_tokenizer(directory, config.vocab_size)


if __name__ == "__main__":
    raise SystemExit(main())
