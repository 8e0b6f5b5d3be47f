"""``quantize(src, out)``: a Hugging Face directory or a GGUF of any family perfx runs in, a perfx int4
directory out, block by block. The linears become int4; every other tensor (norms, biases, q/k norms, the
embedding as float16) is carried as the loaders read it.

The output is built in a directory beside ``out`` and renamed into place only when complete and synced (see
``staging``), so an interrupted, failed or killed run leaves nothing at ``out``; what a killed run leaves beside
it is removed by the next run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..formats.hf import LINEARS, expected_shapes, pick_group_size
from ..formats.perfx_format import PerfxWriter, is_perfx_directory, layer_vectors
from ..weights import SUPPORTED_GROUP_SIZES, quantize_rtn
from .awq import awq_block
from .calibration import load_calibration
from .forward import block_forward, rope_tables
from .sources import open_source
from .staging import StagedDirectory, remove_stale
from .support import check_quantizable

METHODS = ("rtn", "awq")


@dataclass
class QuantizeReport:
    out: Path
    method: str
    seconds: float
    group_sizes: dict[str, int]
    # per block, per linear group: output error of plain RTN and after AWQ's scale search (awq only)
    errors: list[dict[str, tuple[float, float]]] = field(default_factory=list)


def quantize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    method: str = "awq",
    group_size: int = 128,
    calib: str | os.PathLike[str] | None = None,
    *,
    n_samples: int = 32,
    seqlen: int = 256,
    loss_tokens: int = 8192,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> QuantizeReport:
    """Quantize ``src`` (Hugging Face directory or GGUF, any family perfx runs) to int4 and write perfx's format
    to the directory ``out``.

    method: "rtn" (round to nearest) or "awq". group_size: 32, 64 or 128 (a matrix whose input width it does
    not divide uses the largest smaller size that does). calib: a UTF-8 text file (default: perfx's own set),
    cut into ``n_samples`` windows of ``seqlen`` tokens; up to ``loss_tokens`` of them (sampled) score the scale
    and clipping searches.
    """
    started = time.perf_counter()
    if method not in METHODS:
        raise InvalidArgumentError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InvalidArgumentError(f"group size {group_size} is not supported; choose one of {SUPPORTED_GROUP_SIZES}")
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise InvalidArgumentError(f"{out} already exists; choose another output or pass overwrite=True (--force)")
    _check_replaceable(out, Path(src).expanduser().resolve())
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"the output's parent directory {out.parent} does not exist")
    log = progress or (lambda _msg: None)

    source = open_source(src)  # checks every tensor's name, dtype and shape before any work
    config = source.config
    check_quantizable(config)  # a config feature the forward, the folding or the format lacks: refused here
    shapes = expected_shapes(config)
    group_sizes = {n: pick_group_size(shapes[n][1], group_size) for n in LINEARS}
    calibration = load_calibration(source.tokenizer(), calib, n_samples, seqlen) if method == "awq" else None

    log(f"quantizing {config.n_layers} {config.arch} blocks of {Path(src).name} ({method}, group {group_size})")
    report = QuantizeReport(out, method, 0.0, group_sizes)
    for stale in remove_stale(out):
        log(f"removed {stale}, left by an interrupted run")
    staged = StagedDirectory(out)
    tmp = staged.path
    writer: PerfxWriter | None = None
    try:
        writer = PerfxWriter(tmp, config, group_sizes)
        h = ropes = loss_idx = None
        if calibration is not None:
            b, t = calibration.tokens.shape
            h = source.embedding_rows(calibration.tokens.reshape(-1)).reshape(b, t, config.dim)
            if config.embed_scale != 1.0:  # Gemma: sqrt(dim), as the model scales the rows it looks up
                h = h * np.float32(config.embed_scale)
            ropes = rope_tables(config, t)
            rng = np.random.default_rng(0)
            loss_idx = np.sort(rng.permutation(b * t)[: min(b * t, loss_tokens)])
        for i in range(config.n_layers):
            w = source.layer(i)
            if calibration is not None:
                cos, sin = ropes[i]
                h, inputs = block_forward(h, w, config, cos, sin, layer=i)  # float outputs feed the next block
                linears, block = awq_block(w, inputs, config, group_sizes, loss_idx)
                del inputs
                report.errors.append({k: (block.rtn_error[k], block.awq_error[k]) for k in block.rtn_error})
            else:
                linears = {n: quantize_rtn(w[n], group_sizes[n]) for n in LINEARS}
            writer.write_layer(i, {n: w[n] for n in layer_vectors(config)}, linears)
            del w, linears
            spent = time.perf_counter() - started
            left = spent / (i + 1) * (config.n_layers - i - 1)
            log(f"block {i + 1}/{config.n_layers} quantized ({method}), {spent:.0f} s so far, about {left:.0f} s left")
        writer.write("token_embedding", source.embedding_f16())
        output = source.output_f16()
        if output is not None:
            writer.write("output", output)
        writer.write("norm", source.norm())
        tokenizer_info = source.copy_tokenizer(tmp)
        writer.finish(
            _metadata(method, group_size, group_sizes, calibration, source.description, tokenizer_info, loss_tokens)
        )
        writer = None
        staged.publish()
    except BaseException:
        if writer is not None:
            writer.abort()
        staged.discard()
        raise
    finally:
        staged.close()
    report.seconds = time.perf_counter() - started
    return report


def _metadata(method, group_size, group_sizes, calibration, source, tokenizer_info, loss_tokens) -> dict[str, Any]:
    from .. import __version__

    quant: dict[str, Any] = {
        "method": method,
        "bits": 4,
        "group_size": group_size,
        "group_sizes": group_sizes,
        "zero_point": True,
        "storage": "w = q * scales + bias per group; bias = -zero * scale (AWQ's integer zero point, folded)",
        "calibration": None,
    }
    if calibration is not None:
        samples, seqlen = calibration.tokens.shape
        quant["calibration"] = {
            "source": calibration.source,
            "sha256": calibration.sha256,
            "samples": int(samples),
            "seqlen": int(seqlen),
            "loss_tokens": int(min(loss_tokens, samples * seqlen)),
        }
    return {"perfx_version": __version__, "source": source, "quantization": quant, "tokenizer": tokenizer_info}


def _check_replaceable(out: Path, src: Path) -> None:
    """--force replaces an earlier perfx output or an empty directory, never the source or anything else."""
    if out == src or out in src.parents:
        raise InvalidArgumentError(f"the output {out} is (or contains) the source {src}; choose another output")
    if out.exists() and not (is_perfx_directory(out) or (out.is_dir() and not any(out.iterdir()))):
        raise InvalidArgumentError(
            f"{out} exists and is not a perfx model directory; --force only replaces an earlier perfx output"
        )
