"""Float64 NumPy statements of every primitive op's semantics, written from the contract in docs/ops.md.

The conformance kit (perfx_core.conformance) compares backends against these functions. They take plain
host arrays, never modify their arguments and return new arrays. They share no code with any backend,
and decode the int4, int8, int5 and int6 formats themselves, so a mistake in a backend (or in weights.dequantize)
shows up as a difference instead of being copied into the reference.
"""

from __future__ import annotations

import numpy as np

from .specs import AttentionSpec
from .weights import DenseWeight, Int4Weight, Int5Weight, Int6Weight, Int8Weight, Weight


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, bias: np.ndarray, group_size: int) -> np.ndarray:
    """(rows, cols) float64 values: column 2j is the low nibble of packed[:, j], column 2j+1 the high one."""
    rows, half = packed.shape
    codes = np.empty((rows, 2 * half), dtype=np.float64)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    group = np.arange(2 * half) // group_size  # the group of each input column
    return codes * scale.astype(np.float64)[:, group] + bias.astype(np.float64)[:, group]


def dequantize_int8(codes: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """(rows, cols) float64 values: code (r, c) times the scale of its group, scale[r, c // group_size]."""
    group = np.arange(codes.shape[1]) // group_size
    return codes.astype(np.float64) * scale.astype(np.float64)[:, group]


def _int5_codes(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """(rows, cols) float64 codes of Int5Weight: column 32g + j (j < 16) is the low nibble of byte 16g + j, column
    32g + 16 + j its high nibble, plus 16 where bit j (resp. 16 + j) of high[:, g] is set."""
    rows, half = low.shape
    codes = np.empty((rows, 2 * half), dtype=np.float64)
    for j in range(16):
        codes[:, j::32] = low[:, j::16] & 0x0F
        codes[:, 16 + j :: 32] = low[:, j::16] >> 4
    plane = high.astype(np.uint64)
    for bit in range(32):
        codes[:, bit::32] += 16.0 * ((plane >> np.uint64(bit)) & np.uint64(1))
    return codes


def dequantize_int5(low: np.ndarray, high: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """(rows, cols) float64 values of Int5Weight arrays: code * scale + bias per group of 32."""
    group = np.arange(2 * low.shape[1]) // 32
    return _int5_codes(low, high) * scale.astype(np.float64)[:, group] + bias.astype(np.float64)[:, group]


def dequantize_int6(ql: np.ndarray, qh: np.ndarray, sub: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(rows, cols) float64 values of Int6Weight arrays (GGUF Q6_K's blocks, split), by the gguf library's own
    Q6_K dequantization of the blocks they make up."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    rows, blocks = d.shape
    parts = (
        ql.reshape(rows, blocks, 128),
        qh.reshape(rows, blocks, 64),
        sub.view(np.uint8).reshape(rows, blocks, 16),
        np.ascontiguousarray(d).view(np.uint8).reshape(rows, blocks, 2),
    )
    raw = np.concatenate(parts, axis=2).reshape(rows, blocks * 210)
    return gguf_quants.dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float64).reshape(rows, blocks * 256)


def weight_values(weight: Weight) -> np.ndarray:
    """The (rows, cols) float64 values a weight stands for, in any host format."""
    if isinstance(weight, Int4Weight):
        return dequantize_int4(weight.packed, *weight.factors(), weight.group_size)
    if isinstance(weight, Int8Weight):
        return dequantize_int8(weight.codes, weight.scale, weight.group_size)
    if isinstance(weight, Int5Weight):
        return dequantize_int5(weight.low, weight.high, weight.scale, weight.bias)
    if isinstance(weight, Int6Weight):
        return dequantize_int6(weight.ql, weight.qh, weight.sub, weight.d)
    if isinstance(weight, DenseWeight):
        return weight.data.astype(np.float64)
    raise TypeError(f"not a perfx host weight: {type(weight).__name__}")


def embedding(table: Weight, ids: np.ndarray) -> np.ndarray:
    """(n, d): row ids[i] of the table's values."""
    ids = np.asarray(ids)
    if isinstance(table, Int8Weight):  # only the rows looked up: an int8 table is often the largest matrix
        return dequantize_int8(table.codes[ids], table.scale[ids], table.group_size)
    if isinstance(table, Int5Weight):
        return dequantize_int5(table.low[ids], table.high[ids], table.scale[ids], table.bias[ids])
    if isinstance(table, Int6Weight):
        return dequantize_int6(table.ql[ids], table.qh[ids], table.sub[ids], table.d[ids])
    return weight_values(table)[ids]


def matmul(x: np.ndarray, weight: Weight) -> np.ndarray:
    """(n, m) = x (n, k) @ w.T: the int4, int8, int5 and int6 matmuls, dense_gemm, linear, qkv_proj and logits."""
    return np.asarray(x, dtype=np.float64) @ weight_values(weight).T


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2 over the last axis) + eps) * weight; eps sits inside the square root."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, dtype=np.float64)


def add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(new residual, normed): the residual stream gains x, and the norm is taken of the sum."""
    new_residual = np.asarray(residual, dtype=np.float64) + np.asarray(x, dtype=np.float64)
    return new_residual, rmsnorm(new_residual, weight, eps)


def linear_add_rmsnorm(
    x: np.ndarray, weight: Weight, residual: np.ndarray, norm_weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """(new residual, normed output) of residual += x @ w.T; out = rmsnorm(residual) * norm_weight."""
    return add_rmsnorm(matmul(x, weight), residual, norm_weight, eps)


def linear_post_norm_add_rmsnorm(
    x: np.ndarray, weight: Weight, post_weight: np.ndarray, residual: np.ndarray, norm_weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """(new residual, normed output) of residual += rmsnorm(x @ w.T) * post_weight; out = rmsnorm(residual) * w."""
    return add_rmsnorm(rmsnorm(matmul(x, weight), post_weight, eps), residual, norm_weight, eps)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written so that no exp overflows for large |x|."""
    x = np.asarray(x, dtype=np.float64)
    return x * np.where(x >= 0, 1.0 / (1.0 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1.0 + np.exp(-np.abs(x))))


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """(n, f) = silu(gate_up[:, :f]) * gate_up[:, f:]."""
    f = gate_up.shape[-1] // 2
    gate_up = np.asarray(gate_up, dtype=np.float64)
    return silu(gate_up[:, :f]) * gate_up[:, f:]


def gate_up_silu(x: np.ndarray, w_gate_up: Weight) -> np.ndarray:
    """(n, f) = silu(x @ w_gate.T) * (x @ w_up.T) with w_gate_up = [w_gate; w_up]."""
    return silu_mul(matmul(x, w_gate_up))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh)."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gelu_mul(gate_up: np.ndarray) -> np.ndarray:
    """(n, f) = gelu_tanh(gate_up[:, :f]) * gate_up[:, f:]."""
    f = gate_up.shape[-1] // 2
    gate_up = np.asarray(gate_up, dtype=np.float64)
    return gelu_tanh(gate_up[:, :f]) * gate_up[:, f:]


def add_bias(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64) + np.asarray(bias, dtype=np.float64)


def head_rmsnorm(
    qkv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, eps: float, spec: AttentionSpec
) -> np.ndarray:
    """qkv rows with every q head normed by q_weight and every k head by k_weight (head_dim,); v unchanged."""
    qkv = np.asarray(qkv, dtype=np.float64)
    t, hd = qkv.shape[0], spec.head_dim
    q = rmsnorm(qkv[:, : spec.q_dim].reshape(t, spec.n_heads, hd), q_weight, eps).reshape(t, -1)
    k = rmsnorm(qkv[:, spec.q_dim : spec.q_dim + spec.kv_dim].reshape(t, spec.n_kv_heads, hd), k_weight, eps)
    return np.concatenate([q, k.reshape(t, -1), qkv[:, spec.q_dim + spec.kv_dim :]], axis=1)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return cap * np.tanh(np.asarray(x, dtype=np.float64) / cap)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (..., T, head_dim) with cos/sin (T, head_dim // 2) of the tokens' positions.

    Pair (x[i], x[i + h]), h = head_dim / 2, becomes (x[i] cos - x[i + h] sin, x[i + h] cos + x[i] sin).
    """
    x = np.asarray(x, dtype=np.float64)
    cos = np.asarray(cos, dtype=np.float64)
    sin = np.asarray(sin, dtype=np.float64)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def split_qkv(qkv: np.ndarray, spec: AttentionSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qkv rows [q | k | v] (T, qkv_dim) -> q (n_heads, T, hd), k and v (n_kv_heads, T, hd), float64."""
    qkv = np.asarray(qkv, dtype=np.float64)
    t, hd = qkv.shape[0], spec.head_dim
    q = qkv[:, : spec.q_dim].reshape(t, spec.n_heads, hd).transpose(1, 0, 2)
    k = qkv[:, spec.q_dim : spec.q_dim + spec.kv_dim].reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
    v = qkv[:, spec.q_dim + spec.kv_dim :].reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
    return q, k, v


def causal_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    first_position: int,
    spec: AttentionSpec | None = None,
) -> np.ndarray:
    """Softmax attention of q (n_heads, T, hd) at positions first_position.. over keys/values (n_kv, S, hd).

    Query t sees key positions 0..first_position + t (with ``spec.window`` W, only the last W of them). Query
    head h reads kv head h // (n_heads / n_kv) (each kv head serves a run of consecutive query heads, as Hugging
    Face's repeat_kv). Scores are q.k times ``spec.score_scale`` (1/sqrt(hd) by default), then soft-capped to
    softcap * tanh(s / softcap) with ``spec.softcap``.
    """
    n_heads, t, hd = q.shape
    n_kv, seq_len, _ = keys.shape
    group = n_heads // n_kv
    kv_of_head = np.arange(n_heads) // group
    scale = spec.score_scale if spec is not None else 1.0 / np.sqrt(hd)
    scores = np.einsum("htd,hsd->hts", q, keys[kv_of_head]) * scale
    if spec is not None and spec.softcap is not None:
        scores = spec.softcap * np.tanh(scores / spec.softcap)
    query_pos = first_position + np.arange(t)[:, None]
    visible = np.arange(seq_len)[None, :] <= query_pos
    if spec is not None and spec.window is not None:
        visible &= np.arange(seq_len)[None, :] > query_pos - spec.window
    scores = np.where(visible, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.einsum("hts,hsd->htd", scores, values[kv_of_head])


def attention_prefill(
    qkv: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    layer: int,
    slot: int,
    start: int,
    cos: np.ndarray,
    sin: np.ndarray,
    spec: AttentionSpec,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out (T, q_dim), new k cache, new v cache) for T tokens at positions start..start+T-1 of one slot.

    Caches are in the canonical layout (layer, slot, kv_head, position, head_dim). RoPE'd k and raw v of the
    new tokens are stored at their positions; every query then attends causally over the stored keys, read
    back at the cache's precision, so history before ``start`` counts and positions after it do not.
    """
    t = qkv.shape[0]
    end = start + t
    q, k, v = split_qkv(qkv, spec)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    k_cache[layer, slot, :, start:end] = rope(k, cos[start:end], sin[start:end])
    v_cache[layer, slot, :, start:end] = v
    keys = k_cache[layer, slot, :, :end].astype(np.float64)
    values = v_cache[layer, slot, :, :end].astype(np.float64)
    mixed = causal_attention(rope(q, cos[start:end], sin[start:end]), keys, values, start, spec)
    return mixed.transpose(1, 0, 2).reshape(t, spec.q_dim), k_cache, v_cache


def attention_decode(
    qkv: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    layer: int,
    slots: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    spec: AttentionSpec,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out (B, q_dim), new k cache, new v cache): one new token per row b, of sequence slots[b] at positions[b].

    Each row is a one-token prefill of its own slot; slots in one batch are distinct, so rows are independent.
    """
    out = np.empty((qkv.shape[0], spec.q_dim), dtype=np.float64)
    for b, (slot, pos) in enumerate(zip(np.asarray(slots).tolist(), np.asarray(positions).tolist(), strict=True)):
        out[b : b + 1], k_cache, v_cache = attention_prefill(
            qkv[b : b + 1], k_cache, v_cache, layer, slot, pos, cos, sin, spec
        )
    return out, k_cache, v_cache


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """Normalized mean squared error sum((out - ref)^2) / sum(ref^2), in float64 (NaN if out has NaN)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    denominator = float(np.sum(ref * ref))
    error = float(np.sum((out - ref) ** 2))
    return error / denominator if denominator > 0 else error
