"""Hugging Face Llama checkpoints: ``config.json`` -> LlamaConfig, and the (sharded) safetensors weights.

Hugging Face stores q/k rows in rotate-half order, which is perfx's order, so no rows move. fp16 and fp32
tensors load as views of the mapped files; bf16 widens exactly to float32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from ..architectures import Family, family_for_hf, family_named
from ..architectures.base import OPTIONAL_TENSORS, expected_shapes, optional_tensors
from ..config import LayerWeights, LlamaConfig, LlamaWeights, config_from_values, show
from ..errors import ModelFormatError, PerfxError
from ..weights import SUPPORTED_GROUP_SIZES, DenseWeight, Weight, quantize_rtn
from .hf_rope import rope_values
from .safetensors_io import SafetensorsFile, bf16_to_f32

# config.json activation names -> perfx's (transformers' gelu_pytorch_tanh is the tanh approximation)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
FLOAT_DTYPES = ("F32", "F16", "BF16")

# perfx's names for one block's tensors -> the Hugging Face module path under model.layers.{i}.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def read_json(path: Path, error: type[PerfxError] = ModelFormatError) -> dict[str, Any]:
    """A JSON object from a model file; ``error`` (a PerfxError) for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}; check the file's permissions") from None
    except RecursionError:
        raise error(f"{path} is not valid JSON (nested too deeply); re-download the model") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, or an integer too long to read
        raise error(f"{path} is not valid JSON ({e}); re-download the model") from None
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, not {show(value)}; re-download the model")
    return value


# LlamaConfig field -> config.json key
HF_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "context_length": "max_position_embeddings",
    "tied_embeddings": "tie_word_embeddings",
    "name": "_name_or_path",
}
_HF_DEFAULTS = {"norm_eps": 1e-6, "rope_theta": 10000.0, "context_length": 2048, "tied_embeddings": False, "name": ""}


def config_from_hf(raw: dict[str, Any], where: str) -> LlamaConfig:
    """LlamaConfig from the ``config.json`` dict of directory ``where``; ModelFormatError for other architectures."""
    file = str(Path(where) / "config.json")
    family = family_for_hf(raw.get("model_type"), file, raw.get("architectures"))
    if family.name not in ("qwen2", "qwen3") and raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelFormatError(
            f"{file}: biases on the attention output or the MLP are not supported ({family.name}); perfx runs "
            "biases on the q, k and v projections only (Qwen2)"
        )
    act_key = "hidden_activation" if raw.get("hidden_activation") is not None else "hidden_act"
    activation = HF_ACTIVATIONS.get(raw.get(act_key, "silu"))
    values = family.hf_values(raw)
    if activation is None or activation != values.get("activation", "silu"):
        raise ModelFormatError(
            f"{file}: activation {show(raw.get(act_key))} ({act_key}) is not what perfx runs for {family.name} "
            f"({values.get('activation', 'silu')}); the checkpoint does not match its model type"
        )

    names = dict(HF_KEYS)
    values.update({f: raw[k] for f, k in HF_KEYS.items() if k in raw})
    values["arch"] = family.name
    # transformers >= 5 moves theta and scaling into rope_parameters, per layer type where they differ (Gemma 3).
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention")
        if isinstance(local, dict) and "rope_theta" in local:
            values["rope_local_theta"] = local["rope_theta"]
            names["rope_local_theta"] = "rope_parameters.sliding_attention.rope_theta"
        params = params["full_attention"]
        names.update({"rope_theta": "rope_parameters.full_attention.rope_theta"})
    if isinstance(params, dict) and "rope_theta" not in raw and "rope_theta" in params:
        values["rope_theta"] = params["rope_theta"]
        if names["rope_theta"] == "rope_theta":  # (not already the per-layer-type key)
            names["rope_theta"] = "rope_parameters.rope_theta"
    for f, default in _HF_DEFAULTS.items():
        values.setdefault(f, default)
    values.update(rope_values(raw, params, file, names))
    return config_from_values(values, file, names)


NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")


class HFCheckpoint:
    """The safetensors tensors of a Hugging Face directory (one file or shards with an index), mapped lazily."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise ModelFormatError(f"{self.dir} has no config.json; it is not a Hugging Face model directory")
        self.raw_config = read_json(config_path)
        index_path = self.dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFormatError(f"{index_path} has no 'weight_map'; re-download the model")
            self._where = {k: _shard_name(index_path, k, v) for k, v in weight_map.items()}
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise ModelFormatError(
                    f"{self.dir} has no *.safetensors weights (PyTorch .bin files are not supported; "
                    "convert them with transformers' save_pretrained(safe_serialization=True))"
                )
            self._where = {}
            for name in files:
                for key in SafetensorsFile(self.dir / name).keys():
                    self._where[key] = name
        missing = sorted({f for f in self._where.values() if not _is_file(self.dir / f)})
        if missing:
            raise ModelFormatError(
                f"{self.dir}: shard {missing[0]} listed in model.safetensors.index.json is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the download is incomplete"
            )
        self._files: dict[str, SafetensorsFile] = {}

    def check_block_tensors(self, expected: set[str], family: str) -> None:
        """Every block tensor of the checkpoint must be one perfx uses: an unused one (a bias, a norm) would be
        ignored and the outputs silently wrong."""
        unused = sorted(k for k in self._where if k.startswith("model.layers.") and k not in expected)
        if unused:
            raise ModelFormatError(
                f"{self.dir} has tensors a {family} model as its config.json describes does not use: "
                f"{', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}; the config and the tensors disagree"
            )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def release(self) -> None:
        """Unmap the shards (once no view of them is left), so pages read so far stop counting as resident."""
        self._files.clear()

    def keys(self) -> list[str]:
        return list(self._where)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """(view of the stored tensor, safetensors dtype name)."""
        shard = self._where.get(name)
        if shard is None:
            raise ModelFormatError(f"{self.dir} has no tensor {name!r}; check that the checkpoint is complete")
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = SafetensorsFile(self.dir / shard)
        if name not in f:
            raise ModelFormatError(f"{self.dir / shard} lacks tensor {name!r}, which the index puts there")
        return f.get(name), f.entries[name].dtype

    def array(
        self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = FLOAT_DTYPES
    ) -> tuple[np.ndarray, str]:
        """A float tensor checked for shape and dtype; a view where the dtype allows."""
        data, dtype = self.raw(name)
        if dtype not in dtypes:
            raise ModelFormatError(
                f"{self.dir}: tensor {name!r} has dtype {dtype}; perfx expects one of {', '.join(dtypes)} here"
            )
        if data.shape != shape:
            raise ModelFormatError(
                f"{self.dir}: tensor {name!r} has shape {data.shape}, but config.json implies {shape}"
            )
        return data, dtype

    def float32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float tensor as a new float32 array."""
        data, dtype = self.array(name, shape)
        return bf16_to_f32(data) if dtype == "BF16" else np.array(data, dtype=np.float32)

    def weight(self, name: str, shape: tuple[int, int]) -> DenseWeight:
        """fp16/fp32 stay views of the file; bf16 widens to float32."""
        data, dtype = self.array(name, shape)
        return DenseWeight(bf16_to_f32(data) if dtype == "BF16" else data)


def _shard_name(index_path: Path, tensor: str, shard: Any) -> str:
    """A shard named by the index: a relative path that stays inside the model directory.

    Checked by name, not by resolving it: a Hugging Face cache snapshot holds symlinks into its blob store.
    """
    if not isinstance(shard, str) or not shard:
        raise ModelFormatError(
            f"{index_path}: weight_map gives tensor {tensor!r} the shard {show(shard)}, not a file name; "
            "re-download the model"
        )
    parts = PurePosixPath(shard.replace("\\", "/")).parts
    if PurePosixPath(shard).is_absolute() or PureWindowsPath(shard).anchor or ".." in parts:
        raise ModelFormatError(
            f"{index_path}: weight_map names a shard outside the model directory ({shard!r}, for tensor "
            f"{tensor!r}); perfx reads shards from the model's own directory only, so fix the index"
        )
    return shard


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name no file can have (too long for the file system)
        return False


def hf_name(perfx_name: str, layer: int | None = None) -> str:
    """The checkpoint key of a perfx tensor name ('token_embedding', 'norm', 'output' or a block's part)."""
    top = {"token_embedding": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight"}
    if layer is None:
        return top[perfx_name]
    return f"model.layers.{layer}.{LAYER_TENSORS[perfx_name]}.weight"


def pick_group_size(cols: int, wanted: int) -> int:
    """``wanted`` if it divides ``cols``, else the largest smaller supported size that does."""
    for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if g <= wanted and cols % g == 0:
            return g
    raise ModelFormatError(f"no supported int4 group size ({SUPPORTED_GROUP_SIZES}) divides {cols} input columns")


def load_hf_directory(
    directory: str | os.PathLike[str], quantize: str | None = None, group_size: int = 128
) -> tuple[LlamaConfig, LlamaWeights]:
    """A Hugging Face float checkpoint as perfx weights: dense views, or int4 with ``quantize="rtn"``."""
    if quantize not in (None, "rtn"):
        raise ModelFormatError(f"quantize={quantize!r} on load is not supported; use 'rtn' or run `perfx quantize`")
    ckpt = HFCheckpoint(directory)
    config = config_from_hf(ckpt.raw_config, str(ckpt.dir))
    family = family_named(config.arch)
    blocks = BlockTensors(ckpt, family, config)
    expected = {blocks.path(n, i) for i in range(config.n_layers) for n in blocks.names()}
    ckpt.check_block_tensors(expected, family.name)

    def linear(name: str, layer: int) -> Weight:
        if quantize == "rtn":
            w = blocks.float32(name, layer)
            return quantize_rtn(w, pick_group_size(w.shape[1], group_size))
        return blocks.weight(name, layer)

    layers = []
    for i in range(config.n_layers):
        parts: dict[str, Any] = {n: blocks.vector(n, i) for n in ("attn_norm", "ffn_norm", *optional_tensors(config))}
        parts.update({n: linear(n, i) for n in LINEARS})
        layers.append(LayerWeights(**parts))
    vocab = (config.vocab_size, config.dim)
    embedding = ckpt.weight(hf_name("token_embedding"), vocab)
    tied = config.tied_embeddings or hf_name("output") not in ckpt
    output = embedding if tied else ckpt.weight(hf_name("output"), vocab)
    norm = ckpt.float32(hf_name("norm"), (config.dim,)) + np.float32(family.hf_norm_offset)
    weights = LlamaWeights(embedding, layers, norm, output)
    if quantize == "rtn":
        weights.notes.append("linear layers were quantized to int4 on load (round-to-nearest)")
    return config, weights


class BlockTensors:
    """One family's block tensors in a checkpoint, by perfx name: norms with the family's offset applied, Phi-3's
    fused projections split into perfx's parts (views: no copy)."""

    FUSED = {
        "wq": ("w_qkv", 0),
        "wk": ("w_qkv", 1),
        "wv": ("w_qkv", 2),
        "w_gate": ("w_gate_up", 0),
        "w_up": ("w_gate_up", 1),
    }

    def __init__(self, ckpt: HFCheckpoint, family: Family, config: LlamaConfig):
        self.ckpt, self.family, self.config = ckpt, family, config
        self.shapes = expected_shapes(config)
        c = config
        self._splits = {"w_qkv": (c.q_dim, c.kv_dim, c.kv_dim), "w_gate_up": (c.ffn_dim, c.ffn_dim)}

    def names(self) -> list[str]:
        """The checkpoint's tensor names for one block, as perfx (or the fused checkpoint) calls them."""
        base = [n for n in self.shapes if n not in optional_tensors(self.config)]
        if self.family.fused:
            base = [n for n in base if n not in self.FUSED] + ["w_qkv", "w_gate_up"]
        return base + optional_tensors(self.config)

    def path(self, name: str, layer: int) -> str:
        suffix = self.family.hf_tensors.get(name) or OPTIONAL_TENSORS[name][1]
        path = f"model.layers.{layer}.{suffix}"
        if path not in self.ckpt:
            raise ModelFormatError(
                f"{self.ckpt.dir} has no tensor {path!r}, which a {self.family.name} model as its config.json "
                "describes has; the config and the tensors disagree (or the checkpoint is incomplete)"
            )
        return path

    def _rows(self, name: str, layer: int) -> tuple[str, tuple[int, int], slice | None]:
        """(tensor to read, its shape, the rows of it that are ``name``)."""
        if self.family.fused and name in self.FUSED:
            fused, part = self.FUSED[name]
            sizes = self._splits[fused]
            start = sum(sizes[:part])
            return self.path(fused, layer), (sum(sizes), self.config.dim), slice(start, start + sizes[part])
        return self.path(name, layer), self.shapes[name], None  # type: ignore[return-value]

    def check(self, layer: int) -> None:
        """ModelFormatError unless every tensor of block ``layer`` is there with a float dtype and its shape
        (read from the headers only)."""
        for name in self.shapes:
            path, shape, _ = self._rows(name, layer)
            self.ckpt.array(path, shape)

    def weight(self, name: str, layer: int) -> DenseWeight:
        path, shape, rows = self._rows(name, layer)
        w = self.ckpt.weight(path, shape)
        return w if rows is None else DenseWeight(w.data[rows])

    def float32(self, name: str, layer: int) -> np.ndarray:
        path, shape, rows = self._rows(name, layer)
        data = self.ckpt.float32(path, shape)
        return data if rows is None else np.ascontiguousarray(data[rows])

    def vector(self, name: str, layer: int) -> np.ndarray:
        data = self.ckpt.float32(self.path(name, layer), self.shapes[name])
        if name in NORMS and self.family.hf_norm_offset:
            data += np.float32(self.family.hf_norm_offset)  # stored as w - 1, applied as 1 + w
        return data
