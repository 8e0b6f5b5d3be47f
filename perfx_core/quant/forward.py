"""A float32 NumPy forward pass of one Llama block over calibration batches, recording each linear's input.

Written for quantization only (no KV cache, whole sequences at once), so AWQ sees exactly the activations
of the float model that it is asked to preserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import LlamaConfig


@dataclass
class BlockInputs:
    """Inputs of a block's linear layers, flattened over samples and tokens: (tokens, features) float32."""

    attn_in: np.ndarray  # (N, dim): RMSNorm output, read by wq, wk, wv
    o_in: np.ndarray  # (N, q_dim): attention output, read by wo
    ffn_in: np.ndarray  # (N, dim): RMSNorm output, read by w_gate, w_up
    down_in: np.ndarray  # (N, ffn_dim): silu(gate) * up, read by w_down


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-np.clip(x, -80.0, 80.0)))


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (heads, T, head_dim) with cos/sin (T, head_dim // 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, config: LlamaConfig, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """Causal GQA attention of one sequence: q (T, q_dim), k/v (T, kv_dim) -> (T, q_dim)."""
    t, hd = q.shape[0], config.head_dim
    group = config.n_heads // config.n_kv_heads
    qh = _rope(q.reshape(t, config.n_heads, hd).transpose(1, 0, 2), cos[:t], sin[:t])
    kh = _rope(k.reshape(t, config.n_kv_heads, hd).transpose(1, 0, 2), cos[:t], sin[:t])
    vh = v.reshape(t, config.n_kv_heads, hd).transpose(1, 0, 2)
    kh, vh = np.repeat(kh, group, axis=0), np.repeat(vh, group, axis=0)  # head h reads kv head h // group
    scores = qh @ kh.transpose(0, 2, 1) / np.float32(np.sqrt(hd))
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ vh).transpose(1, 0, 2).reshape(t, config.q_dim)


def block_forward(
    h: np.ndarray, w: dict[str, np.ndarray], config: LlamaConfig, cos: np.ndarray, sin: np.ndarray, record: bool = True
) -> tuple[np.ndarray, BlockInputs | None]:
    """Run one block on hidden states h (B, T, dim); returns the new hidden states and, if asked, the inputs."""
    b, t, d = h.shape
    eps = config.norm_eps
    x = rmsnorm(h.reshape(b * t, d), w["attn_norm"], eps)
    q, k, v = x @ w["wq"].T, x @ w["wk"].T, x @ w["wv"].T
    ctx = np.concatenate(
        [
            attention(q[s * t : (s + 1) * t], k[s * t : (s + 1) * t], v[s * t : (s + 1) * t], config, cos, sin)
            for s in range(b)
        ]
    )
    h2 = h.reshape(b * t, d) + ctx @ w["wo"].T
    x2 = rmsnorm(h2, w["ffn_norm"], eps)
    act = silu(x2 @ w["w_gate"].T) * (x2 @ w["w_up"].T)
    out = (h2 + act @ w["w_down"].T).reshape(b, t, d)
    return out, (BlockInputs(x, ctx, x2, act) if record else None)
