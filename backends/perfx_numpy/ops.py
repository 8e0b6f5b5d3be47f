"""The NumPy backend's primitive ops (contract in perfx_core/ops.py and docs/ops.md), in float32."""

from __future__ import annotations

import numpy as np

from perfx_core.weights import Int4Weight, Int5Weight, Int6Weight, Int8Weight, int8_rows, split_rows, unpack_int4

# float32 bytes of the block of rows int8_gemm converts at a time (measured on SmolLM2's 49152 x 576 LM head, one
# token: 1 MiB 10.6 ms, 4 MiB 9.4 ms, 16 MiB 22.9 ms, past the caches).
INT8_BLOCK_BYTES = 4 << 20


def embedding(rt, table, ids, out):
    weight = table.weight
    if isinstance(weight, Int8Weight):
        int8_rows(weight, ids, out)  # only the looked-up rows, never the whole table
    elif isinstance(weight, Int5Weight | Int6Weight):
        split_rows(weight, ids, out)
    elif isinstance(weight, Int4Weight):
        # Dequantize only the looked-up rows: the table can be the largest matrix of the model.
        rows = len(ids)
        g = weight.group_size
        q = unpack_int4(weight.packed[ids]).reshape(rows, -1, g).astype(np.float32)
        scale, bias = weight.factors(ids)
        out[...] = (q * scale[:, :, None] + bias[:, :, None]).reshape(rows, -1)
    else:
        out[...] = weight.data[ids]


def _matmul(x, w, out):
    """out = x @ w.T. One token goes through W @ x (BLAS gemv): measured 2x faster than (1, k) @ W.T here."""
    if x.shape[0] == 1:
        np.matmul(w, x[0], out=out[0])
    else:
        np.matmul(x, w.T, out=out)


def int4_gemv(rt, x, w, out):
    _matmul(x, w.float32(), out)


def int4_gemm(rt, x, w, out):
    _matmul(x, w.float32(), out)


def dense_gemm(rt, x, w, out):
    _matmul(x, w.float32(), out)


def int8_gemm(rt, x, w, out):
    """out = x @ W.T a block of rows at a time, its codes converted into one reused float32 buffer: memory holds
    the int8 weight plus that buffer, never a float copy of the matrix."""
    weight = w.weight
    m, k = weight.shape
    n, g = x.shape[0], weight.group_size
    rows = max(1, min(m, INT8_BLOCK_BYTES // (4 * k)))
    values = rt.scratch("numpy.int8_gemm", (rows, k))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block = values[: r1 - r0]
        block[...] = weight.codes[r0:r1]
        groups = block.reshape(r1 - r0, k // g, g)
        scale = weight.scale[r0:r1].astype(np.float32)
        if n == 1:
            # One token: the dot product of each group, then its scale, so the block is read once after its
            # conversion (scaling it first made the LM head 1.8x slower).
            dots = np.matmul(groups.transpose(1, 0, 2), x.reshape(k // g, g, 1))  # (groups, rows, 1)
            np.einsum("gr,rg->r", dots[:, :, 0], scale, out=out[0, r0:r1])
        else:
            groups *= scale[:, :, None]
            np.matmul(x, block.T, out=out[:, r0:r1])


def split_gemm(rt, x, w, out):
    """int5_gemm and int6_gemm: out = x @ W.T a block of rows at a time, as int8_gemm: the weight plus one reused
    float32 buffer."""
    weight = w.weight
    m, k = weight.shape
    rows = max(1, min(m, INT8_BLOCK_BYTES // (4 * k)))
    values = rt.scratch("numpy.split_gemm", (rows, k))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block = split_rows(weight, slice(r0, r1), values[: r1 - r0])
        _matmul(x, block, out[:, r0:r1])


int5_gemm = int6_gemm = split_gemm


def rmsnorm(rt, x, weight, eps, out):
    mean_square = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    np.multiply(x, 1.0 / np.sqrt(mean_square + np.float32(eps)), out=out)
    out *= weight


def add_rmsnorm(rt, x, residual, weight, eps, out):
    residual += x
    rmsnorm(rt, residual, weight, eps, out)


def silu_mul(rt, gate_up, out):
    f = out.shape[-1]
    gate = gate_up[:, :f]
    # silu(g) = g * sigmoid(g), with sigmoid written through tanh so large |g| cannot overflow exp.
    np.multiply(gate, 0.5 * (1.0 + np.tanh(0.5 * gate)), out=out)
    out *= gate_up[:, f:]


def gelu_mul(rt, gate_up, out):
    f = out.shape[-1]
    g = gate_up[:, :f]
    np.multiply(
        g, 0.5 * (1.0 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g))), out=out
    )
    out *= gate_up[:, f:]


def add_bias(rt, x, bias, out):
    np.add(x, bias, out=out)


def write_columns(rt, x, start, out):
    out[:, start : start + x.shape[1]] = x


def head_rmsnorm(rt, qkv, q_weight, k_weight, eps, spec, out):
    t, hd = qkv.shape[0], spec.head_dim
    q_end, k_end = spec.q_dim, spec.q_dim + spec.kv_dim
    for lo, hi, heads, weight in ((0, q_end, spec.n_heads, q_weight), (q_end, k_end, spec.n_kv_heads, k_weight)):
        x = qkv[:, lo:hi].reshape(t, heads, hd)
        rmsnorm(rt, x, weight, eps, out[:, lo:hi].reshape(t, heads, hd))
    out[:, k_end:] = qkv[:, k_end:]


def scale(rt, x, factor, out):
    np.multiply(x, np.float32(factor), out=out)


def softcap(rt, x, cap, out):
    np.multiply(np.tanh(x / np.float32(cap)), np.float32(cap), out=out)


FAMILY_OPS = ("add_bias", "head_rmsnorm", "gelu_mul", "scale", "softcap")


def _rope(x, cos, sin):
    """Rotate-half RoPE on x (..., tokens, head_dim) with cos/sin (tokens, head_dim // 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _split_heads(qkv, spec):
    """qkv (T, qkv_dim) -> q (n_heads, T, hd), k and v (n_kv_heads, T, hd)."""
    t = qkv.shape[0]
    hd = spec.head_dim
    q = qkv[:, : spec.q_dim].reshape(t, spec.n_heads, hd).transpose(1, 0, 2)
    k = qkv[:, spec.q_dim : spec.q_dim + spec.kv_dim].reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
    v = qkv[:, spec.q_dim + spec.kv_dim :].reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
    return q, k, v


def _attend(q, keys, values, spec, start):
    """Causal grouped-query attention of q (n_heads, T, hd) at positions start.. over keys/values (kv, S, hd)."""
    n_kv, seq_len, hd = keys.shape
    group = spec.n_heads // n_kv
    t = q.shape[1]
    q = q.reshape(n_kv, group * t, hd)
    scores = np.matmul(q, keys.transpose(0, 2, 1).astype(np.float32, copy=False)) * np.float32(spec.score_scale)
    scores = scores.reshape(n_kv, group, t, seq_len)
    if spec.softcap is not None:
        cap = np.float32(spec.softcap)
        scores = np.tanh(scores / cap) * cap
    query_pos = start + np.arange(t)[:, None]
    hidden = np.arange(seq_len)[None, :] > query_pos
    if spec.window is not None:
        hidden |= np.arange(seq_len)[None, :] <= query_pos - spec.window
    if t > 1 or spec.window is not None:
        scores[..., hidden] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    mixed = np.matmul(scores.reshape(n_kv, group * t, seq_len), values.astype(np.float32, copy=False))
    return mixed.reshape(spec.n_heads, t, hd)


def attention_decode(rt, qkv, cache, layer, slots, positions, rope, spec, out):
    for b, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        q, k, v = _split_heads(qkv[b : b + 1], spec)
        cos, sin = rope.cos[pos : pos + 1], rope.sin[pos : pos + 1]
        cache.k[layer, slot, :, pos : pos + 1] = _rope(k, cos, sin)
        cache.v[layer, slot, :, pos : pos + 1] = v
        keys, values = cache.k[layer, slot, :, : pos + 1], cache.v[layer, slot, :, : pos + 1]
        mixed = _attend(_rope(q, cos, sin), keys, values, spec, pos)
        out[b] = mixed.reshape(-1)


def attention_prefill(rt, qkv, cache, layer, slot, start, rope, spec, out):
    t = qkv.shape[0]
    end = start + t
    q, k, v = _split_heads(qkv, spec)
    cos, sin = rope.cos[start:end], rope.sin[start:end]
    cache.k[layer, slot, :, start:end] = _rope(k, cos, sin)
    cache.v[layer, slot, :, start:end] = v
    mixed = _attend(_rope(q, cos, sin), cache.k[layer, slot, :, :end], cache.v[layer, slot, :, :end], spec, start)
    out[...] = mixed.transpose(1, 0, 2).reshape(t, spec.q_dim)


# The attention ops implement every optional feature of AttentionSpec.
for _op in (attention_decode, attention_prefill):
    _op.perfx_features = ("window", "softcap", "scale")
