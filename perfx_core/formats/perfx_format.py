"""perfx's own model format: a directory loaded by mapping one safetensors file, with no work at load time.

Layout of a perfx directory::

    perfx.json          {"format": "perfx", "format_version": 1 or 2, "config": {...}, "quantization": {...}, ...}
    model.safetensors   token_embedding F16 (vocab, dim); output F16 (only when not tied); norm F32 (dim,)
                        layers.{i}.attn_norm / layers.{i}.ffn_norm          F32 (dim,)
                        layers.{i}.{bq,bk,bv}                               F32 (q_dim / kv_dim,)  qkv_bias
                        layers.{i}.{q_norm,k_norm}                          F32 (head_dim,)        qk_norm
                        layers.{i}.{post_attn_norm,post_ffn_norm}           F32 (dim,)             post_norms
                        layers.{i}.{wq,wk,wv,wo,w_gate,w_up,w_down}.qweight U8  (rows, cols/2)
                                                                     .scales  F16 (rows, cols/g)
                                                                     .bias    F32 (rows, cols/g)
    tokenizer files     tokenizer.json / tokenizer.model (+ tokenizer_config.json), or tokenizer.gguf.json

``config`` is the whole LlamaConfig (every family field: windows and which layers slide, soft-caps, scales,
RoPE scaling, LongRoPE's factor lists); a key this perfx does not know is refused, since dropping it would run
the model wrong. Norm weights are stored as applied (Gemma's 1 + w already added), so no family needs work
at load. Format version 1 is a Llama model (every family field at its default, no optional tensors); any
other family is version 2, so a perfx that predates the families refuses it instead of dropping what it lacks.

Int4 layout is perfx's ``Int4Weight`` as is: ``w = q * scale + bias`` per group of g input columns, byte j
of a row holding column 2j (low nibble) and 2j+1 (high nibble). AWQ's integer zero points are stored folded
(``bias = -zero * scale``, exact in float32), so the loaded arrays are plain views of the mapped file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..architectures.base import optional_tensors
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
FORMAT_VERSIONS = (1, 2)  # 1: Llama models; 2: the other families (see format_version)
METADATA_FILE = "perfx.json"
WEIGHTS_FILE = "model.safetensors"
# The config fields of format version 1 (perfx before the families); the others all have Llama's behaviour as
# their default.
LLAMA_FIELDS = frozenset(
    {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps", "rope_theta",
     "context_length", "rope_scaling", "rope_freq_divisors", "tied_embeddings", "name"}
)  # fmt: skip


def is_perfx_directory(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


def config_to_json(config: LlamaConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config)))  # tuples -> lists, nested dataclasses -> dicts


def format_version(config: LlamaConfig) -> int:
    """1 for a model a Llama-only reader runs right (the family name aside, every field beyond LLAMA_FIELDS at its
    default), else 2."""
    family_fields = (f for f in dataclasses.fields(LlamaConfig) if f.name not in LLAMA_FIELDS | {"arch"})
    return 1 if all(getattr(config, f.name) == f.default for f in family_fields) else 2


def layer_vectors(config: LlamaConfig) -> tuple[str, ...]:
    """The float32 vectors of each block: its two norms and the optional tensors the config's features bring."""
    return ("attn_norm", "ffn_norm", *optional_tensors(config))


def config_from_json(raw: Any, where: str) -> LlamaConfig:
    """The LlamaConfig stored in the ``config`` object of directory ``where``'s perfx.json."""
    file = str(Path(where) / METADATA_FILE)
    if not isinstance(raw, dict):
        raise ConfigCheck(file).bad("config", raw, "an object", True)
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(k for k in raw if k not in fields)
    if unknown:
        raise ConfigCheck(file).error(
            f"'config' has keys this perfx does not know ({', '.join(map(show, unknown[:4]))}), and the model run "
            "without them would be wrong; upgrade perfx if a newer one wrote it"
        )
    names = {f: f"config.{f}" for f in fields}
    for field, nested in (("rope_scaling", RopeScaling), ("long_rope", LongRope)):
        names.update({f"{field}.{f.name}": f"config.{field}.{f.name}" for f in dataclasses.fields(nested)})
    return config_from_values(raw, file, names)


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
        for vector in layer_vectors(config):
            specs[f"layers.{i}.{vector}"] = (np.dtype(np.float32), shapes[vector])
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

    def write_layer(self, i: int, vectors: Mapping[str, np.ndarray], linears: Mapping[str, Int4Weight]) -> None:
        """Block i: ``vectors`` has every name of ``layer_vectors(config)`` (float32), ``linears`` every linear."""
        for name in layer_vectors(self.config):
            self._file.write(f"layers.{i}.{name}", np.asarray(vectors[name], np.float32))
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
            "format_version": format_version(self.config),
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
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in FORMAT_VERSIONS:
        raise ModelFormatError(
            f"{path} has format version {show(version)}; "
            f"this perfx reads versions {', '.join(map(str, FORMAT_VERSIONS))}. "
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
    _check_tensor_names(f, config, where)

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
        parts: dict[str, Any] = {n: get(p + n, np.float32, shapes[n], 1) for n in layer_vectors(config)}
        parts.update({n: linear(p + n, shapes[n]) for n in LINEARS})  # type: ignore[arg-type]
        layers.append(LayerWeights(**parts))
    vocab = (config.vocab_size, config.dim)
    embedding = DenseWeight(get("token_embedding", np.float16, vocab))
    output = embedding if config.tied_embeddings else DenseWeight(get("output", np.float16, vocab))
    return config, LlamaWeights(embedding, layers, get("norm", np.float32, (config.dim,), 1), output), meta


def _check_tensor_names(f: SafetensorsFile, config: LlamaConfig, where: Path) -> None:
    """Every tensor of the file must be one the config uses: one it does not (a bias, a norm) would be ignored."""
    expected = {"token_embedding", "norm"} | (set() if config.tied_embeddings else {"output"})
    suffixes = (*layer_vectors(config), *(f"{n}.{part}" for n in LINEARS for part in ("qweight", "scales", "bias")))
    expected.update(f"layers.{i}.{s}" for i in range(config.n_layers) for s in suffixes)
    unused = sorted(name for name in f.keys() if name not in expected)
    if unused:
        raise ModelFormatError(
            f"{where} has tensors a {config.arch} model as its perfx.json describes does not use: "
            f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}; the config and the tensors disagree, "
            "re-create the model"
        )
