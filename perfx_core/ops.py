"""The operator contract: every op the model calls, and the table that binds a runtime to its chosen ops.

Full semantics, shapes and dtypes are in docs/ops.md; the short form is here. Every op takes the runtime
first, writes its result into ``out`` (a tensor the caller allocated) and returns None. Activations are
float32 (a backend may also accept float16). Index arguments (ids, slots, positions) are host NumPy
int32 arrays; ``slot``, ``start`` and ``layer`` are Python ints. ``out`` never overlaps an input, and an
op writes nothing outside ``out`` except where stated: add_rmsnorm updates ``residual``, the attention ops
write the new positions of the KV cache and may overwrite ``qkv`` (e.g. RoPE in place).

Primitive ops (a backend must implement these):
  embedding(table, ids (n,), out (n, d))                 rows of the table, dequantized
  int4_gemv(x (1, k), w int4 (m, k), out (1, m))          out = x @ w.T
  int4_gemm(x (n, k), w int4 (m, k), out (n, m))          out = x @ w.T
  dense_gemm(x (n, k), w dense (m, k), out (n, m))        out = x @ w.T
  rmsnorm(x (n, d), weight (d,), eps, out (n, d))         out = x / sqrt(mean(x^2) + eps) * weight
  add_rmsnorm(x, residual, weight, eps, out)              residual += x (in place); out = rmsnorm(residual)
  silu_mul(gate_up (n, 2f), out (n, f))                   out = silu(gate_up[:, :f]) * gate_up[:, f:]
  attention_decode(qkv (B, qkv_dim), cache, layer, slots (B,), positions (B,), rope, spec, out (B, q_dim))
  attention_prefill(qkv (T, qkv_dim), cache, layer, slot, start, rope, spec, out (T, q_dim))

Ops of an optional weight format (a runtime that lists the format in ``Runtime.weight_formats`` implements them,
and its ``embedding`` takes tables in that format too; weights.for_runtime widens the format for other runtimes):
  int8_gemm(x (n, k), w int8 (m, k), out (n, m))          out = x @ w.T, w = codes * scale per group
  int5_gemm(x (n, k), w int5 (m, k), out (n, m))          out = x @ w.T, w = codes * scale + bias per group of 32
  int6_gemm(x (n, k), w int6 (m, k), out (n, m))          out = x @ w.T, w = (codes - 32) * d * sub (GGUF Q6_K)

Ops of the families beyond Llama (generic versions below go through the host, so they work on every backend;
a backend implements them to keep the work on its device):
  add_bias(x (n, m), bias (m,), out (n, m))             out = x + bias
  head_rmsnorm(qkv (n, qkv_dim), q_weight (hd,), k_weight (hd,), eps, spec, out)   q and k heads RMS-normed, v copied
  gelu_mul(gate_up (n, 2f), out (n, f))                 out = gelu_tanh(gate_up[:, :f]) * gate_up[:, f:]
  scale(x, factor, out)                                 out = x * factor
  softcap(x, cap, out)                                  out = cap * tanh(x / cap)
  gate_up_gelu(x, w_gate_up, out)                       the GeGLU MLP's first half (composite)
  linear_post_norm_add_rmsnorm(x, w, post_weight, residual, weight, eps, out)   linear_add_rmsnorm with the
                                                       projection RMS-normed by post_weight before the add (composite)
Attention features (AttentionSpec.window, .softcap, .scale): an attention op declares the ones it implements in
its ``perfx_features`` attribute (OpTable.features); a model that needs one its backend lacks is refused at load.

Composite ops (generic versions below work on every backend; a backend may fuse them):
  linear, qkv_proj, gate_up_silu, logits,
  linear_add_rmsnorm(x, w, residual, weight, eps, out)  residual += x @ w.T (in place); out = rmsnorm(residual)
  attention_mixed(qkv (n+T, qkv_dim), cache, layer, slots (n,), positions (n,), slot, start, rope, spec, out)
                                                       rows 0..n-1 as attention_decode, rows n.. as attention_prefill
  argmax(logits (n, vocab), out (n,) int32)            out[i] = first index of the largest logit of row i
  sample(logits (n, vocab), rows (n, 6) host int32, out (n,) int32)   out[i] = sampling.engine_draw(logits[i], rows[i])
  write_columns(x (n, m), start, out (n, M))           out[:, start:start + m] = x, the rest of out untouched
                                                       (a matmul by row parts of different formats: row_parts.py)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

PRIMITIVE_OPS = (
    "embedding",
    "int4_gemv",
    "int4_gemm",
    "dense_gemm",
    "rmsnorm",
    "add_rmsnorm",
    "silu_mul",
    "attention_decode",
    "attention_prefill",
)
COMPOSITE_OPS = (
    "linear",
    "qkv_proj",
    "gate_up_silu",
    "logits",
    "linear_add_rmsnorm",
    "attention_mixed",
    "argmax",
    "sample",
    "write_columns",
)
FAMILY_OPS = (
    "add_bias",
    "head_rmsnorm",
    "gelu_mul",
    "scale",
    "softcap",
    "gate_up_gelu",
    "linear_post_norm_add_rmsnorm",
)
# weight format (Runtime.weight_formats) -> the ops a runtime taking it must have
FORMAT_OPS: dict[str, tuple[str, ...]] = {"int8": ("int8_gemm",), "int5": ("int5_gemm",), "int6": ("int6_gemm",)}
OP_NAMES = PRIMITIVE_OPS + COMPOSITE_OPS + FAMILY_OPS + tuple(op for ops in FORMAT_OPS.values() for op in ops)
ATTENTION_FEATURES = ("window", "softcap", "scale")

GENERIC_PRIORITY = -100  # generic composites lose to anything a backend or plugin registers


def weight_kind(w: Any) -> str:
    """'int4', 'int8', 'int5', 'int6' or 'dense': every prepared weight handle carries a ``kind`` attribute."""
    return w.kind


def generic_linear(rt, x, w, out) -> None:
    """out (n, m) = x (n, k) @ w.T, dispatched on the weight's format and on n."""
    kind = weight_kind(w)
    if kind == "int4":
        if out.shape[0] == 1:
            rt.ops.int4_gemv(x, w, out)
        else:
            rt.ops.int4_gemm(x, w, out)
    elif kind == "int8":
        rt.ops.int8_gemm(x, w, out)
    elif kind == "int5":
        rt.ops.int5_gemm(x, w, out)
    elif kind == "int6":
        rt.ops.int6_gemm(x, w, out)
    else:
        rt.ops.dense_gemm(x, w, out)


def generic_qkv_proj(rt, x, w_qkv, out) -> None:
    """out (n, qkv_dim) = x @ w_qkv.T, with q, k and v weights concatenated along the output rows."""
    rt.ops.linear(x, w_qkv, out)


def generic_gate_up_silu(rt, x, w_gate_up, out) -> None:
    """out (n, f) = silu(x @ w_gate.T) * (x @ w_up.T), with w_gate_up = [w_gate; w_up] of shape (2f, d)."""
    n, f = out.shape
    gate_up = rt.scratch("gate_up_silu", (n, 2 * f))
    rt.ops.linear(x, w_gate_up, gate_up)
    rt.ops.silu_mul(gate_up, out)


def generic_logits(rt, h, w_out, out) -> None:
    """out (n, vocab) = h (n, d) @ w_out.T, where h is already final-normed."""
    rt.ops.linear(h, w_out, out)


def generic_linear_add_rmsnorm(rt, x, w, residual, weight, eps, out) -> None:
    """residual (n, m) += x (n, k) @ w.T (in place); out (n, m) = rmsnorm(residual) * weight: a block's output
    projection, its residual connection and the next block's input norm (one launch on a GPU that fuses it)."""
    delta = rt.scratch("linear_add_rmsnorm", out.shape)
    rt.ops.linear(x, w, delta)
    rt.ops.add_rmsnorm(delta, residual, weight, eps, out)


# The keys a prompt chunk's index arrays are uploaded under: LlamaModel passes them as a recorded step's inputs,
# and a backend's attention_prefill uploads them (rt.upload_ints) under the same names.
PROMPT_KEYS = ("prompt_slots", "prompt_positions")


def prompt_indices(slot: int, start: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots and positions (int32) of a prompt chunk's t rows of ``slot`` from ``start`` (PROMPT_KEYS)."""
    return np.full(t, slot, np.int32), np.arange(start, start + t, dtype=np.int32)


def row_view(rt, x, first: int, count: int):
    """Rows first..first+count-1 of a (rows, width) tensor, as a view."""
    return rt.view(x, first * x.shape[1], (count, x.shape[1]))


def generic_attention_mixed(rt, qkv, cache, layer, slots, positions, slot, start, rope, spec, out) -> None:
    """A mixed step's attention: rows 0..n-1 of qkv are decode rows (attention_decode with slots, positions),
    rows n.. a prompt chunk of ``slot`` from ``start`` (attention_prefill); ``slot`` is none of ``slots``."""
    n, t = len(positions), qkv.shape[0] - len(positions)
    rt.ops.attention_decode(
        row_view(rt, qkv, 0, n), cache, layer, slots, positions, rope, spec, row_view(rt, out, 0, n)
    )
    rt.ops.attention_prefill(row_view(rt, qkv, n, t), cache, layer, slot, start, rope, spec, row_view(rt, out, n, t))


def generic_argmax(rt, logits, out) -> None:
    """out (n,) int32 = the first index of each row's largest logit, through the host (a device backend
    overrides this so only the ids cross; needs ``rt.write``)."""
    rt.write(out, np.argmax(rt.to_numpy(logits), axis=1).astype(np.int32))


def generic_sample(rt, logits, rows, out) -> None:
    """out (n,) int32 = one token per row drawn as sampling.engine_draw defines it (greedy rows: argmax), on the
    host (a device backend overrides this so the logits stay on the device; needs ``rt.write``)."""
    from .sampling import engine_draw

    host = rt.to_numpy(logits)
    rt.write(out, np.array([engine_draw(host[i], rows[i]) for i in range(host.shape[0])], dtype=np.int32))


def generic_write_columns(rt, x, start, out) -> None:
    """out[:, start:start + m] = x through the host (a device backend overrides this)."""
    host = rt.to_numpy(out)
    host[:, start : start + x.shape[1]] = rt.to_numpy(x)
    rt.write(out, host)


def _through_host(rt, out, fn, *arrays) -> None:
    """out = fn(*host copies of arrays), written back: the portable, slow way (a device round trip per call)."""
    rt.write(out, np.asarray(fn(*(rt.to_numpy(a) for a in arrays)), dtype=np.float32))


def generic_add_bias(rt, x, bias, out) -> None:
    _through_host(rt, out, lambda a, b: a + b, x, bias)


def generic_head_rmsnorm(rt, qkv, q_weight, k_weight, eps, spec, out) -> None:
    from .reference import head_rmsnorm

    _through_host(rt, out, lambda a, qw, kw: head_rmsnorm(a, qw, kw, eps, spec), qkv, q_weight, k_weight)


def generic_gelu_mul(rt, gate_up, out) -> None:
    from .reference import gelu_mul

    _through_host(rt, out, gelu_mul, gate_up)


def generic_scale(rt, x, factor, out) -> None:
    _through_host(rt, out, lambda a: a * np.float32(factor), x)


def generic_softcap(rt, x, cap, out) -> None:
    _through_host(rt, out, lambda a: np.float32(cap) * np.tanh(a / np.float32(cap)), x)


def generic_gate_up_gelu(rt, x, w_gate_up, out) -> None:
    """out (n, f) = gelu_tanh(x @ w_gate.T) * (x @ w_up.T), with w_gate_up = [w_gate; w_up] of shape (2f, d)."""
    n, f = out.shape
    gate_up = rt.scratch("gate_up_gelu", (n, 2 * f))
    rt.ops.linear(x, w_gate_up, gate_up)
    rt.ops.gelu_mul(gate_up, out)


def generic_linear_post_norm_add_rmsnorm(rt, x, w, post_weight, residual, weight, eps, out) -> None:
    """residual (n, m) += rmsnorm(x @ w.T) * post_weight; out = rmsnorm(residual) * weight: Gemma's block output,
    normed before it joins the residual stream, and the next norm."""
    delta = rt.scratch("linear_post_norm", out.shape)
    normed = rt.scratch("post_normed", out.shape)
    rt.ops.linear(x, w, delta)
    rt.ops.rmsnorm(delta, post_weight, eps, normed)
    rt.ops.add_rmsnorm(normed, residual, weight, eps, out)


GENERIC_OPS: dict[str, Callable[..., None]] = {
    "add_bias": generic_add_bias,
    "head_rmsnorm": generic_head_rmsnorm,
    "gelu_mul": generic_gelu_mul,
    "scale": generic_scale,
    "softcap": generic_softcap,
    "gate_up_gelu": generic_gate_up_gelu,
    "linear_post_norm_add_rmsnorm": generic_linear_post_norm_add_rmsnorm,
    "linear": generic_linear,
    "qkv_proj": generic_qkv_proj,
    "gate_up_silu": generic_gate_up_silu,
    "logits": generic_logits,
    "linear_add_rmsnorm": generic_linear_add_rmsnorm,
    "attention_mixed": generic_attention_mixed,
    "argmax": generic_argmax,
    "sample": generic_sample,
    "write_columns": generic_write_columns,
}


class OpProfile:
    """Wall time and call count per op name, for ops called by the model (nested calls not double counted).

    Timing synchronizes the runtime after each op, so asynchronous backends are measured honestly (and
    run somewhat slower while profiling).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            name: {"seconds": self.seconds[name], "calls": self.calls[name]}
            for name in sorted(self.seconds, key=self.seconds.get, reverse=True)  # type: ignore[arg-type]
        }


class OpTable:
    """A runtime's chosen implementation of every op, bound to the runtime: ``table.int4_gemm(x, w, out)``."""

    def __init__(self, runtime: Any, implementations: dict[str, tuple[Callable[..., None], str]]):
        self._runtime = runtime
        self.sources = {name: source for name, (_, source) in implementations.items()}
        self._functions = {name: fn for name, (fn, _) in implementations.items()}
        self.profile: OpProfile | None = None
        self._depth = 0
        self._bind()

    def _bind(self) -> None:
        for name, fn in self._functions.items():
            setattr(self, name, self._timed(name, fn) if self.profile else _bound(fn, self._runtime))

    def features(self, name: str) -> frozenset[str]:
        """The attention features (ATTENTION_FEATURES) the chosen implementation of op ``name`` declares."""
        return frozenset(getattr(self._functions[name], "perfx_features", ()))

    def start_profiling(self) -> OpProfile:
        self.profile = OpProfile()
        self._bind()
        return self.profile

    def stop_profiling(self) -> OpProfile | None:
        profile, self.profile = self.profile, None
        self._bind()
        return profile

    def _timed(self, name: str, fn: Callable[..., None]) -> Callable[..., None]:
        rt = self._runtime

        def call(*args: Any) -> None:
            if self._depth:
                fn(rt, *args)
                return
            self._depth += 1
            start = time.perf_counter()
            try:
                fn(rt, *args)
                rt.synchronize()
            finally:
                self._depth -= 1
            assert self.profile is not None
            self.profile.seconds[name] += time.perf_counter() - start
            self.profile.calls[name] += 1

        return call


def _bound(fn: Callable[..., None], rt: Any) -> Callable[..., None]:
    def call(*args: Any) -> None:
        fn(rt, *args)

    call.__name__ = getattr(fn, "__name__", "op")
    return call
