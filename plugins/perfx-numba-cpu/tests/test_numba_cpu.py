"""perfx-numba-cpu as a user gets it: found by its entry point, chosen by priority, conformant, same logits."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from perfx_core.errors import InvalidArgumentError
from perfx_core.plugins import get_registry
from perfx_core.split_weights import pack_int5, pack_int6
from perfx_core.testing import assert_backend_conforms, isolated_plugins
from perfx_core.weights import Int4KScales, Int4Weight, Int5Weight, Int6Weight, Int8Weight, dequantize

PLUGIN = "numba-cpu"
INSTALLED = any(ep.name == PLUGIN for ep in importlib.metadata.entry_points(group="perfx"))

pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="perfx-numba-cpu is not installed: run `pip install -e plugins/perfx-numba-cpu`"
)

REPLACED = (
    "embedding",
    "int4_gemv",
    "int4_gemm",
    "dense_gemm",
    "int8_gemm",
    "int5_gemm",
    "int6_gemm",
    "head_rmsnorm",
    "rmsnorm",
    "add_rmsnorm",
    "silu_mul",
    "gelu_mul",
    "attention_decode",
    "linear",
    "qkv_proj",
    "gate_up_silu",
    "logits",
    "linear_add_rmsnorm",
)


@pytest.fixture
def plugin_env(monkeypatch):
    yield from isolated_plugins(monkeypatch)


def int16_rounding_bound(x, values, group):
    """How far each output of x @ values.T may move when the kernels round x to int16 steps of its group's
    max |x| / 32767 (the int4 kernels and the int8 kernels with groups of 16 or 32): half a step times the row's
    |w| per group."""
    n, m = x.shape[0], values.shape[0]
    step = np.abs(x.reshape(n, -1, group)).max(axis=2) / 32767
    return 0.5 * np.einsum("jp,rp->jr", step, np.abs(values).reshape(m, -1, group).sum(axis=2))


def assert_within(out, want, bound, what=""):
    """out within ``bound`` (plus float32 rounding) of float64 ``want``, and its NMSE below 1e-8."""
    assert np.all(np.abs(out - want) <= bound + 1e-5 * np.abs(want) + 1e-6), what
    assert ((out - want) ** 2).sum() / (want**2).sum() < 1e-8, what


def test_discovered_through_entry_point_and_chosen_by_priority(plugin_env):
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="perfx") if ep.name == PLUGIN]
    assert ep.value == "perfx_numba_cpu"
    registry = get_registry(refresh=True)
    chosen = registry.resolve("numpy")
    for op in REPLACED:
        assert chosen[op].plugin == PLUGIN, op
        assert chosen[op].priority == 20
    # It outranks the NumPy backend (0) and perfx-lowmem-int4 (10) when both are installed.
    by_plugin = {impl.plugin: impl.priority for impl in registry.candidates("numpy", "int4_gemv")}
    assert by_plugin[PLUGIN] > max(p for name, p in by_plugin.items() if name != PLUGIN)
    assert chosen["attention_prefill"].plugin == "numpy"  # it replaces only what it registers


def test_can_be_disabled(plugin_env):
    plugin_env.setenv("PERFX_DISABLE_PLUGINS", f"{PLUGIN},lowmem-int4")
    chosen = get_registry(refresh=True).resolve("numpy")
    assert all(chosen[op].plugin != PLUGIN for op in REPLACED)


def test_conforms(plugin_env):
    get_registry(refresh=True)
    assert_backend_conforms("numpy")


def test_int4_gemv_keeps_weights_packed(plugin_env):
    rng = np.random.default_rng(0)
    m, k = 1000, 576
    weight = Int4Weight(
        rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
        rng.uniform(-0.05, 0.05, (m, k // 32)).astype(np.float16),
        rng.normal(0.0, 0.1, (m, k // 32)).astype(np.float32),
        32,
    )
    rt = get_registry(refresh=True).open_runtime("numpy")
    w = rt.prepare_weight(weight)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, m), dtype=np.float32)
    rt.ops.int4_gemv(x, w, out)
    assert w._float32 is None  # the float copy was never built
    values = w.float32().astype(np.float64)
    assert_within(out, x @ values.T, int16_rounding_bound(x, values, 32))


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("bias_kind", ["float16", "float32", "q4_k"])
def test_int4_weight_is_held_once_as_the_kernels_blocks(plugin_env, monkeypatch, mode, bias_kind):
    """At its first matmul an int4 weight becomes the kernels' blocks and its row-major arrays are freed: the
    handle holds the codes, the float16 scales and the biases once (float16 where they are exactly float16, as
    GGUF Q4_0/Q4_1's; float32 otherwise), or a Q4_K weight's own factors (uint8 sc and m per 32 columns, float16
    d and dmin per 256), whose products it takes exactly, not the float16 rounding of d * sc. Every path reads the
    blocks: the GEMV, prefill's BLAS path (whole and in tiles), the embedding lookup, and a rebuilt Int4Weight for
    any other op, bit for bit."""
    import gc
    import weakref

    import perfx_numba_cpu

    monkeypatch.setattr(perfx_numba_cpu, "PARALLEL_MODE", mode)
    rng = np.random.default_rng(5)
    m, k = 200, 128 if bias_kind != "q4_k" else 512  # not a whole number of 64-row blocks: the last one is padded
    packed = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    if bias_kind == "q4_k":
        factors = Int4KScales(
            rng.uniform(1e-4, 2e-3, (m, k // 256)).astype(np.float16),
            rng.uniform(1e-4, 2e-3, (m, k // 256)).astype(np.float16),
            rng.integers(0, 64, (m, k // 32), dtype=np.uint8),
            rng.integers(0, 64, (m, k // 32), dtype=np.uint8),
        )
        weight = Int4Weight(packed, *factors.scale_bias(), 32, factors)
        exact_scale = np.repeat(factors.d.astype(np.float64), 8, axis=1) * factors.sc
        exact_bias = -np.repeat(factors.dmin.astype(np.float64), 8, axis=1) * factors.m
        codes = np.stack((packed & 15, packed >> 4), axis=-1).reshape(m, k // 32, 32)
        values = (codes * exact_scale[..., None] + exact_bias[..., None]).reshape(m, k)
        assert not np.array_equal(weight.scale.astype(np.float64), exact_scale)  # float16 rounds some d * sc
    else:
        bias = rng.normal(0.0, 0.1, (m, k // 32))
        weight = Int4Weight(
            packed,
            rng.uniform(-0.05, 0.05, (m, k // 32)).astype(np.float16),
            bias.astype(np.float16).astype(np.float32) if bias_kind == "float16" else bias.astype(np.float32),
            32,
        )
        values = dequantize(weight, np.float64)
    arrays = [a.copy() for a in (weight.packed, weight.scale, weight.bias)]
    if weight.k_scales is not None:
        arrays += [a.copy() for a in weight.k_scales.arrays]
    rt = get_registry(refresh=True).open_runtime("numpy")
    before = rt.allocated_bytes
    w = rt.prepare_weight(weight)
    assert rt.allocated_bytes - before == weight.nbytes
    gone = weakref.ref(weight)
    del weight
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, m), dtype=np.float32)
    rt.ops.linear(x, w, out)
    assert_within(out, x @ values.T, int16_rounding_bound(x, values, 32))
    xs = rng.standard_normal((5, k)).astype(np.float32)  # a tile and a padded one: each row as if alone
    batch = np.empty((5, m), dtype=np.float32)
    rt.ops.linear(xs, w, batch)
    assert_within(batch, xs @ values.T, int16_rounding_bound(xs, values, 32))
    for j in range(5):
        rt.ops.linear(xs[j : j + 1], w, out)
        np.testing.assert_array_equal(batch[j], out[0])
    gc.collect()
    assert gone() is None and w._weight is None  # the row-major arrays are freed
    blocks = 256  # rows, padded
    if bias_kind == "q4_k":  # 0.578 bytes per weight, the file's 0.5625 (144 bytes per 256)
        held = blocks * (k // 2 + (k // 32) * 2 + (k // 256) * 4)
    else:
        held = blocks * (k // 2 + (k // 32) * (2 + (2 if bias_kind == "float16" else 4)))
    assert rt.weight_bytes(w) == held
    assert rt.allocated_bytes - before == held
    rebuilt = w.weight
    got_arrays = [rebuilt.packed, rebuilt.scale, rebuilt.bias]
    if bias_kind == "q4_k":
        got_arrays += list(rebuilt.k_scales.arrays)
    for got, want in zip(got_arrays, arrays, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    ids = np.array([0, 199, 64, 63, 5, 199], dtype=np.int64)
    rows = np.empty((len(ids), k), dtype=np.float32)
    rt.ops.embedding(w, ids, rows)
    np.testing.assert_array_equal(rows, values[ids].astype(np.float32))
    for bad in ([200], [-1]):  # past the last row (inside the padded block) and negative
        with pytest.raises(InvalidArgumentError, match="embedding ids"):
            rt.ops.embedding(w, np.array(bad, dtype=np.int64), rows[:1])
    x = rng.standard_normal((40, k)).astype(np.float32)  # past SMALL_N: dequantized blocks for BLAS
    for tile_bytes in (perfx_numba_cpu.TILE_BYTES, 64 * k * 4):  # whole, and one block of rows at a time
        monkeypatch.setattr(perfx_numba_cpu, "TILE_BYTES", tile_bytes)
        out = np.full((40, m), np.nan, dtype=np.float32)
        rt.ops.linear(x, w, out)
        np.testing.assert_allclose(out, x @ values.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_fused_gate_up_silu_and_both_thread_modes(plugin_env, monkeypatch, mode):
    """The one-kernel gate_up_silu (f a multiple of 64 rows), the GEMV and the kit, one thread and parallel."""
    import perfx_numba_cpu

    monkeypatch.setattr(perfx_numba_cpu, "PARALLEL_MODE", mode)
    rng = np.random.default_rng(2)
    f, k = 192, 128
    weight = Int4Weight(
        rng.integers(0, 256, (2 * f, k // 2), dtype=np.uint8),
        rng.uniform(-0.05, 0.05, (2 * f, k // 32)).astype(np.float16),
        rng.normal(0.0, 0.1, (2 * f, k // 32)).astype(np.float32),
        32,
    )
    rt = get_registry(refresh=True).open_runtime("numpy")
    w = rt.prepare_weight(weight)
    dense = w.float32().astype(np.float64)
    for n in (1, 2, 3, 4, 9):  # one row, two row by row, a padded tile, a whole tile, tiles and a padded one
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.empty((n, f), dtype=np.float32)
        rt.ops.gate_up_silu(x, w, out)
        gate_up = x.astype(np.float64) @ dense.T
        bound = int16_rounding_bound(x, dense, 32)
        gate, up, e_gate, e_up = gate_up[:, :f], gate_up[:, f:], bound[:, :f], bound[:, f:]
        silu = gate / (1.0 + np.exp(-gate))
        # silu's slope is below 1.1, so silu(g) * u moves by at most 1.1 e_g (|u| + e_u) + |silu(g)| e_u
        assert_within(out, silu * up, 1.1 * e_gate * (np.abs(up) + e_up) + np.abs(silu) * e_up, f"gate_up_silu {n}")
        full = np.empty((n, 2 * f), dtype=np.float32)
        rt.ops.linear(x, w, full)
        assert_within(full, gate_up, bound, f"linear {n}")
        residual = rng.standard_normal((n, 2 * f)).astype(np.float32)
        norm_weight = rng.uniform(0.5, 1.5, 2 * f).astype(np.float32)
        summed = residual.astype(np.float64) + gate_up
        normed = summed / np.sqrt(np.mean(summed**2, axis=1, keepdims=True) + 1e-5) * norm_weight
        rt.ops.linear_add_rmsnorm(x, w, residual, norm_weight, 1e-5, full)
        assert_within(residual, summed, bound, f"linear_add_rmsnorm residual {n}")
        assert ((full - normed) ** 2).sum() / (normed**2).sum() < 1e-8, f"linear_add_rmsnorm {n}"
    # The kit again with every kernel that has a parallel and a single-threaded version forced to one.
    assert_backend_conforms(
        "numpy",
        ops=["int4_gemv", "int4_gemm", "dense_gemm", "silu_mul", "gelu_mul", "attention_decode", "gate_up_silu"]
        + ["linear_add_rmsnorm"],
    )


@pytest.mark.parametrize("kernel", ["attention_decode", "attention_decode_serial"])
@pytest.mark.parametrize(
    "features", [(0.25, 0, 0.0), (0.4, 12, 0.0), (0.3, 0, 5.0)], ids=["plain", "window-12", "softcap-5"]
)
def test_attention_parts_agree(kernel, features):
    """Decode attention split into 2, 3 or 5 parts of the positions (some empty at short contexts) = one part,
    with a window and soft-capping too (the conformance kit checks them against the reference)."""
    from perfx_numba_cpu import kernels

    rng = np.random.default_rng(3)
    n_heads, n_kv, hd, seq = 6, 2, 16, 40
    slots, positions = np.array([1, 0], np.int32), np.array([0, 37], np.int32)  # one token of context, and 38
    qkv = rng.standard_normal((2, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (seq, hd // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cache = rng.standard_normal((2, 1, 2, n_kv, seq, hd)).astype(np.float32)  # (k or v, layer, slot, ...)
    results = []
    for parts in (1, 2, 3, 5):
        k, v, out = cache[0].copy(), cache[1].copy(), np.full((2, n_heads * hd), np.nan, np.float32)
        scale, window, cap = np.float32(features[0]), features[1], np.float32(features[2])
        getattr(kernels, kernel)(
            qkv, k, v, 0, slots, positions, cos, sin, n_heads, n_kv, hd, parts, scale, window, cap, out
        )
        results.append((k, v, out))
    for k, v, out in results[1:]:
        np.testing.assert_array_equal(k, results[0][0])
        np.testing.assert_array_equal(v, results[0][1])
        np.testing.assert_allclose(out, results[0][2], rtol=1e-5, atol=1e-6)


def test_float16_cache_decode_attention_runs_in_the_kernel(plugin_env, monkeypatch):
    """A float16 KV cache (head sizes that are multiples of 16) takes the plugin's kernel, not the NumPy backend's
    attention: the new rows are the float32 path's, rounded once, and the output matches attention over a float32
    cache holding the same rounded history (where the float32 path attends to its new row unrounded: ~1e-5 apart;
    a row read from the wrong place would be ~1 off)."""
    import perfx_numba_cpu
    from perfx_numpy import ops as numpy_ops

    from perfx_core.backend import RopeTable
    from perfx_core.specs import AttentionSpec, KVCacheSpec

    def refuse(*args):
        raise AssertionError("the NumPy backend's attention_decode ran")

    rt = get_registry(refresh=True).open_runtime("numpy")
    rng = np.random.default_rng(4)
    n_heads, n_kv, hd, seq = 4, 1, 256, 64  # Gemma 3's head shape
    spec = AttentionSpec(n_heads, n_kv, hd)
    angles = rng.uniform(0, 6.3, (seq, hd // 2))
    rope = RopeTable(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    caches = [rt.new_kv_cache(KVCacheSpec(2, 3, seq, n_kv, hd, dtype)) for dtype in ("float16", "float32")]
    history = rng.standard_normal((2, 2, 3, n_kv, seq, hd)).astype(np.float16)
    for cache in caches:
        rt.kv_cache_from_numpy(cache, *history)
    slots, positions = np.array([2, 0], np.int32), np.array([40, 7], np.int32)
    qkv = rng.standard_normal((2, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    outs = []
    monkeypatch.setattr(numpy_ops, "attention_decode", refuse)
    for cache in caches:
        out = np.full((2, n_heads * hd), np.nan, np.float32)
        perfx_numba_cpu.attention_decode(rt, qkv, cache, 1, slots, positions, rope, spec, out)
        outs.append(out)
        if cache.k.dtype == np.float32:  # what the float16 cache holds: the same values, rounded once
            for half, full in ((caches[0].k, cache.k), (caches[0].v, cache.v)):
                np.testing.assert_array_equal(half, full.astype(np.float16))
            cache.k[...], cache.v[...] = caches[0].k, caches[0].v
            perfx_numba_cpu.attention_decode(rt, qkv, cache, 1, slots, positions, rope, spec, out)
    np.testing.assert_allclose(outs[0], out, rtol=1e-4, atol=1e-4)


def assert_matmuls(rt, w, x, values, format_op):
    """``format_op``, linear and logits of x by the handle w against float64 ``values``: within the int16 rounding
    of x per 32-column piece up to INT8_MAX_N rows (int16_rounding_bound), NMSE below 1e-8; the last output."""
    import perfx_numba_cpu

    n, m = x.shape[0], values.shape[0]
    want = x @ values.T
    tolerance = 1e-4
    if n <= perfx_numba_cpu.INT8_MAX_N:
        tolerance += int16_rounding_bound(x, values, 32)
    for op in (format_op, "linear", "logits"):
        out = np.full((n, m), np.nan, dtype=np.float32)
        getattr(rt.ops, op)(x, w, out)
        assert np.all(np.abs(out - want) <= tolerance + 1e-4 * np.abs(want)), f"{op} n={n}"
        assert ((out - want) ** 2).sum() / (want**2).sum() < 1e-8, f"{op} n={n}"
    return out


@pytest.mark.parametrize("mode", ["never", "always"])
def test_int8_gemm_runs_on_the_weights_own_arrays(plugin_env, monkeypatch, mode):
    """An int8 weight (GGUF Q8_0 / Q5_0) is multiplied as it is: the GEMV kernel up to INT8_MAX_N rows, blocks of
    rows dequantized for BLAS beyond (several blocks here); no float copy, no layout, nothing held but its codes
    and scales."""
    import perfx_numba_cpu

    monkeypatch.setattr(perfx_numba_cpu, "PARALLEL_MODE", mode)
    monkeypatch.setattr(perfx_numba_cpu, "INT8_TILE_BYTES", 100 * 96 * 4)  # 100 rows a block: 4 blocks
    rng = np.random.default_rng(1)
    m, k = 333, 96
    weight = Int8Weight(
        rng.integers(-128, 128, (m, k), dtype=np.int8), rng.uniform(-0.02, 0.02, (m, k // 32)).astype(np.float16)
    )
    rt = get_registry(refresh=True).open_runtime("numpy")
    assert "int8" in rt.weight_formats
    w = rt.prepare_weight(weight)
    values = dequantize(weight, np.float64)
    for n in (1, 2, 3, 8, 9, 40):
        assert_matmuls(rt, w, rng.standard_normal((n, k)).astype(np.float32), values, "int8_gemm")
    assert w._float32 is None and perfx_numba_cpu.ATTR not in w.__dict__
    assert rt.weight_bytes(w) == weight.codes.nbytes + weight.scale.nbytes == m * k * 17 // 16


def _split_weight(kind: str, m: int, rng) -> tuple:
    """(weight, its float64 values' first row as the extreme codes make it, bytes per weight) of an int5 weight
    (96 columns) or an int6 one (512 columns); row 0 has every high bit set (the largest code), row 1 none."""
    if kind == "int5":
        codes = rng.integers(0, 32, (m, 96), dtype=np.uint8)
        codes[0], codes[1] = 31, 0
        scale = rng.uniform(-0.02, 0.02, (m, 3)).astype(np.float16)
        bias = rng.uniform(-0.3, 0.3, (m, 3)).astype(np.float16)
        weight = Int5Weight(*pack_int5(codes), scale, bias)
        return weight, np.repeat(31 * scale[0].astype(np.float64) + bias[0], 32), 0.75
    codes = rng.integers(0, 64, (m, 512), dtype=np.uint8)
    codes[0], codes[1] = 63, 0
    sub, d = rng.integers(-128, 128, (m, 32), dtype=np.int8), rng.uniform(1e-4, 1e-3, (m, 2)).astype(np.float16)
    weight = Int6Weight(*pack_int6(codes), sub, d)
    first = 31 * np.repeat(d[0].astype(np.float64), 16) * sub[0]
    return weight, np.repeat(first, 16), 0.8203125


@pytest.mark.parametrize("kind", ["int5", "int6"])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_split_gemms_run_on_the_weights_own_arrays(plugin_env, monkeypatch, mode, kind):
    """An int5 weight (GGUF Q5_0 / Q5_1 / Q5_K) or int6 one (Q6_K) is multiplied as it is: codes built from its
    nibbles and bit planes in the GEMV kernel up to INT8_MAX_N rows (each row of x the same to the bit whether alone
    or in a batch), blocks of rows dequantized for BLAS beyond; a non-finite x takes the float path and propagates;
    nothing is held but the weight's own arrays."""
    import perfx_numba_cpu

    rng = np.random.default_rng(2)
    m, op = 333, f"{kind}_gemm"
    weight, first_row, per_weight = _split_weight(kind, m, rng)
    k = weight.shape[1]
    monkeypatch.setattr(perfx_numba_cpu, "PARALLEL_MODE", mode)
    monkeypatch.setattr(perfx_numba_cpu, "INT8_TILE_BYTES", 100 * k * 4)  # 100 rows a block: 4 blocks
    rt = get_registry(refresh=True).open_runtime("numpy")
    assert kind in rt.weight_formats
    w = rt.prepare_weight(weight)
    values = dequantize(weight, np.float64)
    np.testing.assert_array_equal(values[0], first_row)
    alone = {}
    for n in (1, 2, 3, 5, 8, 31, 32, 33, 40):
        x = rng.standard_normal((n, k)).astype(np.float32)
        x[-1] *= 1e3  # a row far larger than the others: its own int16 steps
        out = assert_matmuls(rt, w, x, values, op)
        if n <= perfx_numba_cpu.INT8_MAX_N:
            for j in (0, n - 1):
                if (n, j) == (1, 0):
                    continue
                lone = np.empty((1, m), np.float32)
                getattr(rt.ops, op)(x[j : j + 1], w, lone)
                alone[n, j] = np.array_equal(lone[0], out[j])
    assert all(alone.values()), alone
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 5] = np.inf
    out = np.zeros((3, m), np.float32)
    getattr(rt.ops, op)(x, w, out)
    assert np.isfinite(out[[0, 2]]).all() and not np.isfinite(out[1]).any()
    assert w._float32 is None and perfx_numba_cpu.ATTR not in w.__dict__
    assert rt.weight_bytes(w) == weight.nbytes == m * k * per_weight


def _model_logits(prompt, decoded):
    """Logits of every prompt position (prefill) and of each decode step fed the fixed ``decoded`` tokens."""
    import perfx_core

    model = perfx_core.load(context_length=256)
    try:
        engine = model.engine
        rows = [engine.prefill(prompt, slot=0, all_logits=True)]
        for i, token in enumerate(decoded):
            rows.append(engine.decode([token], [0], [len(prompt) + i]))
        return np.concatenate(rows), dict(engine.rt.ops.sources)
    finally:
        model.close()


def test_model_logits_match_numpy_backend(plugin_env):
    """SmolLM2: a 32-token prompt (prefill, on the packed kernels: one KV slot) then 32 decode steps, with and
    without the plugin: 64 positions."""
    ids = np.random.default_rng(0).integers(0, 49152, 64).tolist()
    prompt, decoded = ids[:32], ids[32:]
    fast, sources = _model_logits(prompt, decoded)
    assert sources["int4_gemv"].startswith(PLUGIN)
    plugin_env.setenv("PERFX_DISABLE_PLUGINS", f"{PLUGIN},lowmem-int4")
    get_registry(refresh=True)
    slow, sources = _model_logits(prompt, decoded)
    assert sources["int4_gemv"].startswith("numpy")
    nmse = float(np.sum((fast.astype(np.float64) - slow) ** 2) / np.sum(slow.astype(np.float64) ** 2))
    print(f"logits NMSE over {len(fast)} positions: {nmse:.3g}")
    assert fast.shape == slow.shape == (64, 49152)
    assert nmse < 1e-5, nmse


def test_prompts_and_batched_decode_keep_weights_packed(plugin_env):
    """A 19-token prompt and a decode step of 4 sequences run the packed kernels and make no float copy of a weight
    (0.4 GB and seconds on SmolLM2), on one KV slot (perfx run) or several (a server); the batched step's logits
    equal those of each sequence decoded alone."""
    import perfx_core

    ids = np.random.default_rng(1).integers(0, 49152, 19).tolist()
    for slots in (1, 4):
        model = perfx_core.load(None, n_slots=slots, context_length=64)
        try:
            engine = model.engine
            for slot in range(slots):
                engine.prefill(ids[: 10 + slot], slot=slot)
            tokens, positions = [7, 8, 9, 10][:slots], [10 + slot for slot in range(slots)]
            batched = engine.decode(tokens, list(range(slots)), positions)
            alone = [engine.decode([t], [slot], [p]) for slot, (t, p) in enumerate(zip(tokens, positions, strict=True))]
            np.testing.assert_allclose(batched, np.concatenate(alone), rtol=2e-4, atol=2e-4)
            made = [layer.w_qkv.__dict__.get("_float32") is not None for layer in engine.layers]
            assert not any(made), (slots, made)
        finally:
            model.close()


def test_the_rows_benchmark_times_this_plugins_kernels():
    """benchmarks/bench_cpu_rows.py (the figures in the kernels' docstrings) runs and times the plugin's op."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cpu_rows.py"
    result = subprocess.run(
        [sys.executable, str(script), "--rows", "1,5", "--shape", "int4:192x64", "--shape", "int8:100x64"]
        + ["--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    points = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(p["shape"], p["rows"]) for p in points] == [(s, n) for s in ("int4:192x64", "int8:100x64") for n in (1, 5)]
    assert all(p["op"].startswith(PLUGIN) and p["us_per_call"] > 0 for p in points)
    assert [p["per_row_vs_one_row"] for p in points][::2] == [1.0, 1.0]


def test_the_attention_benchmark_times_this_plugins_kernel():
    """benchmarks/bench_cpu_attention.py runs every (heads, rows, position) case through the plugin's op."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cpu_attention.py"
    args = ["--heads", "4/2x16", "--rows", "1,3", "--positions", "2,9", "--rounds", "1", "--calls", "1"]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    points = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(p["rows"], p["position"]) for p in points] == [(1, 2), (1, 9), (3, 2), (3, 9)]
    assert all(p["op"].startswith(PLUGIN) and p["us_per_call"] > 0 for p in points)


def test_scaled_rows_dot_at_the_extremes_and_with_either_scale_type():
    """The intrinsic behind the int8 GEMV, for one row of x and a tile of them: every lane at its most negative
    code times the most negative int16 (the largest pair sums there are), random rows, groups of 16 and 32,
    float16 scales (as int16 bits, looked up) and float32 ones, all against float64 sums; a tile reaching past the
    output's rows writes none of them."""
    from numba import njit
    from perfx_numba_cpu import kernels
    from perfx_numba_cpu.kernels import TILE, f16_table

    @njit
    def dots(q, scales, f16, xq, xs, lanes, out):
        n = out.shape[0]
        if lanes == 16:
            kernels.dot16_tile(q, scales, f16, xq, xs, 0, out, 1)  # rows 0 .. TILE - 1 into column 1
            kernels.dot16_row(q, scales, f16, xq, xs, n - 1, out, 0)  # the last row into column 0
        else:
            kernels.dot32_tile(q, scales, f16, xq, xs, 0, out, 1)
            kernels.dot32_row(q, scales, f16, xq, xs, n - 1, out, 0)

    rng = np.random.default_rng(0)
    table = f16_table()
    n = TILE - 1  # the tile's last row is past the output
    for lanes in (16, 32):
        rows = [
            (np.full(4 * lanes, -128, np.int8), np.full((TILE, 4 * lanes), -32768, np.int16)),
            (
                rng.integers(-128, 128, 5 * lanes, dtype=np.int8),
                rng.integers(-32768, 32768, (TILE, 5 * lanes), dtype=np.int16),
            ),
        ]
        for q, xq in rows:
            groups = len(q) // lanes
            scale16 = rng.uniform(0.5, 2, groups).astype(np.float16)
            xs = rng.uniform(1e-5, 1e-4, (TILE, groups)).astype(np.float32)
            sums = (q.astype(np.int64) * xq).reshape(TILE, groups, lanes).sum(axis=2)
            want = (sums * scale16.astype(np.float64) * xs.astype(np.float64)).sum(axis=1)
            for scales in (scale16.view(np.int16), scale16.astype(np.float32)):
                out = np.full((n, 2), np.nan, np.float32)
                dots(q, scales, table, xq, xs, lanes, out)
                np.testing.assert_allclose(out[:, 1], want[:n], rtol=1e-6, err_msg=f"{lanes} {scales.dtype}")
                assert out[n - 1, 0] == pytest.approx(want[n - 1], rel=1e-6)
                assert np.isnan(out[: n - 1, 0]).all()


def test_int16_rounding_of_x_keeps_tiny_and_non_finite_pieces_safe():
    """A piece of x far below float32's normal range is taken as zero (its reciprocal scale would overflow), and a
    piece with an infinity or NaN is refused, so that the float kernel propagates it."""
    from perfx_numba_cpu.kernels import quantize_x_int16

    x = np.ones((1, 64), np.float32)
    x[0, :32] = 1e-36
    xq, xs = np.empty((1, 64), np.int16), np.empty((1, 2), np.float32)
    assert quantize_x_int16(x, 32, xq, xs)
    assert np.all(xq[0, :32] == 0) and xs[0, 0] == 0
    assert np.all(xq[0, 32:] == 32767) and xs[0, 1] == np.float32(1.0) / np.float32(32767.0)
    for bad in (np.inf, np.nan):
        x[0, 40] = bad
        assert not quantize_x_int16(x, 32, xq, xs)


def test_int4_pairs_dot_is_exact_at_the_extremes():
    """The int4 pairs intrinsic against int64 sums: every code 15 and every x -32768 over a 128-column group (the
    largest sum there is), then random codes and x, for one row of x and a tile of them."""
    from numba import njit
    from perfx_numba_cpu.kernels import ROWS, TILE, pairs_dot1, pairs_dot_tile

    @njit
    def both(codes_b, i0, i1, xq, j0, tile, dots):
        if tile == 1:
            pairs_dot1(codes_b, i0, i1, xq, j0, dots)
        else:
            pairs_dot_tile(codes_b, i0, i1, xq, j0, dots)

    rng = np.random.default_rng(4)
    half = 3 * 64  # three groups of 128 columns
    cases = [
        (np.full((half, ROWS), 0xFF, np.uint8), np.full((TILE + 1, 2 * half), -32768, np.int16)),
        (
            rng.integers(0, 256, (half, ROWS), dtype=np.uint8),
            rng.integers(-32768, 32768, (TILE + 1, 2 * half), dtype=np.int16),
        ),
    ]
    for codes_b, x16 in cases:
        lo, hi = (codes_b & 15).astype(np.int64), (codes_b >> 4).astype(np.int64)
        for tile, j0 in ((1, 0), (1, TILE), (TILE, 1)):
            for i0, i1 in ((0, 64), (64, 192)):
                x = x16[j0 : j0 + tile].astype(np.int64)
                want = x[:, 2 * i0 : 2 * i1 : 2] @ lo[i0:i1] + x[:, 2 * i0 + 1 : 2 * i1 : 2] @ hi[i0:i1]
                dots = np.zeros((tile, ROWS), np.int32)
                both(codes_b, i0, i1, x16.view(np.int32), j0, tile, dots)
                np.testing.assert_array_equal(dots, want)


def test_int4_ops_propagate_non_finite_x(plugin_env):
    """A row of x holding an infinity or NaN gives NaN or infinite outputs in that row (the int16 rounding refuses
    it and the float path runs), and the other rows stay right."""
    rng = np.random.default_rng(5)
    f, k = 128, 128
    weight = Int4Weight(
        rng.integers(0, 256, (2 * f, k // 2), dtype=np.uint8),
        rng.uniform(0.01, 0.05, (2 * f, k // 32)).astype(np.float16),
        rng.normal(0.0, 0.1, (2 * f, k // 32)).astype(np.float32),
        32,
    )
    rt = get_registry(refresh=True).open_runtime("numpy")
    w = rt.prepare_weight(weight)
    dense = w.float32().astype(np.float64)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[1, 7] = bad
        full = np.empty((3, 2 * f), np.float32)
        rt.ops.linear(x, w, full)
        assert not np.isfinite(full[1]).any()
        np.testing.assert_allclose(full[[0, 2]], x[[0, 2]] @ dense.T, rtol=1e-4, atol=1e-4)
        out = np.empty((3, f), np.float32)
        rt.ops.gate_up_silu(x, w, out)
        assert not np.isfinite(out[1]).all() and np.isfinite(out[[0, 2]]).all()
        residual = np.zeros((3, 2 * f), np.float32)
        normed = np.empty((3, 2 * f), np.float32)
        rt.ops.linear_add_rmsnorm(x, w, residual, np.ones(2 * f, np.float32), 1e-5, normed)
        assert not np.isfinite(residual[1]).any() and np.isfinite(residual[[0, 2]]).all()


def test_gelu_mul_against_float64_across_the_range():
    """GeGLU's gelu_tanh(g) * u from g / (1 + exp(-2 u')), against the tanh formula in float64, from g = -30 (where
    exp saturates and the exact value is below 1e-22) to 30, zeros and a NaN included."""
    from perfx_numba_cpu.kernels import gelu_mul, gelu_mul_serial

    g = np.concatenate([np.linspace(-30, 30, 1001), [0.0, -0.0, np.nan]]).astype(np.float32)
    u = np.linspace(-2, 3, g.size).astype(np.float32)
    g64 = g.astype(np.float64)
    want = 0.5 * g64 * (1 + np.tanh(0.7978845608028654 * (g64 + 0.044715 * g64**3))) * u
    for kernel in (gelu_mul, gelu_mul_serial):
        out = np.empty((1, g.size), np.float32)
        kernel(np.concatenate([g, u])[None, :], out)
        np.testing.assert_allclose(out[0, :-1], want[:-1], rtol=2e-6, atol=1e-6)
        assert np.isnan(out[0, -1])
