"""A float32 NumPy forward pass of one block of any family perfx runs, over calibration batches, recording each
linear's input.

Written for quantization only (no KV cache, whole sequences at once), so AWQ sees exactly the activations of
the float model that it is asked to preserve. It computes what perfx_core.model computes, step for step: the
q/k/v biases (Qwen2), the per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3), the score scale and soft-cap
(Gemma), the sliding-window mask of the layers that slide, the sliding layers' own RoPE base (Gemma 3), the
norms of the attention and MLP outputs (Gemma) and the gated MLP's activation (SwiGLU or tanh-GELU GeGLU).
Norm weights are used as stored, (1 + w) already applied (every loader adds Gemma's 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..config import LlamaConfig
from ..rope import rope_cos_sin


@dataclass
class BlockInputs:
    """Inputs of a block's linear layers, flattened over samples and tokens: (tokens, features) float32."""

    attn_in: np.ndarray  # (N, dim): attn_norm's output, read by wq, wk, wv
    o_in: np.ndarray  # (N, q_dim): attention output, read by wo
    ffn_in: np.ndarray  # (N, dim): ffn_norm's output, read by w_gate, w_up
    down_in: np.ndarray  # (N, ffn_dim): act(gate) * up, read by w_down


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-np.clip(x, -80.0, 80.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}  # config.activation -> the gate's activation


def rope_tables(config: LlamaConfig, seqlen: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(cos, sin) of positions 0..seqlen-1 for each layer, as perfx_core.model builds them: the sliding layers
    rotate with ``rope_local_theta`` where it differs (Gemma 3). The table is made for the context perfx loads
    the model with by default (api.DEFAULT_CONTEXT, at most the model's), so LongRoPE (Phi-3) picks the factor
    set a default load runs; for every other RoPE the values do not depend on the table's length."""
    from ..api import DEFAULT_CONTEXT

    length = max(seqlen, min(DEFAULT_CONTEXT, config.context_length))
    full = rope_cos_sin(config, length)
    local = full
    theta = config.rope_local_theta
    if theta is not None and theta != config.rope_theta:
        local = rope_cos_sin(dataclasses.replace(config, rope_theta=theta, rope_scaling=None), length)
    tables = []
    for i in range(config.n_layers):
        cos, sin = local if config.is_sliding(i) else full
        tables.append((cos[:seqlen], sin[:seqlen]))
    return tables


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (heads, T, head_dim) with cos/sin (T, head_dim // 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    config: LlamaConfig,
    cos: np.ndarray,
    sin: np.ndarray,
    layer: int = 0,
) -> np.ndarray:
    """Causal GQA attention of one sequence: q (T, q_dim), k/v (T, kv_dim) -> (T, q_dim), with layer
    ``layer``'s window, the config's score scale and soft-cap."""
    t, hd = q.shape[0], config.head_dim
    group = config.n_heads // config.n_kv_heads
    qh = _rope(q.reshape(t, config.n_heads, hd).transpose(1, 0, 2), cos[:t], sin[:t])
    kh = _rope(k.reshape(t, config.n_kv_heads, hd).transpose(1, 0, 2), cos[:t], sin[:t])
    vh = v.reshape(t, config.n_kv_heads, hd).transpose(1, 0, 2)
    kh, vh = np.repeat(kh, group, axis=0), np.repeat(vh, group, axis=0)  # head h reads kv head h // group
    scale = config.attn_scale if config.attn_scale is not None else 1.0 / np.sqrt(hd)
    scores = qh @ kh.transpose(0, 2, 1) * np.float32(scale)
    if config.attn_softcap is not None:
        cap = np.float32(config.attn_softcap)
        scores = cap * np.tanh(scores / cap)
    query, key = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = key <= query
    if config.is_sliding(layer):
        visible &= key > query - config.sliding_window  # the last sliding_window positions, the query's included
    scores = np.where(visible, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ vh).transpose(1, 0, 2).reshape(t, config.q_dim)


def _head_norm(x: np.ndarray, weight: np.ndarray, head_dim: int, eps: float) -> np.ndarray:
    """RMSNorm of each head of rows x (N, heads * head_dim), one weight (head_dim,) for every head."""
    n = x.shape[0]
    return rmsnorm(x.reshape(n, -1, head_dim), weight, eps).reshape(n, -1)


def block_forward(
    h: np.ndarray,
    w: dict[str, np.ndarray],
    config: LlamaConfig,
    cos: np.ndarray,
    sin: np.ndarray,
    record: bool = True,
    *,
    layer: int = 0,
) -> tuple[np.ndarray, BlockInputs | None]:
    """Run block ``layer`` (weights ``w``, perfx names) on hidden states h (B, T, dim) with that layer's RoPE
    table; returns the new hidden states and, if asked, the inputs of its linears."""
    b, t, d = h.shape
    eps = config.norm_eps
    x = rmsnorm(h.reshape(b * t, d), w["attn_norm"], eps)
    q, k, v = x @ w["wq"].T, x @ w["wk"].T, x @ w["wv"].T
    if config.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if config.qk_norm:
        q = _head_norm(q, w["q_norm"], config.head_dim, eps)
        k = _head_norm(k, w["k_norm"], config.head_dim, eps)
    rows = [slice(s * t, (s + 1) * t) for s in range(b)]
    ctx = np.concatenate([attention(q[r], k[r], v[r], config, cos, sin, layer) for r in rows])
    attn_out = ctx @ w["wo"].T
    if config.post_norms:
        attn_out = rmsnorm(attn_out, w["post_attn_norm"], eps)
    h2 = h.reshape(b * t, d) + attn_out
    x2 = rmsnorm(h2, w["ffn_norm"], eps)
    act = ACTIVATIONS[config.activation](x2 @ w["w_gate"].T) * (x2 @ w["w_up"].T)
    ffn_out = act @ w["w_down"].T
    if config.post_norms:
        ffn_out = rmsnorm(ffn_out, w["post_ffn_norm"], eps)
    out = (h2 + ffn_out).reshape(b, t, d)
    return out, (BlockInputs(x, ctx, x2, act) if record else None)
