"""Load a Llama-family GGUF (llama.cpp's layout) into perfx's LlamaConfig and LlamaWeights.

Tensor types map onto perfx's formats without extra loss where one exists: F32/F16 stay dense, BF16 widens
exactly to float32, Q8_0 becomes an int8 group-32 weight bit for bit (codes and float16 scales as stored),
Q6_K int6 exactly (its codes, sub-scales and d as stored), Q5_0/Q5_1 int5 bit for bit and
Q5_K int5 with its codes as stored, Q4_0/Q4_1 int4 group-32 weights bit for bit and Q4_K int4 group 32 with its
codes as stored. Other types (Q2_K, Q3_K, IQ types) widen to float16, with a warning. llama.cpp's converter
reorders the rows of attn_q/attn_k for its interleaved RoPE; perfx uses rotate-half RoPE, so that reordering is
undone here, while converting (gguf_blocks.py does the block decoding).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, Keys
from gguf import quants as gguf_quants

from .architectures import family_for_gguf, family_named
from .architectures.base import OPTIONAL_TENSORS, expected_shapes, optional_tensors
from .config import ConfigCheck, LayerWeights, LlamaConfig, LlamaWeights, RopeScaling, config_from_values, show
from .errors import ModelFormatError
from .formats.safetensors_io import bf16_to_f32
from .gguf_blocks import (
    convert_rows,
    dequantize_f16,
    q4_decoder,
    q4_k_decode,
    q5_0_decode,
    q5_0_int5,
    q5_1_int5,
    q5_k_int5,
    q6_k_decode,
    q6_k_int6,
    q8_0_decode,
)
from .gguf_file import GGUFFile, TensorInfo, read_gguf
from .weights import (
    K_SUPER,
    BlockWeight,
    DenseWeight,
    Int4KScales,
    Int4Weight,
    Int5Weight,
    Int6Weight,
    Int8Weight,
    Weight,
    take_rows,
)

_IGNORED_TENSORS = re.compile(  # read separately or unused
    r"rope_freqs\.weight|rope_factors_(?:long|short)\.weight|blk\.\d+\.attn_rot_embd"
)

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def load_llama_gguf(
    source: str | os.PathLike[str] | GGUFFile,
    keep_blocks: frozenset[str] = frozenset(),
    weight_formats: frozenset[str] | None = None,
) -> tuple[LlamaConfig, LlamaWeights, GGUFFile]:
    """Read a GGUF of any family perfx runs: its config, its weights in perfx formats (q/k rows in HF order),
    and the parsed file. Matrices of a type named in ``keep_blocks`` (``Runtime.block_formats``) stay the
    file's blocks (BlockWeight), for a runtime that converts them itself. ``weight_formats``
    (``Runtime.weight_formats``; None: all) says whether Q5 and Q6_K matrices become int5 / int6 or go straight
    to what a runtime without those takes: Q5_0 and Q6_K int8 (exact, as weights.for_runtime makes them from
    int5 / int6), Q5_1 and Q5_K float16 of the file's values (for_runtime's float16 comes from int5, whose Q5_K
    scales and minimums are already rounded to float16)."""
    gf = source if isinstance(source, GGUFFile) else read_gguf(source)
    if gf.data_offset is None:
        raise ModelFormatError(f"{gf.path} was read with tensors=False; pass the path or read_gguf(path) instead")
    config = read_llama_config(gf)
    check_tensor_names(gf, config)  # before converting anything, so a wrong file fails at once
    loader = TensorLoader(gf, keep_blocks, weight_formats)
    family = family_named(config.arch)

    q_order = hf_row_order(config.n_heads, config.head_dim) if family.gguf_permuted_qk else None
    k_order = hf_row_order(config.n_kv_heads, config.head_dim) if family.gguf_permuted_qk else None
    dim, q_dim, kv_dim, ffn = config.dim, config.q_dim, config.kv_dim, config.ffn_dim
    optional = {name: OPTIONAL_TENSORS[name][0] for name in optional_tensors(config)}
    shapes = expected_shapes(config)
    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        if family.fused:  # Phi-3: q, k, v in attn_qkv; gate and up in ffn_up
            qkv = loader.matrix(p + "attn_qkv.weight", (q_dim + 2 * kv_dim, dim))
            gate_up = loader.matrix(p + "ffn_up.weight", (2 * ffn, dim))
            wq, wk, wv = (take_rows(qkv, np.arange(a, b)) for a, b in _bounds(q_dim, kv_dim, kv_dim))
            w_gate, w_up = (take_rows(gate_up, np.arange(a, b)) for a, b in _bounds(ffn, ffn))
        else:
            wq = loader.matrix(p + "attn_q.weight", (q_dim, dim), q_order)
            wk = loader.matrix(p + "attn_k.weight", (kv_dim, dim), k_order)
            wv = loader.matrix(p + "attn_v.weight", (kv_dim, dim))
            w_gate = loader.matrix(p + "ffn_gate.weight", (ffn, dim))
            w_up = loader.matrix(p + "ffn_up.weight", (ffn, dim))
        extra = {name: loader.vector(p + gguf, shapes[name][0]) for name, gguf in optional.items()}
        if q_order is not None:
            if family.fused:
                wq, wk = take_rows(wq, q_order), take_rows(wk, k_order)
            for name, order in (("bq", q_order), ("bk", k_order)):
                if name in extra:
                    extra[name] = extra[name][order]
        layers.append(
            LayerWeights(
                attn_norm=loader.vector(p + "attn_norm.weight", dim),
                wq=wq,
                wk=wk,
                wv=wv,
                wo=loader.matrix(p + "attn_output.weight", (dim, q_dim)),
                ffn_norm=loader.vector(p + "ffn_norm.weight", dim),
                w_gate=w_gate,
                w_up=w_up,
                w_down=loader.matrix(p + "ffn_down.weight", (dim, ffn)),
                **extra,
            )
        )
    embedding = loader.matrix("token_embd.weight", (config.vocab_size, dim))
    output = loader.matrix("output.weight", (config.vocab_size, dim)) if "output.weight" in gf.tensors else embedding
    weights = LlamaWeights(embedding, layers, loader.vector("output_norm.weight", dim), output)
    if "rope_freqs.weight" in gf.tensors:
        weights.notes.append(
            "RoPE speeds divided by rope_freqs.weight"
            if config.rope_freq_divisors
            else "rope_freqs.weight is present; it matches the Llama-3 rope scaling given by the metadata keys, "
            "which perfx uses"
        )
    weights.notes.extend(loader.widen_notes())
    return config, weights, gf


def _arch(gf: GGUFFile) -> str:
    return str(gf.metadata.get(Keys.General.ARCHITECTURE, "llama"))


def _bounds(*sizes: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) row ranges of the given sizes."""
    ends = np.cumsum(sizes).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def block_tensor_names(config: LlamaConfig) -> list[str]:
    """The GGUF names of one block's tensors (without the 'blk.N.' prefix) for ``config``'s family."""
    family = family_named(config.arch)
    names = list(_LAYER_PARTS)
    if family.fused:
        names = [n for n in names if n not in ("attn_q", "attn_k", "attn_v", "ffn_gate")] + ["attn_qkv"]
    names = [f"{n}.weight" for n in names]
    return names + [OPTIONAL_TENSORS[name][0] for name in optional_tensors(config)]


_LAYER_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK_TENSOR = re.compile(r"blk\.(0|[1-9]\d*)\.([a-z_]+\.(?:weight|bias))")


def check_tensor_names(gf: GGUFFile, config: LlamaConfig) -> None:
    """ModelFormatError naming the first missing, unexpected or misshapen tensor a model of ``config`` needs.

    Runs before anything is sized by the metadata: a block count or head count the tensor table cannot back
    fails here, not in an allocation.
    """
    n = config.n_layers
    top = ("token_embd.weight", "output_norm.weight")
    parts = block_tensor_names(config)
    wanted = set(parts)

    def expected(name: str) -> bool:
        m = _BLOCK_TENSOR.fullmatch(name)
        return name in top or (m is not None and int(m.group(1)) < n and m.group(2) in wanted)

    # Names are generated lazily and counted from the tensor table, never listed: the block count is not
    # trusted until the tensors back it.
    names = (f"blk.{i}.{part}" for i in range(n) for part in parts)
    first = next((t for t in top if t not in gf.tensors), None) or next((t for t in names if t not in gf.tensors), None)
    if first is not None:
        missing = len(top) + len(parts) * n - sum(map(expected, gf.tensors))
        more = f" (and {missing - 1} more are missing; {_CONFIG_KEYS['n_layers'].format(arch=_arch(gf))!r} is {n})"
        raise ModelFormatError(
            f"{gf.path} has no tensor {first!r}{more if missing > 1 else ''}, which a {config.arch} model with this "
            "metadata has; check that the file is a complete model"
        )
    optional = {"output.weight"}
    unused = sorted(t for t in gf.tensors if not (expected(t) or t in optional or _IGNORED_TENSORS.fullmatch(t)))
    if unused:
        raise ModelFormatError(
            f"{gf.path} has tensors a {config.arch} model as its metadata describes does not use: "
            f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}; perfx would ignore them and compute wrong "
            "outputs, so the metadata and the tensors disagree"
        )
    for name, shape, why in _expected_shapes(config, _arch(gf)):
        info = gf.tensors.get(name)
        if info is not None and info.shape != shape:
            raise ModelFormatError(
                f"{gf.path}: tensor {name!r} has shape {info.shape}, not the {shape} implied by {why}; {_FIX}"
            )


def _expected_shapes(config: LlamaConfig, arch: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(tensor, shape, which metadata implies it) for every tensor of a model of ``config``."""
    c = config
    k = {f: f"{key.format(arch=arch)!r} {getattr(c, f)}" for f, key in _CONFIG_KEYS.items() if hasattr(c, f)}
    head = f"head size {c.head_dim}"
    q, kv, d, ffn = c.q_dim, c.kv_dim, c.dim, c.ffn_dim
    yield "token_embd.weight", (c.vocab_size, d), k["dim"]
    yield "output.weight", (c.vocab_size, d), k["dim"]
    yield "output_norm.weight", (d,), k["dim"]
    per_block = {
        "attn_norm.weight": ((d,), k["dim"]),
        "attn_q.weight": ((q, d), f"{k['n_heads']} x {head} and {k['dim']}"),
        "attn_k.weight": ((kv, d), f"{k['n_kv_heads']} x {head} and {k['dim']}"),
        "attn_v.weight": ((kv, d), f"{k['n_kv_heads']} x {head} and {k['dim']}"),
        "attn_qkv.weight": ((q + 2 * kv, d), f"{k['n_heads']} and {k['n_kv_heads']} x {head}, {k['dim']}"),
        "attn_output.weight": ((d, q), f"{k['dim']} and {k['n_heads']} x {head}"),
        "ffn_norm.weight": ((d,), k["dim"]),
        "ffn_gate.weight": ((ffn, d), f"{k['ffn_dim']} and {k['dim']}"),
        "ffn_up.weight": ((2 * ffn if family_named(c.arch).fused else ffn, d), f"{k['ffn_dim']} and {k['dim']}"),
        "ffn_down.weight": ((d, ffn), f"{k['dim']} and {k['ffn_dim']}"),
        "attn_q.bias": ((q,), f"{k['n_heads']} x {head}"),
        "attn_k.bias": ((kv,), f"{k['n_kv_heads']} x {head}"),
        "attn_v.bias": ((kv,), f"{k['n_kv_heads']} x {head}"),
        "attn_q_norm.weight": ((c.head_dim,), head),
        "attn_k_norm.weight": ((c.head_dim,), head),
        "post_attention_norm.weight": ((d,), k["dim"]),
        "post_ffw_norm.weight": ((d,), k["dim"]),
    }
    parts = block_tensor_names(config)
    for i in range(c.n_layers):
        for part in parts:
            shape, why = per_block[part]
            yield f"blk.{i}.{part}", shape, why


# -- config -------------------------------------------------------------------------------------------------


# LlamaConfig field -> GGUF key template
_CONFIG_KEYS = {
    "dim": Keys.LLM.EMBEDDING_LENGTH,
    "n_layers": Keys.LLM.BLOCK_COUNT,
    "n_heads": Keys.Attention.HEAD_COUNT,
    "n_kv_heads": Keys.Attention.HEAD_COUNT_KV,
    "ffn_dim": Keys.LLM.FEED_FORWARD_LENGTH,
    "norm_eps": Keys.Attention.LAYERNORM_RMS_EPS,
    "rope_theta": Keys.Rope.FREQ_BASE,
    "context_length": Keys.LLM.CONTEXT_LENGTH,
    "name": Keys.General.NAME,
    "rope_scaling.factor": Keys.Rope.SCALING_FACTOR,
    "rope_scaling.low_freq_factor": "{arch}.rope.scaling.low_freq_factor",
    "rope_scaling.high_freq_factor": "{arch}.rope.scaling.high_freq_factor",
    "rope_scaling.original_context_length": Keys.Rope.SCALING_ORIG_CTX_LEN,
}


def read_llama_config(gf: GGUFFile) -> LlamaConfig:
    """The LlamaConfig of a GGUF, from its metadata and the token embedding's shape (no weights are read)."""
    meta = gf.metadata
    arch = _get(gf, Keys.General.ARCHITECTURE, str)
    family = family_for_gguf(arch, str(gf.path))
    names = {f: k.format(arch=arch) for f, k in _CONFIG_KEYS.items()}
    values: dict[str, Any] = {f: meta[k] for f, k in names.items() if k in meta and "." not in f}
    values.update(family.gguf_values(meta, arch))
    values["arch"] = family.name
    names.update(
        sliding_window=f"{arch}.attention.sliding_window",
        attn_softcap=f"{arch}.attn_logit_softcapping",
        final_softcap=f"{arch}.final_logit_softcapping",
        rope_local_theta=f"{arch}.rope.freq_base_swa",
    )
    values.setdefault("rope_theta", 10000.0)
    # The head size: the key length if given, else the RoPE width, else dim / heads (LlamaConfig's default).
    key_length, rope_dims = Keys.Attention.KEY_LENGTH.format(arch=arch), Keys.Rope.DIMENSION_COUNT.format(arch=arch)
    head_key = key_length if key_length in meta else rope_dims if rope_dims in meta else None
    if head_key is not None:
        values["head_dim"], names["head_dim"] = meta[head_key], head_key
    names["vocab_size"] = "rows of token_embd.weight"

    embd = gf.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{gf.path} has no tensor 'token_embd.weight'; check that the file is a complete model")
    values["vocab_size"] = embd.shape[0]
    if _uses_llama3_scaling(gf, arch):
        keys = {f.split(".", 1)[1]: k for f, k in names.items() if f.startswith("rope_scaling.")}
        values["rope_scaling"] = {f: meta[k] for f, k in keys.items() if k in meta}
    elif "rope_freqs.weight" in gf.tensors:
        values["rope_freq_divisors"], names["rope_freq_divisors"] = _rope_freq_values(gf), "rope_freqs.weight"
    if any(t in gf.tensors for t in _LONG_ROPE.values()):
        values["long_rope"] = _long_rope_values(gf, arch)
        names.update({f"long_rope.{f}": k.format(arch=arch) for f, k in _LONG_ROPE.items()})
        names["long_rope"] = "rope_factors_long/short.weight"
    values["tied_embeddings"] = "output.weight" not in gf.tensors
    config = config_from_values(values, str(gf.path), names)

    check = ConfigCheck(str(gf.path))
    for other in (rope_dims, Keys.Attention.VALUE_LENGTH.format(arch=arch)):
        if other in meta and check.integer(other, meta[other]) != config.head_dim:
            raise ModelFormatError(
                f"{gf.path}: {other!r} is {meta[other]} but the head size is {config.head_dim}; perfx supports "
                "Llama models with full-width RoPE and equal key and value sizes only"
            )
    if len(embd.shape) != 2 or embd.shape[1] != config.dim:
        raise _bad_shape(gf, embd, ("vocab", config.dim))
    vocab_key = Keys.LLM.VOCAB_SIZE.format(arch=arch)
    if vocab_key in meta and check.integer(vocab_key, meta[vocab_key]) != config.vocab_size:
        raise _bad_meta(gf, f"{vocab_key} is {meta[vocab_key]}; token_embd.weight has {config.vocab_size} rows")
    _check_vocabulary(gf, config.vocab_size)
    if config.rope_scaling is not None and "rope_freqs.weight" in gf.tensors:
        _check_rope_freqs(gf, config.rope_scaling, config.head_dim, config.rope_theta)
    return config


def _check_vocabulary(gf: GGUFFile, rows: int) -> None:
    """The tokenizer must have one token per embedding row: others would be ids the model or the tokenizer lacks."""
    tokens = gf.metadata.get(Keys.Tokenizer.LIST)
    if isinstance(tokens, list) and len(tokens) != rows:
        raise ModelFormatError(
            f"{gf.path}: {Keys.Tokenizer.LIST!r} has {len(tokens)} tokens but token_embd.weight has {rows} rows; "
            "the tokenizer and the model disagree (llama.cpp refuses such a file too), so re-convert the model"
        )


def _uses_llama3_scaling(gf: GGUFFile, arch: str) -> bool:
    """Whether the metadata asks for Llama-3 RoPE scaling; ModelFormatError for kinds perfx does not run."""
    meta = gf.metadata
    type_key = Keys.Rope.SCALING_TYPE.format(arch=arch)
    kind = meta.get(type_key)
    if kind is not None and not isinstance(kind, str):
        raise _bad_meta(gf, f"{type_key!r} is {show(kind)}, not a scaling name such as 'llama3'")
    if kind is None:
        # llama.cpp treats a bare factor (or the old rope.scale_linear key) as linear scaling.
        factor_key = Keys.Rope.SCALING_FACTOR.format(arch=arch)
        linear = meta.get(factor_key, meta.get(f"{arch}.rope.scale_linear", 1.0))
        if not isinstance(linear, (int, float)) or float(linear) not in (0.0, 1.0):
            raise ModelFormatError(
                f"{gf.path} uses linear RoPE scaling (factor {show(linear)}), which perfx does not support; "
                "use a model without RoPE scaling or with Llama-3 scaling"
            )
        return False  # a bare rope_freqs.weight (llama.cpp's Llama-3.1 form) is read as divisors
    if kind == "none":
        if "rope_freqs.weight" in gf.tensors:
            raise _bad_meta(gf, "rope.scaling.type is 'none' but there is a rope_freqs.weight tensor")
        return False
    if kind != "llama3":
        raise ModelFormatError(
            f"{gf.path} uses RoPE scaling {show(kind)}; perfx supports 'llama3' scaling only, "
            "so use a model without RoPE scaling or with Llama-3 scaling"
        )
    return True


def _rope_freq_values(gf: GGUFFile) -> np.ndarray:
    """rope_freqs.weight given without scaling keys: llama.cpp divides each rotation speed by its value."""
    info = gf.tensors["rope_freqs.weight"]
    if len(info.shape) != 1 or info.ggml_type not in _FLOAT_TYPES:
        raise _bad_shape(gf, info, ("head size / 2",))
    return _floats(gf, info)  # a tensor the file holds, so its size is bounded by the file's


# LongRope field -> the tensor or key of Phi-3's LongRoPE (llama.cpp's converter writes no scaling type for it)
_LONG_ROPE = {
    "short_factors": "rope_factors_short.weight",
    "long_factors": "rope_factors_long.weight",
    "original_context_length": Keys.Rope.SCALING_ORIG_CTX_LEN,
    "attn_factor": Keys.Rope.SCALING_ATTN_FACTOR,
}


def _long_rope_values(gf: GGUFFile, arch: str) -> dict[str, Any]:
    """LongRope's fields as the file gives them (config_from_values checks them; no attention factor: the
    default for the context length, as the converter computes it)."""
    out: dict[str, Any] = {}
    for field, name in _LONG_ROPE.items():
        name = name.format(arch=arch)
        info = gf.tensors.get(name)
        if info is not None:
            if len(info.shape) != 1 or info.ggml_type not in _FLOAT_TYPES:
                raise _bad_shape(gf, info, ("head size / 2",))
            out[field] = _floats(gf, info)
        elif name in gf.metadata:
            out[field] = gf.metadata[name]
    return out


def llama3_rope_divisors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> np.ndarray:
    """Per-frequency divisors that Llama-3 scaling applies (what llama.cpp stores as rope_freqs.weight)."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old = scaling.original_context_length
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    out = np.where(wavelen < old / scaling.high_freq_factor, 1.0, mid)
    return np.where(wavelen > old / scaling.low_freq_factor, scaling.factor, out)


def _check_rope_freqs(gf: GGUFFile, scaling: RopeScaling, head_dim: int, rope_theta: float) -> None:
    info = gf.tensors["rope_freqs.weight"]
    if info.shape != (head_dim // 2,) or info.ggml_type not in _FLOAT_TYPES:
        raise _bad_shape(gf, info, (head_dim // 2,))
    stored = _floats(gf, info)
    if not np.allclose(stored, llama3_rope_divisors(scaling, head_dim, rope_theta), rtol=1e-3):
        raise ModelFormatError(
            f"{gf.path}: rope_freqs.weight disagrees with the rope scaling keys ({scaling}); perfx cannot tell "
            "which is right. Re-convert the model"
        )


# -- tokenizer metadata -------------------------------------------------------------------------------------


def check_tokenizer_metadata(metadata: dict[str, Any]) -> None:
    """Check the tokenizer.ggml.* keys have the right types and lengths; raise ModelFormatError if not."""
    K = Keys.Tokenizer

    def bad(msg: str) -> ModelFormatError:
        return ModelFormatError(f"tokenizer metadata: {msg}; the file is corrupt or was not converted for llama.cpp")

    model = metadata.get(K.MODEL)
    if not isinstance(model, str) or not model:
        raise bad(f"{K.MODEL!r} is {_describe(model)}, expected a tokenizer model name such as 'llama' or 'gpt2'")
    tokens = metadata.get(K.LIST)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad(f"{K.LIST!r} must be a non-empty array of strings, got {_describe(tokens)}")
    n = len(tokens)
    for key, kind in ((K.SCORES, "f"), (K.TOKEN_TYPE, "i")):
        arr = metadata.get(key)
        if arr is None:
            continue
        kinds = ("i", "u") if kind == "i" else ("f",)
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds:
            raise bad(f"{key!r} must be an array of {'floats' if kind == 'f' else 'integers'}, got {_describe(arr)}")
        if len(arr) != n:
            raise bad(f"{key!r} has {len(arr)} entries but there are {n} tokens")
    merges = metadata.get(K.MERGES)
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise bad(f"{K.MERGES!r} must be an array of strings, got {_describe(merges)}")
    for key in (K.BOS_ID, K.EOS_ID, K.UNK_ID, K.PAD_ID, K.EOT_ID, K.EOM_ID):
        tid = metadata.get(key)
        if tid is None:
            continue
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < n:
            # llama.cpp writes -1 (as a signed int) for "no such token"; anything else must index the vocabulary.
            if not (isinstance(tid, int) and tid == -1):
                raise bad(f"{key!r} is {tid!r}, not a token id in 0..{n - 1}")
    for key in (K.ADD_BOS, K.ADD_EOS, K.ADD_PREFIX):
        if key in metadata and not isinstance(metadata[key], bool):
            raise bad(f"{key!r} is {metadata[key]!r}, expected true or false")


def _describe(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype} with {len(v)} entries"
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v[:100]})
        return f"a list of {'/'.join(kinds) or 'nothing'}"
    return "missing" if v is None else type(v).__name__


# -- tensors ------------------------------------------------------------------------------------------------


def hf_row_order(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[order]``.

    llama.cpp's converter does ``w.reshape(n_heads, 2, head_dim // 2, -1).swapaxes(1, 2)``, which puts HF row
    ``h*hd + j*hd/2 + i`` at GGUF row ``h*hd + 2i + j``. Reading that back with swapped axes inverts it.
    """
    return np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


class TensorLoader:
    """Converts tensors of one GGUFFile into perfx formats, recording which types it had to widen."""

    def __init__(
        self, gf: GGUFFile, keep_blocks: frozenset[str] = frozenset(), weight_formats: frozenset[str] | None = None
    ):
        self.gf = gf
        self.keep_blocks = keep_blocks
        self.int5 = weight_formats is None or "int5" in weight_formats
        self.int6 = weight_formats is None or "int6" in weight_formats
        self.out_of_range: set[GGMLQuantizationType] = set()  # 5-bit types whose float16 scales overflowed
        self.widened: dict[GGMLQuantizationType, int] = defaultdict(int)  # type -> tensors widened to float16

    def info(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        info = self.gf.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.gf.path} has no tensor {name!r}; check that the file is a complete model")
        if info.shape != shape:
            raise _bad_shape(self.gf, info, shape)
        return info

    def vector(self, name: str, length: int) -> np.ndarray:
        return _floats(self.gf, self.info(name, (length,)))

    def matrix(self, name: str, shape: tuple[int, int], order: np.ndarray | None = None) -> Weight:
        """Tensor ``name`` in a perfx format; with ``order``, output row r is the file's row ``order[r]``."""
        info = self.info(name, shape)
        t = info.ggml_type
        raw = self.gf.tensor_data(name)
        rows, cols = shape
        if t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if t == GGMLQuantizationType.F32 else np.float16
            return DenseWeight(np.array(raw if order is None else raw[order], dtype=dtype))
        if t in _INT4_DECODERS:

            def as_int4() -> Int4Weight:
                groups = cols // 32
                out = (np.empty((rows, cols // 2), np.uint8), np.empty((rows, groups), np.float16))
                out += (np.empty((rows, groups), np.float32),)
                if t != GGMLQuantizationType.Q4_K:
                    return Int4Weight(*convert_rows(raw, cols, out, _INT4_DECODERS[t], order), 32)
                supers = cols // K_SUPER
                out += (np.empty((rows, supers), np.float16), np.empty((rows, supers), np.float16))
                out += (np.empty((rows, groups), np.uint8), np.empty((rows, groups), np.uint8))
                packed, scale, bias, *factors = convert_rows(raw, cols, out, q4_k_decode, order)
                return Int4Weight(packed, scale, bias, 32, Int4KScales(*factors))

            if t.name.lower() in self.keep_blocks:
                blocks = raw if order is None else np.take(raw, order, axis=0)
                return BlockWeight((blocks,), t.name.lower(), cols, as_int4)
            return as_int4()
        if t in _INT5_DECODERS and self.int5:
            groups = cols // 32
            out5 = (np.empty((rows, cols // 2), np.uint8), np.empty((rows, groups), "<u4"))
            out5 += (np.empty((rows, groups), np.float16), np.empty((rows, groups), np.float16))
            weight = Int5Weight(*convert_rows(raw, cols, out5, _INT5_DECODERS[t], order))
            if np.isfinite(weight.scale).all() and np.isfinite(weight.bias).all():
                return weight
            del weight  # a scale or bias past float16's range: Q5_0 as int8, the others widened below
            self.out_of_range.add(t)
        if t == GGMLQuantizationType.Q6_K and self.int6:
            out6 = (np.empty((rows, cols // 2), np.uint8), np.empty((rows, cols // 4), np.uint8))
            out6 += (np.empty((rows, cols // 16), np.int8), np.empty((rows, cols // 256), np.float16))
            return Int6Weight(*convert_rows(raw, cols, out6, q6_k_int6, order))
        if t in _INT8_DECODERS:
            decode, group, scale_dtype, dense_dtype = _INT8_DECODERS[t]
            out = (np.empty(shape, np.int8), np.empty((rows, cols // group), scale_dtype))
            return Int8Weight(*convert_rows(raw, cols, out, decode, order), group, dense_dtype)
        if t == GGMLQuantizationType.BF16:
            (data,) = convert_rows(raw, cols, (np.empty(shape, np.float32),), lambda bits: (bf16_to_f32(bits),), order)
            return DenseWeight(data)
        return self.widen(info, raw, order)

    def widen(self, info: TensorInfo, raw: np.ndarray, order: np.ndarray | None) -> DenseWeight:
        """A type perfx has no kernels for yet, dequantized to float16: within float16 rounding of the file's
        values (a re-quantization to int4 would lose far more), at 2 bytes per weight."""
        try:
            (data,) = convert_rows(
                raw, info.shape[1], (np.empty(info.shape, np.float16),), dequantize_f16(info.ggml_type), order
            )
        except NotImplementedError:  # types gguf cannot dequantize (integer tensors, F64, new types)
            raise ModelFormatError(
                f"{self.gf.path}: tensor {info.name!r} has type {info.ggml_type.name}, which perfx cannot "
                "convert; use a GGUF quantized to Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F16 or BF16"
            ) from None
        self.widened[info.ggml_type] += 1
        return DenseWeight(data)

    def _widening_reason(self, t: GGMLQuantizationType) -> str:
        if t in self.out_of_range:
            return "their scales or minimums exceed float16's range, which int5 holds them in"
        if t in _INT5_DECODERS:
            return "this backend has no int5 kernels"
        return f"perfx has no {t.name} kernels yet"

    def widen_notes(self) -> list[str]:
        notes = []
        for t, count in self.widened.items():
            msg = (
                f"{count} {t.name} tensors were widened to float16 (2 bytes per weight, within float16 "
                f"rounding of the file's values): {self._widening_reason(t)}"
            )
            warnings.warn(msg, stacklevel=3)
            notes.append(msg)
        return notes


_INT4_DECODERS = {
    GGMLQuantizationType.Q4_0: q4_decoder(GGMLQuantizationType.Q4_0),
    GGMLQuantizationType.Q4_1: q4_decoder(GGMLQuantizationType.Q4_1),
    GGMLQuantizationType.Q4_K: q4_k_decode,
}
_INT5_DECODERS = {
    GGMLQuantizationType.Q5_0: q5_0_int5,
    GGMLQuantizationType.Q5_1: q5_1_int5,
    GGMLQuantizationType.Q5_K: q5_k_int5,
}
# type -> (decoder, group, scale dtype, Int8Weight.dense_dtype: what a runtime without int8 gets; Q8_0 exact in
# float32, Q5_0 and Q6_K in float16, rounded, at 2 bytes per weight); Q5_0 and Q6_K take this form only for a
# runtime without int5 / int6 (or for a Q5_0 whose 16 d overflows float16)
_INT8_DECODERS = {
    GGMLQuantizationType.Q8_0: (q8_0_decode, 32, np.float16, "float32"),
    GGMLQuantizationType.Q5_0: (q5_0_decode, 32, np.float16, "float16"),
    GGMLQuantizationType.Q6_K: (q6_k_decode, 16, np.float32, "float16"),
}


def _floats(gf: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A small tensor (norm weights, rope_freqs) as float32, whatever its storage type."""
    raw = gf.tensor_data(info.name)
    if info.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(raw, dtype=np.float32)
    if info.ggml_type == GGMLQuantizationType.BF16:
        return bf16_to_f32(np.asarray(raw))
    try:
        return np.asarray(gguf_quants.dequantize(np.asarray(raw), info.ggml_type), dtype=np.float32).reshape(info.shape)
    except NotImplementedError:
        raise ModelFormatError(
            f"{gf.path}: tensor {info.name!r} has type {info.ggml_type.name}, which perfx cannot read as floats; "
            "re-convert the model"
        ) from None


# -- metadata helpers ---------------------------------------------------------------------------------------

_REQUIRED = object()
_FIX = "the file is corrupt or was converted wrongly; re-download or re-convert it"


def _get(gf: GGUFFile, key: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
    if key not in gf.metadata:
        if default is _REQUIRED:
            raise ModelFormatError(f"{gf.path} lacks the required metadata key {key!r}; {_FIX}")
        return default
    v = gf.metadata[key]
    if not isinstance(v, kind):
        expected = "a number" if isinstance(kind, tuple) else kind.__name__
        raise ModelFormatError(f"{gf.path}: metadata {key!r} is {_describe(v)}, expected {expected}; {_FIX}")
    return v


def _bad_meta(gf: GGUFFile, msg: str) -> ModelFormatError:
    return ModelFormatError(f"{gf.path}: {msg}; {_FIX}")


def _bad_shape(gf: GGUFFile, info: TensorInfo, expected: tuple) -> ModelFormatError:
    return ModelFormatError(
        f"{gf.path}: tensor {info.name!r} has shape {info.shape} but the metadata implies {expected}; {_FIX}"
    )
