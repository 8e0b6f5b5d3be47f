"""The conformance kit: checks that every op a backend runs follows the contract in docs/ops.md.

``check_backend`` opens the backend through the registry, so what it tests is the implementation that
wins each op right now (a plugin's replacement included). Each case runs one op on random inputs and
compares the result with perfx_core.reference in float64 by NMSE. Every tensor the op is handed lives at
an offset inside a larger buffer whose guard regions hold a sentinel pattern, so a write outside ``out``
and a change to an input both show up, as does an ``out`` element that was never written.
"""

from __future__ import annotations

import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np

from . import reference
from .backend import AttentionSpec, KVCacheSpec, RopeTable
from .errors import InvalidArgumentError
from .ops import FORMAT_OPS, OP_NAMES
from .split_weights import pack_int5, pack_int6
from .synthetic import random_q4_k
from .weights import DenseWeight, Int4Weight, Int5Weight, Int6Weight, Int8Weight, Weight, concat_rows, quantize_rtn

MATMUL_LIMIT = 5e-4  # matmuls, int4 embedding, attention: float32 sums over many terms
NORM_LIMIT = 1e-6  # rmsnorm, add_rmsnorm, silu_mul: elementwise work with at most one reduction
EXACT_LIMIT = 1e-7  # copies and single additions: dense and int8 embedding, the new residual, KV cache entries
GUARD = 4096  # sentinel elements before and after every buffer handed to an op

# A quiet NaN with a payload, alternating with 1e30: neither is a value an op would compute by chance.
_SENTINEL = np.array([0x7FC0DEAD, 0x7149F2CA], dtype=np.uint32)
_LAYER = 1  # attention cases use the second of two layers, so a backend that ignores `layer` fails


@dataclass
class CaseResult:
    op: str
    case: str
    nmse: float | None  # of the op's main output; None when the op raised before it could be read
    limit: float
    passed: bool
    error: str | None  # why the case failed, when not only by NMSE (exception, sentinel, modified input)
    source: str  # the implementation that ran, as OpTable.sources names it


@dataclass
class ConformanceReport:
    backend: str
    device: str
    seed: int
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def format(self) -> str:
        """A table grouped by op (with the implementation that ran), failure reasons under their case."""
        lines = [f"conformance of backend {self.backend!r} on {self.device} (seed {self.seed})"]
        width = max((len(r.case) for r in self.results), default=0)
        for op in dict.fromkeys(r.op for r in self.results):
            cases = [r for r in self.results if r.op == op]
            lines.append(f"{op}  [{cases[0].source}]")
            for r in cases:
                verdict = "ok  " if r.passed else "FAIL"
                if r.nmse is None:
                    measured = f"nmse {'-':>9}    {r.limit:.0e}"
                else:
                    measured = f"nmse {r.nmse:9.2e} {'<=' if r.nmse <= r.limit else '> '} {r.limit:.0e}"
                lines.append(f"  {verdict}  {r.case:<{width}}  {measured}")
                if r.error:
                    lines.extend(f"        {line}" for line in r.error.splitlines())
        failed = self.failures
        if failed:
            ops = ", ".join(dict.fromkeys(r.op for r in failed))
            lines.append(f"FAILED: {len(failed)} of {len(self.results)} cases ({ops}) in {self.seconds:.1f} s")
        else:
            lines.append(f"PASSED: {len(self.results)} cases in {self.seconds:.1f} s")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON; a NaN or infinite NMSE becomes the string "nan" / "inf" (JSON has neither)."""
        results = [asdict(r) for r in self.results]
        for r in results:
            if r["nmse"] is not None and not np.isfinite(r["nmse"]):
                r["nmse"] = str(r["nmse"])
        return {
            "backend": self.backend,
            "device": self.device,
            "seed": self.seed,
            "passed": self.passed,
            "seconds": self.seconds,
            "results": results,
        }


# -- one case's buffers and checks ---------------------------------------------------------------------


def _sentinel_buffer(size: int) -> np.ndarray:
    return np.resize(_SENTINEL, size).view(np.float32)


class _Trial:
    """The tensors of one case, each placed at offset GUARD in a sentinel-filled buffer, and their checks."""

    def __init__(self, rt: Any):
        self.rt = rt
        self.problems: list[str] = []
        self.nmse: float | None = None
        self._buffers: dict[str, tuple[Any, np.ndarray, tuple[int, ...], bool]] = {}
        self._host: list[tuple[str, Any, list[bytes]]] = []

    def _place(self, name: str, array: np.ndarray, frozen: bool) -> Any:
        host = _sentinel_buffer(2 * GUARD + array.size)
        host[GUARD : GUARD + array.size] = array.ravel()
        buffer = self.rt.from_numpy(host)
        self._buffers[name] = (buffer, host, array.shape, frozen)
        return self.rt.view(buffer, GUARD, array.shape)

    def input(self, name: str, array: np.ndarray) -> Any:
        """A read-only input: after the op, its whole buffer must be bit-for-bit unchanged."""
        return self._place(name, np.ascontiguousarray(array, dtype=np.float32), frozen=True)

    def scratch_input(self, name: str, array: np.ndarray) -> Any:
        """An input the op may clobber (qkv of attention) or update (residual): only its guards are checked."""
        return self._place(name, np.ascontiguousarray(array, dtype=np.float32), frozen=False)

    def output(self, name: str, shape: tuple[int, ...]) -> Any:
        return self._place(name, _sentinel_buffer(int(np.prod(shape))).reshape(shape), frozen=False)

    def int_output(self, name: str, shape: tuple[int, ...]) -> Any:
        """An int32 output (argmax ids), sentinel-filled like the float ones."""
        host = _sentinel_buffer(2 * GUARD + int(np.prod(shape))).view(np.int32)
        buffer = self.rt.from_numpy(host)
        self._buffers[name] = (buffer, host, shape, False)
        return self.rt.view(buffer, GUARD, shape)

    def compare_exact(self, name: str, ref: np.ndarray) -> None:
        """Integer results must equal ``ref``; the case's score is the fraction that differ."""
        got = self.read(name)
        wrong = np.flatnonzero(got != ref)
        self.nmse = wrong.size / max(1, ref.size)
        if wrong.size:
            i = int(wrong[0])
            self.problems.append(f"{name}[{i}] is {int(got[i])}, expected {int(ref[i])} ({wrong.size} wrong)")

    def weight(self, weight: Weight) -> Any:
        if isinstance(weight, Int4Weight):
            arrays = [weight.packed, weight.scale, weight.bias, *(weight.k_scales.arrays if weight.k_scales else ())]
        elif isinstance(weight, Int5Weight | Int6Weight):
            arrays = list(weight.arrays)
        else:
            arrays = [weight.codes, weight.scale] if isinstance(weight, Int8Weight) else [weight.data]
        self._host.append(("weight", arrays, [a.tobytes() for a in arrays]))
        return self.rt.prepare_weight(weight)

    def ints(self, name: str, values: list[int]) -> np.ndarray:
        """A host int32 index array (ids, slots, positions), which the op must not modify either."""
        array = np.asarray(values, dtype=np.int32)
        self._host.append((name, [array], [array.tobytes()]))
        return array

    def kv_cache(self, spec: KVCacheSpec, k: np.ndarray, v: np.ndarray) -> Any:
        cache = self.rt.new_kv_cache(spec)
        self.rt.kv_cache_from_numpy(cache, k, v)
        return cache

    def read(self, name: str) -> np.ndarray:
        buffer, _, shape, _ = self._buffers[name]
        size = int(np.prod(shape))
        return self.rt.to_numpy(buffer).reshape(-1)[GUARD : GUARD + size].reshape(shape)

    def compare(self, name: str, ref: np.ndarray, limit: float, main: bool = True) -> None:
        """NMSE of buffer ``name`` against ``ref``; the main output's NMSE is the case's, others must pass."""
        got = self.read(name)
        unwritten = int(np.isin(got.view(np.uint32), _SENTINEL).sum())
        if unwritten:
            self.problems.append(
                f"{unwritten} of {got.size} elements of {name} were never written "
                "(they still hold the sentinel, or were computed from unwritten data)"
            )
        error = reference.nmse(got, ref)
        if main:
            self.nmse = error
        elif not error <= limit:
            self.problems.append(f"{name}: nmse {error:.2e} above its limit {limit:.0e}")

    def compare_cache(self, cache: Any, k_ref: np.ndarray, v_ref: np.ndarray, before: tuple, written: np.ndarray):
        """The written (layer, slot, kv_head, position) entries match the reference; all others are untouched."""
        k_now, v_now = self.rt.kv_cache_to_numpy(cache)
        for label, now, ref, old in (("k", k_now, k_ref, before[0]), ("v", v_now, v_ref, before[1])):
            error = reference.nmse(now[written], ref[written])
            if not error <= EXACT_LIMIT:
                self.problems.append(f"KV cache {label} at the new positions: nmse {error:.2e} above {EXACT_LIMIT:.0e}")
            bits = np.uint16 if now.dtype == np.float16 else np.uint32
            changed = now[~written].view(bits) != old[~written].view(bits)
            if changed.any():
                where = np.argwhere((now.view(bits) != old.view(bits)).any(axis=-1) & ~written)[0].tolist()
                self.problems.append(
                    f"KV cache {label} changed outside the new positions: {int(changed.sum())} values, "
                    f"first at (layer, slot, kv_head, position) = {tuple(where)}"
                )

    def verify_untouched(self) -> None:
        """Guards of every buffer, whole read-only inputs and host arrays must be as they were."""
        for name, (buffer, host, shape, frozen) in self._buffers.items():
            now = self.rt.to_numpy(buffer).reshape(-1).view(np.uint32)
            was = host.view(np.uint32)
            size = int(np.prod(shape))
            for region, lo, hi in (("before", 0, GUARD), ("after", GUARD + size, 2 * GUARD + size)):
                hit = np.flatnonzero(now[lo:hi] != was[lo:hi])
                if hit.size:
                    offset = (hit[-1] - GUARD) if region == "before" else hit[0]
                    self.problems.append(
                        f"out-of-bounds write: {hit.size} guard element(s) {region} {name} overwritten "
                        f"(nearest at {offset:+d} elements from its {'start' if region == 'before' else 'end'})"
                    )
            if frozen and (now[GUARD : GUARD + size] != was[GUARD : GUARD + size]).any():
                self.problems.append(f"input {name} was modified; the contract says the op only reads it")
        for name, arrays, saved in self._host:
            if [a.tobytes() for a in arrays] != saved:
                self.problems.append(f"host {name} arrays were modified; the contract says the op only reads them")


# -- inputs ---------------------------------------------------------------------------------------------


def _activations(rng: np.random.Generator, shape: tuple[int, ...], decades: float = 2.0) -> np.ndarray:
    """Float32 values spread over many orders of magnitude, between rows and within each row."""
    rows = 10.0 ** rng.uniform(-decades, decades, (shape[0], 1))
    within = 10.0 ** rng.uniform(-1.5, 1.5, shape)
    return (rng.standard_normal(shape) * rows * within).astype(np.float32)


def _int4(rng: np.random.Generator, m: int, k: int, group: int, how: str) -> Int4Weight:
    """An int4 weight from quantize_rtn of random data ("rtn"), with random codes, scales and biases ("random"), or
    as GGUF Q4_K makes one ("q4_k": random 6-bit sc and m per 32 columns, float16 d and dmin per 256), or as Q4_0
    does ("q4_0": each bias -8 times its scale, which a backend may compute instead of storing)."""
    if how == "rtn":
        return quantize_rtn(rng.standard_normal((m, k)).astype(np.float32) * 0.05, group)
    if how == "q4_k":
        return random_q4_k(m, k, rng)
    packed = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    scale = rng.uniform(-0.05, 0.05, (m, k // group)).astype(np.float16)
    bias = (
        -8.0 * scale.astype(np.float32) if how == "q4_0" else rng.normal(0.0, 0.1, (m, k // group)).astype(np.float32)
    )
    return Int4Weight(packed, scale, bias, group)


def _int8(rng: np.random.Generator, m: int, k: int, group: int, how: str) -> Int8Weight:
    """An int8 weight the way GGUF Q8_0 makes one ("q8_0": scale = max |w| / 127 per group, in float16), with
    Q5_0's codes -16..15 ("q5_0"), as Q6_K's ("q6_k": codes -32..31, float32 scales that are a float16 times an
    int8), or with random codes and scales of either sign ("random")."""
    if how == "q6_k":
        codes = rng.integers(-32, 32, (m, k), dtype=np.int8)
        d = rng.uniform(1e-4, 2e-3, (m, 1)).astype(np.float16).astype(np.float32)
        return Int8Weight(codes, d * rng.integers(-128, 128, (m, k // group)).astype(np.float32), group)
    if how == "random":
        codes = rng.integers(-128, 128, (m, k), dtype=np.int8)
        return Int8Weight(codes, rng.uniform(-0.05, 0.05, (m, k // group)).astype(np.float16), group)
    top = 127 if how == "q8_0" else 16
    groups = (rng.standard_normal((m, k)) * 0.05).reshape(m, k // group, group)
    scale = (np.abs(groups).max(axis=2) / top).astype(np.float16)
    safe = np.where(scale > 0, scale.astype(np.float64), 1.0)[:, :, None]
    codes = np.clip(np.round(groups / safe), -top, top - (how == "q5_0")).astype(np.int8)
    return Int8Weight(codes.reshape(m, k), scale, group)


def _int5(rng: np.random.Generator, m: int, k: int, group: int, how: str) -> Int5Weight:
    """An int5 weight the way GGUF makes one: Q5_0 ("q5_0": scale max |w| / 16, bias -16 scale) or Q5_1 ("q5_1":
    (max - min) / 31 and the minimum), or random codes, scales of either sign and biases ("random")."""
    if how == "random":
        codes = rng.integers(0, 32, (m, k), dtype=np.uint8)
        scale = rng.uniform(-0.05, 0.05, (m, k // group)).astype(np.float16)
        return Int5Weight(*pack_int5(codes), scale, rng.normal(0.0, 0.1, (m, k // group)).astype(np.float16))
    groups = (rng.standard_normal((m, k)) * 0.05).reshape(m, k // group, group)
    if how == "q5_0":
        scale = (np.abs(groups).max(axis=2) / 16).astype(np.float16)
        bias = (scale.astype(np.float32) * -16).astype(np.float16)
    else:
        scale = ((groups.max(axis=2) - groups.min(axis=2)) / 31).astype(np.float16)
        bias = groups.min(axis=2).astype(np.float16)
    safe = np.where(scale > 0, scale.astype(np.float64), 1.0)[:, :, None]
    codes = np.clip(np.round((groups - bias.astype(np.float64)[:, :, None]) / safe), 0, 31).astype(np.uint8)
    return Int5Weight(*pack_int5(codes.reshape(m, k)), scale, bias)


def _int6(rng: np.random.Generator, m: int, k: int, group: int, how: str) -> Int6Weight:
    """An int6 weight as GGUF Q6_K stores one: random codes 0..63 and int8 sub-scales per 16 columns, and a float16
    d per 256 of either sign ("random") or positive ("q6_k")."""
    codes = rng.integers(0, 64, (m, k), dtype=np.uint8)
    sub = rng.integers(-128, 128, (m, k // 16), dtype=np.int8)
    d = rng.uniform(1e-5 if how == "q6_k" else -1e-3, 1e-3, (m, k // 256)).astype(np.float16)
    return Int6Weight(*pack_int6(codes), sub, d)


def _dense(rng: np.random.Generator, m: int, k: int, dtype: str) -> DenseWeight:
    return DenseWeight((rng.standard_normal((m, k)) * 0.05).astype(dtype))


def _make_weight(rng: np.random.Generator, desc: tuple) -> Weight:
    """("int4" | "int8" | "int5", m, k, group, how) or ("dense", m, k, "float32"|"float16")."""
    makers = {"int4": _int4, "int8": _int8, "int5": _int5, "int6": _int6}
    return makers.get(desc[0], _dense)(rng, *desc[1:])


def _describe(desc: tuple) -> str:
    if desc[0] in ("int4", "int8", "int5", "int6"):
        kind, m, k, group, how = desc
        return f"{kind} g{group} {how} ({m}x{k})"
    _, m, k, dtype = desc
    return f"{dtype} ({m}x{k})"


def _rope_table(max_seq_len: int, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(max_seq_len)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# -- cases: (case name, limit, body(trial, rng)) per op --------------------------------------------------

Body = Callable[[_Trial, np.random.Generator], None]


def _matmul_case(op: str, n: int, desc: tuple) -> tuple[str, float, Body]:
    """A matmul-like op on an (m, k) weight; for gate_up_silu the weight is [w_gate; w_up] and out is (n, m/2)."""

    def body(t: _Trial, rng: np.random.Generator) -> None:
        weight = _make_weight(rng, desc)
        m, k = weight.shape
        x = _activations(rng, (n, k))
        shape = (n, m // 2 if op == "gate_up_silu" else m)
        handle, x_in, out = t.weight(weight), t.input("x", x), t.output("out", shape)
        getattr(t.rt.ops, op)(x_in, handle, out)
        # A second call on the same handle catches a weight altered in device memory (which the host
        # copies cannot show) and state kept wrongly between calls (caches, scratch buffers).
        getattr(t.rt.ops, op)(x_in, handle, t.output("out of a second call", shape))
        ref = reference.gate_up_silu(x, weight) if op == "gate_up_silu" else reference.matmul(x, weight)
        t.compare("out", ref, MATMUL_LIMIT)
        t.compare("out of a second call", ref, MATMUL_LIMIT, main=False)

    return f"n={n} {_describe(desc)}", MATMUL_LIMIT, body


def _qkv_case(n: int, kind: str) -> tuple[str, float, Body]:
    """qkv_proj on a weight made the way the model makes it: concat_rows of separate q, k, v weights."""
    make = {
        "int4": lambda rng, rows, part: _int4(rng, rows, 128, 64, "rtn"),
        # q Q5_0, k Q8_0, v Q6_K (group 16, float32 scales): concat_rows joins them at group 16
        "int8": lambda rng, rows, part: _int8(rng, rows, 128, *((32, "q5_0"), (32, "q8_0"), (16, "q6_k"))[part]),
        # q|k Q5_0, v Q5_1: one int5 matrix
        "int5": lambda rng, rows, part: _int5(rng, rows, 128, 32, "q5_1" if part == 2 else "q5_0"),
        "int6": lambda rng, rows, part: _int6(rng, rows, 256, 16, "q6_k"),  # whole Q6_K blocks: 256 columns
        "dense": lambda rng, rows, part: _dense(rng, rows, 128, "float32"),
    }[kind]

    def body(t: _Trial, rng: np.random.Generator) -> None:
        parts = [make(rng, rows, part) for part, rows in enumerate((192, 64, 64))]
        weight = concat_rows(parts)
        x = _activations(rng, (n, weight.shape[1]))
        handle, out = t.weight(weight), t.output("out", (n, 320))
        t.rt.ops.qkv_proj(t.input("x", x), handle, out)
        t.compare("out", reference.matmul(x, weight), MATMUL_LIMIT)

    return f"n={n} {kind} q|k|v 192+64+64 x {256 if kind == 'int6' else 128}", MATMUL_LIMIT, body


def _linear_norm_case(n: int, desc: tuple, eps: float, post: bool = False) -> tuple[str, float, Body]:
    """linear_add_rmsnorm (``post``: linear_post_norm_add_rmsnorm): the projection's output (normed first with
    ``post``) joins ``residual`` (updated in place) and is normed."""

    def body(t: _Trial, rng: np.random.Generator) -> None:
        weight = _make_weight(rng, desc)
        m, k = weight.shape
        x, residual = _activations(rng, (n, k)), _activations(rng, (n, m), decades=2.0)
        norm_weight = (1.0 + 0.3 * rng.standard_normal(m)).astype(np.float32)
        out = t.output("out", (n, m))
        args = (t.scratch_input("residual", residual), t.input("weight", norm_weight), eps, out)
        if post:
            post_weight = (1.0 + 0.3 * rng.standard_normal(m)).astype(np.float32)
            t.rt.ops.linear_post_norm_add_rmsnorm(
                t.input("x", x), t.weight(weight), t.input("post", post_weight), *args
            )
            expected = reference.linear_post_norm_add_rmsnorm(x, weight, post_weight, residual, norm_weight, eps)
        else:
            t.rt.ops.linear_add_rmsnorm(t.input("x", x), t.weight(weight), *args)
            expected = reference.linear_add_rmsnorm(x, weight, residual, norm_weight, eps)
        t.compare("out", expected[1], MATMUL_LIMIT)
        t.compare("residual", expected[0], MATMUL_LIMIT, main=False)

    return f"n={n} {_describe(desc)} eps={eps:g}", MATMUL_LIMIT, body


def _argmax_case(n: int, vocab: int, special: str) -> tuple[str, float, Body]:
    """argmax of logits rows, including ties (the first index wins), -inf rows and NaN (wins, as in NumPy)."""

    def body(t: _Trial, rng: np.random.Generator) -> None:
        logits = _activations(rng, (n, vocab), decades=2.0)
        if special == "ties" and vocab > 2:
            top = float(np.abs(logits).max()) + 1.0
            logits[:, vocab // 3] = logits[:, vocab - 1] = top  # two equal maxima: the first must win
        elif special == "negative":
            logits = -np.abs(logits) - 1.0
            if n > 1:
                logits[0] = -np.inf  # a row with nothing larger than -inf: index 0
        elif special == "nan" and vocab > 2:
            logits[-1, vocab // 2] = logits[-1, vocab - 2] = np.nan  # NaN beats everything: the first one
        out = t.int_output("out", (n,))
        t.rt.ops.argmax(t.input("logits", logits), out)
        t.compare_exact("out", np.argmax(logits, axis=1).astype(np.int32))

    return f"n={n} vocab={vocab} {special}", 0.0, body


def _sample_case(
    n: int, vocab: int, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0, ties: bool = False
) -> tuple[str, float, Body]:
    """sample: every row the same logits (with ``ties``, whole numbers: many equal values at every threshold),
    each its own seed and step. The draws must be the reference's
    (sampling.engine_draw; at most 1% may differ, from float rounding near ties and filter thresholds), follow
    the tempered softmax over what the filters keep, and never pick a token they remove."""
    limit = 0.01

    def body(t: _Trial, rng: np.random.Generator) -> None:
        from .sampling import ENGINE_ROW, engine_draw, engine_keep, engine_params

        base = (rng.standard_normal(vocab) * 2).astype(np.float32)
        if ties:
            base = np.round(base * 2)
        logits = np.tile(base, (n, 1))
        rows = np.stack([engine_params(temperature, min_p, 1000 + i, 3 * i, top_k, top_p) for i in range(n)])
        out = t.int_output("out", (n,))
        rows_in = t.ints("rows", rows.ravel().tolist()).reshape(n, ENGINE_ROW)
        t.rt.ops.sample(t.input("logits", logits), rows_in, out)
        got = t.read("out")
        want = np.array([engine_draw(logits[i], rows[i]) for i in range(n)])
        t.nmse = float(np.mean(got != want))
        if not (0 <= got.min() and got.max() < vocab):
            t.problems.append(f"ids outside 0..{vocab - 1}")
            return
        if temperature == 0:
            return
        scaled = (base - base.max()) / np.float32(temperature)
        kept = engine_keep(scaled, min_p, top_k, top_p)
        if (~kept[got]).any():
            t.problems.append(f"drew a token the filters remove ({int(got[~kept[got]][0])})")
        probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
        probs /= probs.sum()
        freq = np.bincount(got, minlength=vocab) / n
        if np.abs(freq - probs).max() > 4 / np.sqrt(n):  # ~4 standard deviations of a frequency
            t.problems.append(f"draw frequencies {np.round(freq, 3)} do not follow the softmax {np.round(probs, 3)}")

    name = f"n={n} vocab={vocab} T={temperature:g} min_p={min_p:g} top_k={top_k} top_p={top_p:g}"
    return name + (" tied values" if ties else ""), limit, body


def _sample_edge_case() -> tuple[str, float, Body]:
    """sample on awkward rows, which must match the reference exactly: one token far ahead (no noise may
    overturn it: a uniform that rounds to 1 would), a NaN logit (never drawn), an infinite one, a temperature
    of 1e-30 (the draw of a near-greedy softmax), all -inf, and top-k 1 / top-p 1e-6 (only the best token)."""

    def body(t: _Trial, rng: np.random.Generator) -> None:
        from .sampling import ENGINE_ROW, engine_draw, engine_params

        vocab = 32000
        peaked = np.full(vocab, -30.0, np.float32)
        peaked[0] = 30.0
        rows_logits, rows = [], []
        for step in range(390, 402):  # (seed 7, step 395) had a uniform of exactly 1 in a 24-bit mapping
            rows_logits.append(peaked)
            rows.append((1.0, 0.0, 7, step))
        special = _activations(rng, (4, vocab), decades=1.0)
        special[0, 17] = np.nan
        special[1, 5] = np.inf
        special[3] = -np.inf
        rows_logits.extend(special)
        rows.extend([(0.9, 0.05, 11, 0), (0.9, 0.0, 12, 1), (1e-30, 0.0, 13, 2), (1.0, 0.0, 14, 3)])
        rows_logits.extend([special[0], special[0], special[3]])  # top-k 1 and a tiny top-p: the best (not NaN)
        rows.extend([(0.9, 0.0, 15, 4, 1, 1.0), (0.9, 0.0, 16, 5, 0, 1e-6), (1.0, 0.0, 17, 6, 3, 0.5)])
        logits = np.stack(rows_logits)
        params = np.stack([engine_params(*r) for r in rows])
        out = t.int_output("out", (len(rows),))
        rows_in = t.ints("rows", params.ravel().tolist()).reshape(-1, ENGINE_ROW)
        t.rt.ops.sample(t.input("logits", logits), rows_in, out)
        want = np.array([engine_draw(logits[i], params[i]) for i in range(len(rows))])
        want[:12] = 0  # stated, not computed: the reference itself could be wrong in the same way
        t.compare_exact("out", want)

    return "edge rows (peaked, NaN, inf, T=1e-30, all -inf)", 0.0, body


def _embedding_case(n: int, desc: tuple) -> tuple[str, float, Body]:
    limit = EXACT_LIMIT if desc[0] in ("int8", "dense") else MATMUL_LIMIT  # an int8 row is exact in float32

    def body(t: _Trial, rng: np.random.Generator) -> None:
        table = _make_weight(rng, desc)
        vocab, d = table.shape
        ids = rng.integers(0, vocab, n)
        ids[-1] = vocab - 1  # the last row, where an off-by-one in the row stride shows
        if n > 2:
            ids[1] = ids[0]  # a repeated id
        handle, out = t.weight(table), t.output("out", (n, d))
        t.rt.ops.embedding(handle, t.ints("ids", ids.tolist()), out)
        t.compare("out", reference.embedding(table, ids), limit)

    return f"n={n} {_describe(desc)}", limit, body


def _norm_case(op: str, n: int, d: int, eps: float) -> tuple[str, float, Body]:
    def body(t: _Trial, rng: np.random.Generator) -> None:
        x = _activations(rng, (n, d), decades=3.0)
        if n > 1:  # a row so small that eps dominates its mean square: catches eps outside the square root
            x[0] = rng.standard_normal(d) * 1e-4
        weight = (1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32)
        out = t.output("out", (n, d))
        if op == "rmsnorm":
            t.rt.ops.rmsnorm(t.input("x", x), t.input("weight", weight), eps, out)
            t.compare("out", reference.rmsnorm(x, weight, eps), NORM_LIMIT)
            return
        residual = _activations(rng, (n, d), decades=3.0)
        t.rt.ops.add_rmsnorm(
            t.input("x", x), t.scratch_input("residual", residual), t.input("weight", weight), eps, out
        )
        new_residual, normed = reference.add_rmsnorm(x, residual, weight, eps)
        t.compare("out", normed, NORM_LIMIT)
        t.compare("residual", new_residual, EXACT_LIMIT, main=False)

    return f"n={n} d={d} eps={eps:g}", NORM_LIMIT, body


def _silu_case(n: int, f: int) -> tuple[str, float, Body]:
    def body(t: _Trial, rng: np.random.Generator) -> None:
        gate_up = _activations(rng, (n, 2 * f), decades=1.5)  # gates reach +-1e3: exp(-gate) must not overflow
        out = t.output("out", (n, f))
        t.rt.ops.silu_mul(t.input("gate_up", gate_up), out)
        t.compare("out", reference.silu_mul(gate_up), NORM_LIMIT)

    return f"n={n} f={f}", NORM_LIMIT, body


def _attention_case(
    op: str,
    heads: tuple[int, int, int],
    cache_dtype: str,
    slots: list[int],
    positions: list[int],
    t_len: int = 1,
    max_seq: int = 128,
    prompt: tuple[int, int] | None = None,
    **features: Any,
) -> tuple[str, float, Body]:
    """Decode of len(slots) sequences at ``positions``, or a prefill of t_len tokens at positions[0].. of slots[0];
    attention_mixed: the decode rows, then a chunk of t_len tokens of ``prompt`` = (slot, start). ``features``:
    AttentionSpec's optional ones (window, softcap, scale)."""
    spec = AttentionSpec(*heads, **features)
    kv = KVCacheSpec(
        n_layers=2,
        n_slots=4,
        max_seq_len=max_seq,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        dtype=cache_dtype,
    )

    def body(t: _Trial, rng: np.random.Generator) -> None:
        # Garbage everywhere (large, so reading a wrong slot, layer or future position changes the result),
        # then ordinary random history before each sequence's first new position.
        k0 = (rng.choice([-1.0, 1.0], kv.shape) * rng.uniform(1e3, 3e4, kv.shape)).astype(cache_dtype)
        v0 = (rng.choice([-1.0, 1.0], kv.shape) * rng.uniform(1e3, 3e4, kv.shape)).astype(cache_dtype)
        written = np.zeros(kv.shape[:4], dtype=bool)
        new_rows = [
            (slot, pos, t_len if op == "attention_prefill" else 1) for slot, pos in zip(slots, positions, strict=True)
        ]
        if prompt is not None:
            new_rows.append((*prompt, t_len))
        for slot, pos, count in new_rows:
            k0[_LAYER, slot, :, :pos] = rng.standard_normal((spec.n_kv_heads, pos, spec.head_dim))
            v0[_LAYER, slot, :, :pos] = rng.standard_normal((spec.n_kv_heads, pos, spec.head_dim))
            written[_LAYER, slot, :, pos : pos + count] = True
        cos, sin = _rope_table(kv.max_seq_len, spec.head_dim)
        rows = {"attention_decode": len(slots), "attention_prefill": t_len}.get(op, len(slots) + t_len)
        qkv = (rng.standard_normal((rows, spec.qkv_dim)) * 1.5).astype(np.float32)
        cache = t.kv_cache(kv, k0, v0)
        rope = RopeTable(t.input("rope.cos", cos), t.input("rope.sin", sin))
        out = t.output("out", (rows, spec.q_dim))
        if op == "attention_decode":
            slots_arg, positions_arg = t.ints("slots", slots), t.ints("positions", positions)
            t.rt.ops.attention_decode(
                t.scratch_input("qkv", qkv), cache, _LAYER, slots_arg, positions_arg, rope, spec, out
            )
            ref, k_ref, v_ref = reference.attention_decode(qkv, k0, v0, _LAYER, slots, positions, cos, sin, spec)
        elif op == "attention_prefill":
            t.rt.ops.attention_prefill(
                t.scratch_input("qkv", qkv), cache, _LAYER, slots[0], positions[0], rope, spec, out
            )
            ref, k_ref, v_ref = reference.attention_prefill(qkv, k0, v0, _LAYER, slots[0], positions[0], cos, sin, spec)
        else:
            assert prompt is not None
            slots_arg, positions_arg = t.ints("slots", slots), t.ints("positions", positions)
            t.rt.ops.attention_mixed(
                t.scratch_input("qkv", qkv), cache, _LAYER, slots_arg, positions_arg, *prompt, rope, spec, out
            )
            n = len(slots)
            decoded, k1, v1 = reference.attention_decode(qkv[:n], k0, v0, _LAYER, slots, positions, cos, sin, spec)
            prefilled, k_ref, v_ref = reference.attention_prefill(qkv[n:], k1, v1, _LAYER, *prompt, cos, sin, spec)
            ref = np.concatenate([decoded, prefilled])
        t.compare("out", ref, MATMUL_LIMIT)
        t.compare_cache(cache, k_ref, v_ref, (k0, v0), written)

    where = (
        f"slot={slots[0]} start={positions[0]} T={t_len}"
        if op == "attention_prefill"
        else f"slots={slots} positions={positions}"
    )
    if prompt is not None:
        where += f" + prompt slot={prompt[0]} start={prompt[1]} T={t_len}"
    if features:
        where += " " + " ".join(f"{k}={v:g}" for k, v in features.items())
    return f"heads {spec.n_heads}/{spec.n_kv_heads}x{spec.head_dim} {cache_dtype} cache {where}", MATMUL_LIMIT, body


def _cases(op: str) -> list[tuple[str, float, Body]]:
    """The cases of one op: odd sizes, every batch size and group size, both weight makings, GQA ratios 1/3/4."""
    if any(op in ops for ops in FORMAT_OPS.values()):
        return []  # all of them in _format_cases
    if op == "embedding":
        return [
            _embedding_case(1, ("int4", 1001, 96, 32, "rtn")),
            _embedding_case(5, ("int4", 4097, 128, 128, "random")),
            _embedding_case(17, ("int4", 300, 192, 64, "rtn")),
            _embedding_case(64, ("dense", 513, 129, "float32")),
            _embedding_case(2, ("dense", 513, 77, "float16")),
            _embedding_case(64, ("int4", 2000, 96, 32, "random")),
            _embedding_case(9, ("int4", 300, 512, 32, "q4_k")),
            _embedding_case(3, ("int4", 300, 256, 32, "q4_0")),
        ]
    if op == "int4_gemv":
        return [
            _matmul_case(op, 1, ("int4", 1, 96, 32, "rtn")),
            _matmul_case(op, 1, ("int4", 3, 128, 32, "random")),
            _matmul_case(op, 1, ("int4", 129, 128, 64, "rtn")),
            _matmul_case(op, 1, ("int4", 4097, 128, 128, "random")),
            _matmul_case(op, 1, ("int4", 1536, 576, 64, "rtn")),
            _matmul_case(op, 1, ("int4", 129, 384, 128, "rtn")),
            _matmul_case(op, 1, ("int4", 257, 512, 32, "q4_k")),
            _matmul_case(op, 1, ("int4", 130, 256, 32, "q4_0")),
        ]
    if op == "int4_gemm":
        return [
            _matmul_case(op, 1, ("int4", 129, 128, 32, "random")),  # n=1 is legal for gemm too
            _matmul_case(op, 2, ("int4", 3, 96, 32, "rtn")),
            _matmul_case(op, 5, ("int4", 129, 128, 64, "random")),
            _matmul_case(op, 17, ("int4", 1, 192, 64, "rtn")),
            _matmul_case(op, 64, ("int4", 4097, 128, 128, "rtn")),
            _matmul_case(op, 17, ("int4", 129, 384, 32, "random")),
            _matmul_case(op, 64, ("int4", 1536, 576, 64, "random")),
            _matmul_case(op, 200, ("int4", 300, 256, 32, "random")),  # past 64 tokens: tiled GEMMs
            _matmul_case(op, 6, ("int4", 129, 256, 32, "q4_k")),
            _matmul_case(op, 80, ("int4", 200, 512, 32, "q4_k")),
            _matmul_case(op, 5, ("int4", 129, 256, 32, "q4_0")),
            _matmul_case(op, 70, ("int4", 96, 256, 32, "q4_0")),
        ]
    if op == "dense_gemm":
        return [
            _matmul_case(op, 1, ("dense", 129, 77, "float32")),
            _matmul_case(op, 2, ("dense", 3, 128, "float16")),
            _matmul_case(op, 5, ("dense", 1, 129, "float32")),
            _matmul_case(op, 17, ("dense", 4097, 96, "float16")),
            _matmul_case(op, 64, ("dense", 129, 200, "float32")),
        ]
    if op in ("linear", "logits"):
        m = 4097 if op == "logits" else 129
        return [
            _matmul_case(op, 1, ("int4", m, 128, 32, "rtn")),
            _matmul_case(op, 5, ("int4", m, 128, 128, "random")),
            _matmul_case(op, 3, ("dense", m, 96, "float16")),
            _matmul_case(op, 2, ("dense", m, 96, "float32")),
        ]
    if op == "qkv_proj":
        return [_qkv_case(1, "int4"), _qkv_case(7, "int4"), _qkv_case(2, "dense")]
    if op == "gate_up_silu":
        return [
            _matmul_case(op, 1, ("int4", 258, 128, 64, "rtn")),
            _matmul_case(op, 5, ("int4", 128, 192, 32, "random")),
            _matmul_case(op, 17, ("dense", 128, 96, "float16")),
            _matmul_case(op, 40, ("int4", 130, 128, 32, "rtn")),
            _matmul_case(op, 3, ("int4", 258, 256, 32, "q4_k")),
        ]
    if op == "argmax":
        return [
            _argmax_case(1, 1, "plain"),
            _argmax_case(3, 4097, "ties"),
            _argmax_case(2, 300, "negative"),
            _argmax_case(17, 32000, "nan"),
            _argmax_case(5, 49152, "ties"),
        ]
    if op == "sample":
        return [
            _sample_case(3, 4097, 0.0, 0.0),
            _sample_case(2048, 6, 1.0, 0.0),
            _sample_case(2048, 6, 0.5, 0.1),
            _sample_case(17, 32000, 0.8, 0.05),
            _sample_case(2048, 6, 1.0, 0.0, top_k=2),  # frequencies over the two best only
            _sample_case(2048, 6, 1.0, 0.0, top_p=0.7),
            _sample_case(512, 1000, 0.7, 0.02, top_k=40, top_p=0.95),  # the default sampling parameters
            _sample_case(9, 49152, 1.3, 0.0, top_k=0, top_p=0.9),
            _sample_case(512, 1000, 0.8, 0.0, top_k=40, top_p=0.9, ties=True),
            _sample_case(256, 4096, 1.0, 0.0, top_k=1500, top_p=0.9),  # more kept than a device may gather
            _sample_edge_case(),
        ]
    if op == "linear_add_rmsnorm":
        return [
            _linear_norm_case(1, ("int4", 129, 128, 32, "rtn"), 1e-5),
            _linear_norm_case(5, ("int4", 576, 256, 128, "random"), 1e-6),
            _linear_norm_case(3, ("int4", 4097, 64, 64, "random"), 1e-5),
            _linear_norm_case(17, ("int4", 96, 128, 32, "rtn"), 1e-5),
            _linear_norm_case(32, ("int4", 200, 256, 128, "random"), 1e-5),  # two 16-token groups on matrix units
            _linear_norm_case(20, ("int4", 129, 256, 32, "q4_k"), 1e-5),
            _linear_norm_case(1, ("int4", 129, 256, 32, "q4_0"), 1e-5),
            _linear_norm_case(2, ("dense", 129, 96, "float16"), 1e-5),
        ]
    if op == "linear_post_norm_add_rmsnorm":
        return [
            _linear_norm_case(n, desc, eps, post=True)
            for n, desc, eps in (
                (1, ("int4", 640, 128, 32, "rtn"), 1e-6),
                (5, ("int4", 129, 256, 128, "random"), 1e-6),
                (2, ("int4", 5000, 64, 64, "random"), 1e-6),  # more than one block of the tail per work-item
                (20, ("int4", 200, 256, 128, "random"), 1e-6),  # past the GEMV's tokens
                (33, ("int4", 96, 128, 32, "rtn"), 1e-6),  # past the matrix units' tail
                (3, ("dense", 129, 96, "float16"), 1e-6),
            )
        ]
    if op in ("rmsnorm", "add_rmsnorm"):
        return [
            _norm_case(op, 1, 96, 1e-5),
            _norm_case(op, 5, 129, 1e-6),
            _norm_case(op, 17, 4097, 1e-5),
            _norm_case(op, 64, 576, 1e-6),
        ]
    if op == "silu_mul":
        return [_silu_case(1, 1), _silu_case(5, 129), _silu_case(17, 4097), _silu_case(64, 96)]
    if op == "attention_decode":
        return [
            _attention_case(op, (4, 4, 32), "float32", [2], [0]),
            _attention_case(op, (6, 2, 64), "float32", [3, 0, 1], [5, 37, 127]),
            _attention_case(op, (8, 2, 64), "float16", [1, 2, 0], [64, 1, 99]),
            _attention_case(op, (4, 1, 128), "float16", [0], [50]),
            _attention_case(op, (4, 4, 32), "float16", [0, 3, 2], [127, 0, 64]),
            # long and short rows together: kernels that split the positions into partitions
            _attention_case(op, (8, 2, 64), "float32", [1, 3, 0], [700, 3, 333], max_seq=720),
        ]
    if op == "attention_prefill":
        return [
            _attention_case(op, (4, 4, 32), "float32", [0], [0], t_len=1),
            _attention_case(op, (6, 2, 64), "float32", [2], [0], t_len=7),
            _attention_case(op, (8, 2, 64), "float16", [1], [40], t_len=7),
            _attention_case(op, (6, 2, 64), "float32", [3], [33], t_len=64),
            _attention_case(op, (4, 1, 128), "float16", [0], [0], t_len=64),
            _attention_case(op, (8, 2, 64), "float32", [2], [90], t_len=1),
            # tiled kernels: several row blocks and key tiles, a partial last block, odd and wide heads
            _attention_case(op, (4, 2, 96), "float16", [1], [20], t_len=37),
            _attention_case(op, (2, 1, 256), "float32", [0], [5], t_len=19),
            _attention_case(op, (4, 2, 20), "float16", [1], [9], t_len=21),  # half a head is not whole float4s
            # around backends' chunk-size switches (OpenCL stores up to 32 rows in the attention kernel)
            _attention_case(op, (8, 2, 64), "float16", [2], [17], t_len=32),
            _attention_case(op, (8, 2, 64), "float16", [2], [17], t_len=33),
        ]
    if op == "attention_mixed":
        return [
            _attention_case(op, (4, 4, 32), "float32", [2], [0], t_len=1, prompt=(0, 0)),
            _attention_case(op, (8, 2, 64), "float16", [1, 2, 0], [64, 1, 99], t_len=16, prompt=(3, 9)),
            _attention_case(op, (6, 2, 64), "float32", [3, 0], [5, 37], t_len=7, prompt=(1, 40)),
            _attention_case(op, (4, 1, 128), "float16", [0, 2], [50, 3], t_len=32, prompt=(1, 0)),
            _attention_case(op, (4, 2, 20), "float16", [1], [9], t_len=5, prompt=(2, 3)),  # not whole float4s
            _attention_case(op, (8, 2, 64), "float32", [2], [17], t_len=33, prompt=(0, 2)),  # past the one launch
            _attention_case(op, (2, 1, 256), "float32", [3], [40], t_len=19, prompt=(0, 5)),  # wide heads
            # decode rows over several partitions next to a chunk
            _attention_case(op, (8, 2, 64), "float32", [1, 3], [700, 3], t_len=16, prompt=(0, 300), max_seq=720),
        ]
    if op == "add_bias":
        return [_elementwise_case(op, n, m) for n, m in ((1, 96), (5, 129), (17, 1280))]
    if op == "write_columns":
        return [
            _write_columns_case(n, m, width, start)
            for n, m, width, start in ((1, 64, 96, 32), (7, 33, 129, 0), (17, 256, 768, 512), (5, 1, 3, 1))
        ]
    if op == "scale":
        return [_elementwise_case(op, n, m) for n, m in ((1, 640), (7, 129))]
    if op == "softcap":
        return [_elementwise_case(op, n, m) for n, m in ((1, 4097), (5, 96))]
    if op == "gelu_mul":
        return [_gelu_case(1, 1), _gelu_case(5, 129), _gelu_case(17, 2048)]
    if op == "gate_up_gelu":
        return [
            _gate_up_gelu_case(n, desc)
            for n, desc in ((1, ("int4", 256, 128, 32, "rtn")), (9, ("dense", 130, 64, "float16")))
        ]
    if op == "head_rmsnorm":
        return [_head_norm_case(n, heads) for n, heads in ((1, (4, 1, 256)), (7, (8, 2, 64)), (3, (6, 6, 32)))]
    raise InvalidArgumentError(f"no conformance cases for op {op!r}")


def _format_cases(op: str) -> list[tuple[str, tuple[str, float, Body]]]:
    """(weight format, case) of the optional formats, run where the runtime takes the format
    (Runtime.weight_formats): its own ops, and the ops that take any weight on a weight in it."""
    cases: list[tuple[str, float, Body]] = []
    if op == "int8_gemm":
        cases = [
            _matmul_case(op, 1, ("int8", 1, 96, 32, "q8_0")),
            _matmul_case(op, 1, ("int8", 129, 128, 32, "random")),
            _matmul_case(op, 1, ("int8", 4097, 576, 32, "q8_0")),  # a small model's LM head, in blocks of rows
            _matmul_case(op, 2, ("int8", 3, 128, 64, "q5_0")),
            _matmul_case(op, 5, ("int8", 300, 256, 128, "random")),
            _matmul_case(op, 8, ("int8", 129, 640, 32, "q5_0")),
            _matmul_case(op, 9, ("int8", 129, 640, 32, "q8_0")),  # around a GEMV kernel's largest n
            _matmul_case(op, 17, ("int8", 8200, 512, 32, "random")),  # several 16 MiB float32 blocks
            _matmul_case(op, 64, ("int8", 1536, 96, 32, "q8_0")),
            _matmul_case(op, 1, ("int8", 257, 512, 16, "q6_k")),
            _matmul_case(op, 3, ("int8", 65, 256, 16, "q6_k")),
            _matmul_case(op, 17, ("int8", 130, 256, 16, "q6_k")),
            # past the GEMV's 64 tokens: the tiled GEMM, or the matrix units
            _matmul_case(op, 80, ("int8", 130, 256, 16, "q6_k")),
            _matmul_case(op, 100, ("int8", 96, 320, 32, "q8_0")),
            _matmul_case(op, 65, ("int8", 64, 48, 16, "random")),  # an odd number of 16-column chunks
        ]
    elif op == "embedding":
        cases = [
            _embedding_case(1, ("int8", 1001, 96, 32, "q8_0")),
            _embedding_case(17, ("int8", 4097, 640, 32, "q5_0")),
            _embedding_case(64, ("int8", 300, 128, 64, "random")),
            _embedding_case(5, ("int8", 300, 256, 16, "q6_k")),
        ]
    elif op in ("linear", "logits"):
        m = 4097 if op == "logits" else 129
        cases = [_matmul_case(op, 1, ("int8", m, 128, 32, "q8_0")), _matmul_case(op, 5, ("int8", m, 96, 32, "random"))]
    elif op == "qkv_proj":
        cases = [_qkv_case(1, "int8"), _qkv_case(7, "int8")]
    elif op == "gate_up_silu":
        cases = [_matmul_case(op, n, ("int8", 2 * f, 128, 32, "q5_0")) for n, f in ((1, 128), (9, 65))]
    elif op == "gate_up_gelu":
        cases = [_gate_up_gelu_case(n, ("int8", 2 * f, 64, 32, "q8_0")) for n, f in ((1, 128), (9, 65))]
    elif op in ("linear_add_rmsnorm", "linear_post_norm_add_rmsnorm"):
        post = op == "linear_post_norm_add_rmsnorm"
        cases = [
            _linear_norm_case(1, ("int8", 576, 128, 32, "q8_0"), 1e-5, post),
            _linear_norm_case(12, ("int8", 129, 96, 32, "random"), 1e-6, post),
        ]
    return [("int8", case) for case in cases] + [
        (kind, case) for kind in _SPLIT_CASES for case in _split_cases(kind, op)
    ]


# The split formats' cases: group size, the GEMM's (n, rows, cols, making), the embedding's (n, rows, cols, making),
# and the (cols, making) of the other ops that take any weight (int6 in whole 256-column blocks).
_SPLIT_CASES = {
    "int5": {
        "group": 32,
        "gemm": (
            (1, 1, 64, "q5_0"),
            (1, 129, 128, "random"),
            (1, 4097, 640, "q5_0"),  # in blocks of rows
            (2, 3, 96, "q5_1"),
            (3, 130, 256, "random"),  # one tile of the integer kernels, padded
            (8, 129, 640, "q5_0"),
            (17, 65, 320, "q5_1"),
            (33, 96, 128, "q5_0"),  # past the integer kernels' rows: dequantized for BLAS
            (64, 1536, 96, "random"),
            (80, 130, 128, "q5_0"),  # past the GEMV's 64 tokens: a tiled GEMM, or the matrix units
            (70, 65, 96, "q5_1"),
        ),
        "embedding": ((1, 1001, 96, "q5_0"), (17, 300, 640, "q5_1")),
        "linear": ((128, "q5_1"), (96, "random")),  # 1 token, then 5
        "gate_up_silu": (128, "q5_0"),
        "gate_up_gelu": (64, "q5_0"),
        "norm": (128, "q5_0"),
    },
    "int6": {
        "group": 16,
        "gemm": (
            (1, 1, 256, "q6_k"),
            (1, 129, 512, "random"),
            (1, 4097, 256, "q6_k"),  # in blocks of rows
            (2, 3, 768, "q6_k"),
            (3, 130, 256, "random"),
            (8, 129, 512, "q6_k"),
            (17, 65, 256, "random"),
            (33, 96, 256, "q6_k"),  # past the integer kernels' rows
            (64, 300, 256, "random"),
            (80, 130, 256, "q6_k"),  # past the GEMV's 64 tokens
            (65, 64, 512, "random"),
        ),
        "embedding": ((1, 1001, 256, "q6_k"), (17, 300, 512, "random")),
        "linear": ((256, "q6_k"), (256, "random")),
        "gate_up_silu": (256, "q6_k"),
        "gate_up_gelu": (256, "q6_k"),
        "norm": (256, "q6_k"),
    },
}


def _split_cases(kind: str, op: str) -> list[tuple[str, float, Body]]:
    """_format_cases of a split format (int5, int6): its own GEMM, and the ops that take any weight."""
    table = _SPLIT_CASES[kind]
    group = table["group"]
    if op == f"{kind}_gemm":
        return [_matmul_case(op, n, (kind, m, k, group, how)) for n, m, k, how in table["gemm"]]
    if op == "embedding":
        return [_embedding_case(n, (kind, m, k, group, how)) for n, m, k, how in table["embedding"]]
    if op in ("linear", "logits"):
        m = 4097 if op == "logits" else 129
        one, five = table["linear"]
        return [_matmul_case(op, n, (kind, m, k, group, how)) for n, (k, how) in ((1, one), (5, five))]
    if op == "qkv_proj":
        return [_qkv_case(1, kind), _qkv_case(7, kind)]
    if op in ("gate_up_silu", "gate_up_gelu"):
        k, how = table[op]
        make = partial(_matmul_case, op) if op == "gate_up_silu" else _gate_up_gelu_case
        return [make(n, (kind, 2 * f, k, group, how)) for n, f in ((1, 128), (9, 65))]
    if op in ("linear_add_rmsnorm", "linear_post_norm_add_rmsnorm"):
        k, how = table["norm"]
        return [_linear_norm_case(1, (kind, 576, k, group, how), 1e-5, op == "linear_post_norm_add_rmsnorm")]
    return []


def _feature_cases(op: str) -> list[tuple[frozenset[str], tuple[str, float, Body]]]:
    """Attention cases of the optional features, run where the op declares them (OpTable.features)."""
    if op not in ("attention_decode", "attention_prefill"):
        return []
    cases = [
        ({"window": 8}, dict(slots=[1, 0], positions=[3, 40])),
        ({"softcap": 5.0}, dict(slots=[2], positions=[20])),
        ({"scale": 0.3}, dict(slots=[0], positions=[9])),
        ({"window": 16, "softcap": 3.0, "scale": 0.05}, dict(slots=[3, 1], positions=[70, 2])),
    ]
    out = []
    for features, where in cases:
        kwargs: dict[str, Any] = dict(where)
        if op == "attention_prefill":
            kwargs = {"slots": where["slots"][:1], "positions": where["positions"][:1], "t_len": 23}
        out.append((frozenset(features), _attention_case(op, (4, 2, 32), "float32", **kwargs, **features)))
    if op == "attention_prefill":  # a longer prompt chunk, float16 cache: the kernels for long prompts
        features = {"window": 16, "softcap": 3.0, "scale": 0.05}
        case = _attention_case(op, (4, 2, 32), "float16", [1], [20], t_len=45, **features)
        out.append((frozenset(features), case))
    return out


def _elementwise_case(op: str, n: int, m: int) -> tuple[str, float, Body]:
    def body(t: _Trial, rng: np.random.Generator) -> None:
        x = _activations(rng, (n, m), decades=1.0)
        out = t.output("out", (n, m))
        if op == "add_bias":
            bias = rng.standard_normal(m).astype(np.float32)
            t.rt.ops.add_bias(t.input("x", x), t.input("bias", bias), out)
            t.compare("out", reference.add_bias(x, bias), EXACT_LIMIT)
        elif op == "scale":
            t.rt.ops.scale(t.input("x", x), 25.3, out)
            t.compare("out", np.asarray(x, np.float64) * 25.3, EXACT_LIMIT)
        else:
            t.rt.ops.softcap(t.input("x", x), 30.0, out)
            t.compare("out", reference.softcap(x, 30.0), NORM_LIMIT)

    return f"n={n} m={m}", EXACT_LIMIT if op != "softcap" else NORM_LIMIT, body


def _write_columns_case(n: int, m: int, width: int, start: int) -> tuple[str, float, Body]:
    """Columns start..start+m-1 of every row of out take x's; out's other columns keep their values."""

    def body(t: _Trial, rng: np.random.Generator) -> None:
        x = _activations(rng, (n, m), decades=1.0)
        before = _activations(rng, (n, width), decades=1.0)
        out = t.scratch_input("out", before)
        t.rt.ops.write_columns(t.input("x", x), start, out)
        expected = before.copy()
        expected[:, start : start + m] = x
        t.compare("out", expected, EXACT_LIMIT)

    return f"n={n} m={m} into {width} columns at {start}", EXACT_LIMIT, body


def _gelu_case(n: int, f: int) -> tuple[str, float, Body]:
    def body(t: _Trial, rng: np.random.Generator) -> None:
        gate_up = _activations(rng, (n, 2 * f), decades=1.5)
        out = t.output("out", (n, f))
        t.rt.ops.gelu_mul(t.input("gate_up", gate_up), out)
        t.compare("out", reference.gelu_mul(gate_up), NORM_LIMIT)

    return f"n={n} f={f}", NORM_LIMIT, body


def _gate_up_gelu_case(n: int, desc: tuple) -> tuple[str, float, Body]:
    def body(t: _Trial, rng: np.random.Generator) -> None:
        w = _make_weight(rng, desc)
        x = _activations(rng, (n, desc[2]), decades=1.0)
        out = t.output("out", (n, desc[1] // 2))
        t.rt.ops.gate_up_gelu(t.input("x", x), t.weight(w), out)
        t.compare("out", reference.gelu_mul(reference.matmul(x, w)), MATMUL_LIMIT)

    return f"n={n} {_describe(desc)}", MATMUL_LIMIT, body


def _head_norm_case(n: int, heads: tuple[int, int, int]) -> tuple[str, float, Body]:
    spec = AttentionSpec(*heads)

    def body(t: _Trial, rng: np.random.Generator) -> None:
        qkv = _activations(rng, (n, spec.qkv_dim), decades=2.0)
        qw = (1.0 + 0.3 * rng.standard_normal(spec.head_dim)).astype(np.float32)
        kw = (1.0 + 0.3 * rng.standard_normal(spec.head_dim)).astype(np.float32)
        out = t.output("out", (n, spec.qkv_dim))
        t.rt.ops.head_rmsnorm(t.input("qkv", qkv), t.input("q_weight", qw), t.input("k_weight", kw), 1e-6, spec, out)
        t.compare("out", reference.head_rmsnorm(qkv, qw, kw, 1e-6, spec), NORM_LIMIT)

    return f"n={n} heads {spec.n_heads}/{spec.n_kv_heads}x{spec.head_dim}", NORM_LIMIT, body


# -- running ---------------------------------------------------------------------------------------------


def _describe_exception(exc: BaseException) -> str:
    """The exception and the innermost frame it came from, which is usually the op's own code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(exc).__name__}: {exc}{where}"


def _run_case(rt: Any, op: str, case: str, limit: float, body: Body, seed: int) -> CaseResult:
    rng = np.random.default_rng([seed, zlib.crc32(f"{op}/{case}".encode())])  # each case reproducible alone
    trial = _Trial(rt)
    try:
        with np.errstate(all="ignore"):  # the report, not a stream of warnings, says what went wrong
            body(trial, rng)
            trial.verify_untouched()
    except Exception as exc:  # an op that raises fails its case; it must not stop the other cases
        trial.problems.append(_describe_exception(exc))
    passed = not trial.problems and trial.nmse is not None and trial.nmse <= limit
    error = "\n".join(trial.problems) or None
    return CaseResult(op, case, trial.nmse, limit, passed, error, rt.ops.sources.get(op, "?"))


HOST_WRITE_OPS = ("argmax", "sample")  # composites whose generic version writes its result with rt.write


def _can_write(rt: Any) -> bool:
    from .backend import Runtime

    return type(rt).write is not Runtime.write


def check_backend(
    name: str,
    device: int | str | None = None,
    ops: list[str] | None = None,
    seed: int = 0,
    registry: Any = None,
) -> ConformanceReport:
    """Run the conformance cases of ``ops`` (default: all of OP_NAMES) on a device of backend ``name``; the
    cases of a weight format (an int8 matmul, say) only where the runtime takes it (``Runtime.weight_formats``).

    ``registry`` defaults to the process-wide one (perfx_core.plugins.get_registry()). A backend that
    cannot be opened raises its error; an op that raises or is wrong fails its case in the report.
    """
    unknown = [op for op in ops or () if op not in OP_NAMES]
    if unknown:
        raise InvalidArgumentError(f"unknown op(s) {', '.join(unknown)}; ops are {', '.join(OP_NAMES)}")
    if registry is None:
        from .plugins import get_registry  # plugins imports ops; importing it lazily keeps this module light

        registry = get_registry()
    start = time.perf_counter()
    rt = registry.open_runtime(name, device)
    report = ConformanceReport(backend=name, device=rt.device.name, seed=seed)
    try:
        for op in [op for op in OP_NAMES if ops is None or op in ops]:
            if op not in rt.ops.sources:
                continue  # an op of a weight format this backend does not take (ops.FORMAT_OPS)
            if op in HOST_WRITE_OPS and rt.ops.sources[op].startswith("perfx_core:") and not _can_write(rt):
                continue  # the generic version needs Runtime.write, which is optional; the model never calls it
            for case, limit, body in _cases(op):
                report.results.append(_run_case(rt, op, case, limit, body, seed))
            for weight_format, (case, limit, body) in _format_cases(op):
                if weight_format in rt.weight_formats:
                    report.results.append(_run_case(rt, op, case, limit, body, seed))
            declared = rt.ops.features(op)
            for features, (case, limit, body) in _feature_cases(op):
                if features <= declared:
                    report.results.append(_run_case(rt, op, case, limit, body, seed))
    finally:
        rt.close()
    report.seconds = time.perf_counter() - start
    return report
