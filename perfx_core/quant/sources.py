"""Float weights of a model of any family perfx runs, read one block at a time from a mapped Hugging Face
directory or GGUF.

A source never holds more than one block's float32 weights (plus the embedding rows calibration needs), so
quantizing a 7B model fits in a small fraction of its float size. Everything is checked (names, dtypes,
shapes) from the file headers before any work starts.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from ..architectures import family_named
from ..architectures.base import OPTIONAL_TENSORS, optional_tensors
from ..config import LlamaConfig
from ..errors import ModelFormatError, ModelNotFoundError
from ..formats.hf import FLOAT_DTYPES, LINEARS, BlockTensors, HFCheckpoint, config_from_hf, expected_shapes, hf_name
from ..formats.hf_tokenizer import GGUF_TOKENIZER_FILE, HF_TOKENIZER_FILES, save_gguf_tokenizer
from ..formats.safetensors_io import bf16_to_f32
from ..tokenizer import Tokenizer


class FloatSource(ABC):
    """A float model to quantize. Block tensors use perfx names (attn_norm, wq, ..., w_down, and the family's
    optional ones: bq, q_norm, post_attn_norm ...; formats.hf.expected_shapes), (out, in) layout, norm weights as
    applied (Gemma's 1 added)."""

    config: LlamaConfig
    description: str

    @abstractmethod
    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Block i's tensors as new float32 arrays (q/k rows in rotate-half order)."""

    @abstractmethod
    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 (len(ids), dim) rows of the token embedding."""

    @abstractmethod
    def embedding_f16(self) -> np.ndarray:
        """The token embedding as float16 (vocab, dim)."""

    @abstractmethod
    def output_f16(self) -> np.ndarray | None:
        """The output head as float16, or None when it is the token embedding (tied)."""

    @abstractmethod
    def norm(self) -> np.ndarray:
        """The final RMSNorm weight, float32 (dim,)."""

    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (for calibration text)."""

    @abstractmethod
    def copy_tokenizer(self, directory: Path) -> dict[str, Any]:
        """Write the tokenizer files into ``directory``; returns what perfx.json records about them."""


class HFSource(FloatSource):
    """A Hugging Face float checkpoint of any family perfx runs, read as the loader reads it (formats.hf):
    Phi-3's fused projections split, Gemma's norms with their 1 added."""

    def __init__(self, directory: Path):
        self.ckpt = HFCheckpoint(directory)
        self.dir = directory
        self.config = config_from_hf(self.ckpt.raw_config, str(directory))
        self.family = family_named(self.config.arch)
        self.description = f"Hugging Face directory {directory.name}"
        self._tied = self.config.tied_embeddings or hf_name("output") not in self.ckpt
        if self._tied and not self.config.tied_embeddings:
            from dataclasses import replace

            self.config = replace(self.config, tied_embeddings=True)
        self.blocks = BlockTensors(self.ckpt, self.family, self.config)
        self._check_all()

    def _check_all(self) -> None:
        vocab = (self.config.vocab_size, self.config.dim)
        names = [(hf_name("token_embedding"), vocab), (hf_name("norm"), (self.config.dim,))]
        if not self._tied:
            names.append((hf_name("output"), vocab))
        for name, shape in names:
            self.ckpt.array(name, shape, FLOAT_DTYPES)  # raises on a missing tensor, wrong dtype or shape
        n = self.config.n_layers
        # A block tensor the family does not use (a bias, a norm) would be dropped and the output wrong.
        self.ckpt.check_block_tensors(
            {self.blocks.path(t, i) for i in range(n) for t in self.blocks.names()}, self.family.name
        )
        for i in range(n):
            self.blocks.check(i)
        if not any((self.dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise ModelFormatError(f"{self.dir} has no tokenizer.json or tokenizer.model; add the tokenizer files")

    def layer(self, i: int) -> dict[str, np.ndarray]:
        tensors = {
            n: self.blocks.float32(n, i) if n in LINEARS else self.blocks.vector(n, i)
            for n in expected_shapes(self.config)
        }
        self.ckpt.release()  # the block is copied out: let its pages of the mapped file go
        return tensors

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        data, dtype = self.ckpt.raw(hf_name("token_embedding"))
        rows = data[np.asarray(ids)]
        return bf16_to_f32(rows) if dtype == "BF16" else rows.astype(np.float32)

    def _f16(self, name: str) -> np.ndarray:
        data, dtype = self.ckpt.raw(name)
        if dtype == "F16":
            return data
        out = np.empty(data.shape, np.float16)
        for r in range(0, data.shape[0], 4096):  # convert in slices: no full float32 copy
            chunk = data[r : r + 4096]
            out[r : r + 4096] = bf16_to_f32(chunk) if dtype == "BF16" else chunk
        return out

    def embedding_f16(self) -> np.ndarray:
        return self._f16(hf_name("token_embedding"))

    def output_f16(self) -> np.ndarray | None:
        return None if self._tied else self._f16(hf_name("output"))

    def norm(self) -> np.ndarray:
        return self.ckpt.float32(hf_name("norm"), (self.config.dim,)) + np.float32(self.family.hf_norm_offset)

    def tokenizer(self) -> Tokenizer:
        from ..formats.hf_tokenizer import tokenizer_for_directory

        return tokenizer_for_directory(self.dir)[0]

    def copy_tokenizer(self, directory: Path) -> dict[str, Any]:
        copied = [f for f in HF_TOKENIZER_FILES if (self.dir / f).is_file()]
        for f in copied:
            shutil.copyfile(self.dir / f, directory / f)
        return {"kind": "tokenizer.json" if "tokenizer.json" in copied else "tokenizer.model", "files": copied}


class GGUFSource(FloatSource):
    """A GGUF of any family perfx runs, each tensor dequantized to float32 when its block is reached, read as
    gguf_loader reads it: q/k rows put in HF order where the converter permuted them, Phi-3's fused tensors split."""

    def __init__(self, path: Path):
        from ..gguf_file import read_gguf
        from ..gguf_loader import TensorLoader, check_tensor_names, hf_row_order, read_llama_config

        self.gf = read_gguf(path)
        self.config = read_llama_config(self.gf)
        check_tensor_names(self.gf, self.config)
        self.family = family_named(self.config.arch)
        self._loader = TensorLoader(self.gf)
        permuted = self.family.gguf_permuted_qk
        self._q_order = hf_row_order(self.config.n_heads, self.config.head_dim) if permuted else None
        self._k_order = hf_row_order(self.config.n_kv_heads, self.config.head_dim) if permuted else None
        self.description = f"GGUF {path.name}"
        self._embedding: np.ndarray | None = None

    def _matrix(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        from ..weights import dequantize

        return dequantize(self._loader.matrix(name, shape), np.float32)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        c, p = self.config, f"blk.{i}."
        d, q, kv, f = c.dim, c.q_dim, c.kv_dim, c.ffn_dim
        if self.family.fused:  # Phi-3: q, k, v in attn_qkv; gate and up in ffn_up
            qkv = self._matrix(p + "attn_qkv.weight", (q + 2 * kv, d))
            gate_up = self._matrix(p + "ffn_up.weight", (2 * f, d))
            w = {"wq": qkv[:q], "wk": qkv[q : q + kv], "wv": qkv[q + kv :], "w_gate": gate_up[:f], "w_up": gate_up[f:]}
            w = {n: np.ascontiguousarray(a) for n, a in w.items()}
        else:
            w = {
                "wq": self._matrix(p + "attn_q.weight", (q, d)),
                "wk": self._matrix(p + "attn_k.weight", (kv, d)),
                "wv": self._matrix(p + "attn_v.weight", (kv, d)),
                "w_gate": self._matrix(p + "ffn_gate.weight", (f, d)),
                "w_up": self._matrix(p + "ffn_up.weight", (f, d)),
            }
        shapes = expected_shapes(c)
        w.update(
            attn_norm=self._loader.vector(p + "attn_norm.weight", d),
            wo=self._matrix(p + "attn_output.weight", (d, q)),
            ffn_norm=self._loader.vector(p + "ffn_norm.weight", d),
            w_down=self._matrix(p + "ffn_down.weight", (d, f)),
        )
        w.update({n: self._loader.vector(p + OPTIONAL_TENSORS[n][0], shapes[n][0]) for n in optional_tensors(c)})
        if self._q_order is not None:  # the converter's interleaved-RoPE row order, undone (biases too)
            for name, order in (
                ("wq", self._q_order),
                ("wk", self._k_order),
                ("bq", self._q_order),
                ("bk", self._k_order),
            ):
                if name in w:
                    w[name] = w[name][order]
        return {n: w[n] for n in shapes}

    def embedding_f16(self) -> np.ndarray:
        if self._embedding is None:
            self._embedding = self._matrix("token_embd.weight", (self.config.vocab_size, self.config.dim)).astype(
                np.float16
            )
        return self._embedding

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        return self.embedding_f16()[np.asarray(ids)].astype(np.float32)

    def output_f16(self) -> np.ndarray | None:
        if "output.weight" not in self.gf.tensors:
            return None
        return self._matrix("output.weight", (self.config.vocab_size, self.config.dim)).astype(np.float16)

    def norm(self) -> np.ndarray:
        return self._loader.vector("output_norm.weight", self.config.dim)

    def tokenizer(self) -> Tokenizer:
        from ..tokenizer import tokenizer_from_metadata

        return tokenizer_from_metadata(self.gf.metadata)

    def copy_tokenizer(self, directory: Path) -> dict[str, Any]:
        save_gguf_tokenizer(self.gf.metadata, directory / GGUF_TOKENIZER_FILE)
        return {"kind": "gguf-metadata", "files": [GGUF_TOKENIZER_FILE]}


def open_source(path: str | os.PathLike[str]) -> FloatSource:
    """A FloatSource for a Hugging Face directory or a GGUF file (decided by content, not name)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model {str(path)!r} does not exist")
    if path.is_dir():
        from ..formats.awq_checkpoint import is_awq_config
        from ..formats.hf import read_json

        if (path / "config.json").is_file() and is_awq_config(read_json(path / "config.json")):
            raise ModelFormatError(f"{path} is already AWQ-quantized; load it directly with perfx_core.load")
        return HFSource(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFormatError(f"{path} is neither a Hugging Face directory nor a GGUF file")
    return GGUFSource(path)
