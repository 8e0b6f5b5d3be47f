"""perfx's own model format: a directory loaded by mapping one safetensors file, with no work at load time.

Layout of a perfx directory::

    perfx.json          {"format": "perfx", "format_version": 1, "config": {...}, "quantization": {...}, ...}
    model.safetensors   token_embedding F16 (vocab, dim); output F16 (only when not tied); norm F32 (dim,)
                        layers.{i}.attn_norm / layers.{i}.ffn_norm          F32 (dim,)
                        layers.{i}.{wq,wk,wv,wo,w_gate,w_up,w_down}.qweight U8  (rows, cols/2)
                                                                     .scales  F16 (rows, cols/g)
                                                                     .bias    F32 (rows, cols/g)
    tokenizer files     tokenizer.json / tokenizer.model (+ tokenizer_config.json), or tokenizer.gguf.json

Int4 layout is perfx's ``Int4Weight`` as is: ``w = q * scale + bias`` per group of g input columns, byte j
of a row holding column 2j (low nibble) and 2j+1 (high nibble). AWQ's integer zero points are stored folded
(``bias = -zero * scale``, exact in float32), so the loaded arrays are plain views of the mapped file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..config import (
    ConfigCheck,
    LayerWeights,
    LlamaConfig,
    LlamaWeights,
    LongRope,
    RopeScaling,
    config_from_values,
    show,
)
from ..errors import ModelFormatError
from ..weights import SUPPORTED_GROUP_SIZES, DenseWeight, Int4Weight
from .hf import LINEARS, expected_shapes, read_json
from .safetensors_io import SafetensorsFile, StreamingWriter

FORMAT_NAME = "perfx"
FORMAT_VERSION = 1
METADATA_FILE = "perfx.json"
WEIGHTS_FILE = "model.safetensors"


def is_perfx_directory(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


def config_to_json(config: LlamaConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config)))  # tuples -> lists, nested dataclasses -> dicts


def config_from_json(raw: Any, where: str) -> LlamaConfig:
    """The LlamaConfig stored in the ``config`` object of directory ``where``'s perfx.json."""
    file = str(Path(where) / METADATA_FILE)
    if not isinstance(raw, dict):
        raise ConfigCheck(file).bad("config", raw, "an object", True)
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    names = {f: f"config.{f}" for f in fields}
    for field, nested in (("rope_scaling", RopeScaling), ("long_rope", LongRope)):
        names.update({f"{field}.{f.name}": f"config.{field}.{f.name}" for f in dataclasses.fields(nested)})
    return config_from_values({k: v for k, v in raw.items() if k in fields}, file, names)


def tensor_specs(config: LlamaConfig, group_sizes: dict[str, int]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor of a perfx file: name -> (dtype, shape). ``group_sizes``: linear name -> its group size."""
    specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        "token_embedding": (np.dtype(np.float16), (config.vocab_size, config.dim)),
        "norm": (np.dtype(np.float32), (config.dim,)),
    }
    if not config.tied_embeddings:
        specs["output"] = (np.dtype(np.float16), (config.vocab_size, config.dim))
    shapes = expected_shapes(config)
    for i in range(config.n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            specs[f"layers.{i}.{norm}"] = (np.dtype(np.float32), shapes[norm])
        for name in LINEARS:
            rows, cols = shapes[name]
            groups = cols // group_sizes[name]
            specs[f"layers.{i}.{name}.qweight"] = (np.dtype(np.uint8), (rows, cols // 2))
            specs[f"layers.{i}.{name}.scales"] = (np.dtype(np.float16), (rows, groups))
            specs[f"layers.{i}.{name}.bias"] = (np.dtype(np.float32), (rows, groups))
    return specs


class PerfxWriter:
    """Streams one model into ``directory``: layers in any order, each written as soon as it is quantized."""

    def __init__(self, directory: Path, config: LlamaConfig, group_sizes: dict[str, int]):
        self.directory = directory
        self.config = config
        self._file = StreamingWriter(
            directory / WEIGHTS_FILE, tensor_specs(config, group_sizes), {"format": FORMAT_NAME}
        )

    def write_layer(self, i: int, attn_norm: np.ndarray, ffn_norm: np.ndarray, linears: dict[str, Int4Weight]) -> None:
        self._file.write(f"layers.{i}.attn_norm", np.asarray(attn_norm, np.float32))
        self._file.write(f"layers.{i}.ffn_norm", np.asarray(ffn_norm, np.float32))
        for name in LINEARS:
            w = linears[name]
            self._file.write(f"layers.{i}.{name}.qweight", w.packed)
            self._file.write(f"layers.{i}.{name}.scales", w.scale)
            self._file.write(f"layers.{i}.{name}.bias", w.bias)

    def write(self, name: str, array: np.ndarray) -> None:
        """A top-level tensor: token_embedding / output (cast to fp16 here) or norm."""
        dtype = np.float32 if name == "norm" else np.float16
        self._file.write(name, np.asarray(array).astype(dtype, copy=False))

    def finish(self, metadata: dict[str, Any]) -> None:
        self._file.close()
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "config": config_to_json(self.config),
            **metadata,
        }
        (self.directory / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def abort(self) -> None:
        self._file.abort()


def read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / METADATA_FILE
    meta = read_json(path)
    if meta.get("format") != FORMAT_NAME:
        raise ModelFormatError(f'{path} is not perfx model metadata (no "format": "perfx"); re-create the model')
    if meta.get("format_version") != FORMAT_VERSION:
        raise ModelFormatError(
            f"{path} has format version {show(meta.get('format_version'))}; "
            f"this perfx reads version {FORMAT_VERSION}. "
            "Upgrade perfx or re-create the model"
        )
    return meta


def load_perfx_directory(directory: str | os.PathLike[str]) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
    """(config, weights, perfx.json) of a perfx directory; every array is a view of the mapped file."""
    directory = Path(directory)
    meta = read_metadata(directory)
    config = config_from_json(meta.get("config", {}), str(directory))
    f = SafetensorsFile(directory / WEIGHTS_FILE)
    where = directory / WEIGHTS_FILE

    def get(name: str, dtype: type, shape: tuple[int, ...] | None = None, ndim: int = 2) -> np.ndarray:
        if name not in f:
            raise ModelFormatError(f"{where} has no tensor {name!r}; the file is incomplete, re-create the model")
        a = f.get(name)
        if a.dtype != dtype or (shape is not None and a.shape != shape) or a.ndim != ndim:
            raise ModelFormatError(
                f"{where}: tensor {name!r} is {a.dtype}{a.shape}, expected {np.dtype(dtype)}{shape or ''}"
            )
        return a

    shapes = expected_shapes(config)

    def linear(prefix: str, shape: tuple[int, int]) -> Int4Weight:
        rows, cols = shape
        scales = get(prefix + ".scales", np.float16)
        if (
            scales.shape[0] != rows
            or scales.shape[1] == 0
            or cols % scales.shape[1]
            or cols // scales.shape[1] not in SUPPORTED_GROUP_SIZES
        ):
            raise ModelFormatError(
                f"{where}: {prefix}.scales has shape {scales.shape}, which does not fit {shape} with a group size "
                f"of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}; re-create the model"
            )
        return Int4Weight(
            get(prefix + ".qweight", np.uint8, (rows, cols // 2)),
            scales,
            get(prefix + ".bias", np.float32, scales.shape),
            cols // scales.shape[1],
        )

    layers = []
    for i in range(config.n_layers):
        p = f"layers.{i}."
        parts: dict[str, Any] = {n: get(p + n, np.float32, shapes[n], 1) for n in ("attn_norm", "ffn_norm")}
        parts.update({n: linear(p + n, shapes[n]) for n in LINEARS})  # type: ignore[arg-type]
        layers.append(LayerWeights(**parts))
    vocab = (config.vocab_size, config.dim)
    embedding = DenseWeight(get("token_embedding", np.float16, vocab))
    output = embedding if config.tied_embeddings else DenseWeight(get("output", np.float16, vocab))
    return config, LlamaWeights(embedding, layers, get("norm", np.float32, (config.dim,), 1), output), meta
