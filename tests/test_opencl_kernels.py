"""OpenCL kernel variants against the conformance kit and float64: quantized-activation GEMV, tiled int4 GEMM,
the matrix-unit kernel, fused tails, prefill and decode attention however they are tiled or split, shape overrides."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
from opencl_support import PROMPT, opencl_usable

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")


import perfx_core  # noqa: E402
from perfx_core.testing import assert_backend_conforms  # noqa: E402

pytestmark = opencl_usable


@pytest.mark.parametrize(
    "variable, value, parse",
    [("PERFX_OPENCL_GEMV", "RW=32,UC=0", "gemv_overrides"), ("PERFX_OPENCL_MMA_SHAPE", "MT=3", "mma_overrides")],
)
def test_bad_kernel_shape_override_is_a_clear_error(registry, monkeypatch, variable, value, parse):
    from perfx_opencl import ops

    from perfx_core.errors import InvalidArgumentError

    monkeypatch.setenv(variable, value)
    getattr(ops, parse).cache_clear()
    try:
        with pytest.raises(InvalidArgumentError, match=variable):
            getattr(ops, parse)()
    finally:
        monkeypatch.delenv(variable)
        getattr(ops, parse).cache_clear()


def test_gemv_norm_tails_conform_where_forced_on_pocl(registry, monkeypatch):
    """The GEMV kernels that finish linear_add_rmsnorm themselves (add_norm_tail.cl), off by default on PoCL
    (rt.norm_tails: their first launches cost PoCL 12-63 s of code generation each), forced on: one launch per
    call, twice in a row (the tail's counters are back at zero after a launch), and the kit's int4 cases of each
    tail (one token and several, the post-norm) conform; tests/test_opencl_int8.py forces the int8 ones."""
    from perfx_core import conformance

    rt = registry.open_runtime("opencl")
    try:
        assert rt.fused_tails and not rt.norm_tails  # PoCL's default
    finally:
        rt.close()
    monkeypatch.setenv("PERFX_OPENCL_FUSED_TAILS", "1")
    rt = registry.open_runtime("opencl")
    try:
        assert rt.norm_tails
        for op, n, desc, post in [
            ("linear_add_rmsnorm", 1, ("int4", 129, 128, 32, "rtn"), False),
            ("linear_add_rmsnorm", 3, ("int4", 4097, 64, 64, "random"), False),
            ("linear_post_norm_add_rmsnorm", 1, ("int4", 640, 128, 32, "rtn"), True),
        ]:
            case = conformance._linear_norm_case(n, desc, 1e-5, post)
            for seed in (0, 1):
                before = rt.launch_count
                result = conformance._run_case(rt, op, *case, seed=seed)
                assert result.passed, result
                assert rt.launch_count - before == 1
    finally:
        rt.close()


def test_without_fused_tails_the_ops_use_separate_launches(registry, monkeypatch):
    """Devices where the last-work-group kernels are not known to be safe run add+RMSNorm and the attention
    merge as launches of their own; the results are the same (the conformance kit)."""
    monkeypatch.setenv("PERFX_OPENCL_FUSED_TAILS", "0")
    rt = registry.open_runtime("opencl")
    try:
        assert rt.fused_tails is False
    finally:
        rt.close()
    assert_backend_conforms("opencl", ops=["linear_add_rmsnorm", "attention_decode"])


# -- quantized activations (QX): integer dot products ----------------------------------------------------------


def _float64_matmul(x: np.ndarray, weight, silu: bool = False) -> np.ndarray:
    """x @ W.T against the dequantized int4 weight in float64; with ``silu`` W is [W_gate; W_up] and the result
    silu(gate) * up, as the gate_up_silu op computes it."""
    from perfx_core import reference

    return reference.gate_up_silu(x, weight) if silu else reference.matmul(x, weight)


@pytest.fixture
def quantized_gemv(monkeypatch):
    """Every int4 GEMV with QX=1 (on by default only where dp4a is native; PoCL runs the portable dot)."""
    from perfx_opencl import ops

    monkeypatch.setenv("PERFX_OPENCL_GEMV", "QX=1")
    ops.gemv_overrides.cache_clear()
    yield
    monkeypatch.delenv("PERFX_OPENCL_GEMV")
    ops.gemv_overrides.cache_clear()


def test_quantized_activation_gemv_conforms(registry, quantized_gemv):
    assert_backend_conforms("opencl", ops=["int4_gemv", "int4_gemm", "gate_up_silu", "linear_add_rmsnorm"])


@contextlib.contextmanager
def _gemv_runtime(registry, weight, x, local_bytes=None):
    """(runtime, weight on it, x on it) for the GEMV tests; ``local_bytes`` caps the local memory the kernels plan
    with (x then quantized in slices). The runtime is closed after the block."""
    rt = registry.open_runtime("opencl")
    try:
        if local_bytes:
            rt.device.details["local_memory_bytes"] = local_bytes
        yield rt, rt.prepare_weight(weight), rt.from_numpy(x)
    finally:
        rt.close()


def _forced_gemv(rt, xs, w, shape, silu, config):
    """x @ W.T (or gate|up's silu(gate) * up) through the GEMV in the shape ``config`` over the defaults, as numpy."""
    from perfx_opencl import ops

    with ops.forced_gemv_tuning(rt, {**ops.GEMV_TUNING, **config}):
        out = rt.empty(shape)
        (ops.gate_up_silu if silu else ops.int4_gemm)(rt, xs, w, out)
        return rt.to_numpy(out)


@pytest.mark.parametrize("n, silu, local_bytes", [(1, False, None), (3, True, None), (16, False, 8192)])
def test_quantized_activation_gemv_matches_float(registry, n, silu, local_bytes):
    """QX=1 against the dequantized weights in float64, next to QX=0: 16-bit activations keep the error near
    float rounding, an outlier column included; with little local memory x is staged in slices."""
    from perfx_core.synthetic import random_int4

    rng = np.random.default_rng(n)
    m, k = 96, 4096
    weight = random_int4(2 * m if silu else m, k, 128, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, 7] = 60.0
    want = _float64_matmul(x, weight, silu)
    with _gemv_runtime(registry, weight, x, local_bytes) as (rt, w, xs):
        errors = {}
        for qx in (0, 1):
            got = _forced_gemv(rt, xs, w, (n, m), silu, {"RW": 16, "KS": 4, "CR": 2, "QX": qx})
            errors[qx] = float(((got - want) ** 2).sum() / (want**2).sum())
        assert errors[0] < 1e-10 and errors[1] < 1e-7, errors
        slices = {dict(key[2]).get("QX_SLICE") for key in rt._kernels if key[1] == "int4_gemv"} - {False}
        if local_bytes:  # x staged 2 chunks at a time (the 128 chunks of x do not fit)
            assert slices == {2}
        else:
            assert slices and all(1 <= size <= k // 32 for size in slices)


@pytest.mark.parametrize("silu", [False, True])
def test_tuner_single_token_shapes_with_few_row_lanes_compute_the_gemv(registry, silu):
    """The tuner's single-token grid has 8 and 16 row lanes and four chunks in flight: such shapes (taken from
    its candidate list, quantized activations and float) give the float64 GEMV, rows past the matrix included."""
    from perfx_opencl import tuner

    from perfx_core.synthetic import random_int4

    rng = np.random.default_rng(11)
    m, k = 72, 1280  # 72 rows: the last work-group is partial for every RW x CR below
    weight = random_int4(2 * m if silu else m, k, 128, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    want = _float64_matmul(x, weight, silu)
    grid = tuner.candidates(1, quantized=True) + tuner.candidates(1, quantized=False)
    picked = [
        c
        for c in grid
        if (c["RW"], c["KS"], c["CR"], c["UC"]) in {(8, 16, 4, 1), (8, 32, 1, 4), (16, 16, 2, 4), (16, 32, 4, 2)}
    ]
    assert len(picked) == 8  # each shape in both kernels (QX 1 where the device has integer dot products)
    with _gemv_runtime(registry, weight, x) as (rt, w, xs):
        for config in picked:
            got = _forced_gemv(rt, xs, w, (1, m), silu, config)
            assert ((got - want) ** 2).sum() / (want**2).sum() < 1e-7, config


@pytest.mark.parametrize("tpt", ["4", "8"])
def test_int4_gemm_tiles_cover_every_token_and_row(registry, monkeypatch, tpt):
    """n > 16 runs the tiled GEMM: several token tiles, a partial last tile of tokens and of rows, g32."""
    from perfx_opencl import ops

    from perfx_core.synthetic import random_int4

    monkeypatch.setenv("PERFX_OPENCL_GEMM_TPT", tpt)
    rng = np.random.default_rng(int(tpt))
    weight = random_int4(300, 256, 32, rng)
    x = rng.standard_normal((200, 256)).astype(np.float32)
    want = _float64_matmul(x, weight)
    rt = registry.open_runtime("opencl")
    try:
        out = rt.empty((200, 300))
        ops.int4_gemm(rt, rt.from_numpy(x), rt.prepare_weight(weight), out)
        np.testing.assert_allclose(rt.to_numpy(out), want, rtol=1e-4, atol=1e-3)
    finally:
        rt.close()


# -- matrix-unit int4 kernel (kernels/int4_mma.cl) -------------------------------------------------------------


@pytest.fixture
def matrix_units(monkeypatch):
    """Int4 matmuls of 2+ tokens and int8 ones past 64 on the mma kernels (native on NVIDIA; their portable
    emulation on PoCL), int6 and Q5_0 ones expanded to int8 first."""
    monkeypatch.setenv("PERFX_OPENCL_MMA", "1")


def test_matrix_unit_kernel_conforms(registry, matrix_units):
    assert_backend_conforms(
        "opencl", ops=["int4_gemm", "gate_up_silu", "linear_add_rmsnorm", "int8_gemm", "int5_gemm", "int6_gemm"]
    )


@pytest.mark.parametrize(
    "n, silu, group, k, shape",
    [
        (2, False, 128, 512, ""),  # one token tile, mostly empty
        (16, True, 32, 256, ""),  # gate|up with SiLU, scales changing every chunk
        (70, False, 64, 384, ""),  # several token tiles, a partial last one; 12 chunks over 2 warps
        (13, False, 32, 96, "KW=8"),  # 3 chunks: KW falls back to a divisor (1)
        (40, True, 128, 1024, "MT=1,NT8=1,KW=16"),
        (21, False, 32, 768, ""),  # three token tiles (17-24 tokens), the last one partial
        # Chunks loaded ahead (UC): 18 chunks per warp, so runs of 4 with single chunks after (warp 0) or before
        # (warp 1) them; groups of 64 columns cap UC at 2. PoCL's emulation runs UC = 1: these check UC > 1 where
        # it is native.
        (24, False, 128, 1152, "KW=2,UC=4"),
        (6, True, 64, 640, "UC=4"),
    ],
)
def test_matrix_unit_kernel_matches_float(registry, monkeypatch, matrix_units, n, silu, group, k, shape):
    """Half-precision inputs with float accumulation against float64: error at half rounding (~1e-7), over
    partial row and token tiles, an x view that is not 16-byte aligned, and forced shapes."""
    from perfx_opencl import ops

    from perfx_core.synthetic import random_int4

    monkeypatch.setenv("PERFX_OPENCL_MMA_SHAPE", shape)
    ops.mma_overrides.cache_clear()
    rng = np.random.default_rng(n)
    m = 72  # not a multiple of 16 rows per tile
    weight = random_int4(2 * m if silu else m, k, group, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = _float64_matmul(x, weight, silu)
    rt = registry.open_runtime("opencl")
    try:
        assert rt.use_mma
        padded = rt.from_numpy(np.concatenate([np.zeros(1, np.float32), x.ravel()]))
        xs = rt.view(padded, 1, (n, k))  # offset 1: the kernel's unaligned loads
        out = rt.empty((n, m))
        (ops.gate_up_silu if silu else ops.int4_gemm)(rt, xs, rt.prepare_weight(weight), out)
        got = rt.to_numpy(out)
        assert float(((got - want) ** 2).sum() / (want**2).sum()) < 1e-6
        built = [dict(key[2]) for key in rt._kernels if key[1] == "int4_mma"]
        assert built and all(b["X_UNALIGNED"] for b in built)
        if "UC=4" in shape:  # built as asked where native (capped at the group's chunks), else the emulation's 1
            assert all(b["UC"] == (min(4, group // 32) if rt.native_mma else 1) for b in built)
        if shape == "KW=8":
            assert built[0]["KW"] == 1
        if not shape:  # the default rule's token tiles: 1 up to 8 tokens, 2 up to 16, 3 up to 24, then 4
            assert built[0]["NT8"] == min(4, -(-n // 8))
    finally:
        rt.close()
        monkeypatch.delenv("PERFX_OPENCL_MMA_SHAPE")
        ops.mma_overrides.cache_clear()


@pytest.mark.parametrize("n", [3, 16, 17, 32, 33])
def test_linear_add_rmsnorm_on_matrix_units_is_one_launch(registry, monkeypatch, matrix_units, n):
    """Up to MMA_ADD_NORM_N (32) tokens the mma kernel adds the residual and norms it itself (add_norm_tail.cl;
    beyond 16 tokens in two groups of work-groups): the reference's residual and normed rows, twice in a row
    (its counters are set back to zero for the next launch), without an add_rmsnorm kernel; beyond 32, or with
    PERFX_OPENCL_NORM_FINISHERS=0, the two launches."""
    from perfx_opencl import ops

    from perfx_core import reference
    from perfx_core.synthetic import random_int4

    monkeypatch.setenv("PERFX_OPENCL_FUSED_TAILS", "1")  # the norm tails are off on PoCL by default (rt.norm_tails)
    rng = np.random.default_rng(n)
    m, k, eps = 72, 256, 1e-5  # 72 rows: a partial row tile
    weight = random_int4(m, k, 32, rng)
    norm_weight = (1.0 + 0.3 * rng.standard_normal(m)).astype(np.float32)
    for finishers_cap in (None, "0"):
        if finishers_cap is not None:
            monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", finishers_cap)
        ops._norm_finishers_cap.cache_clear()
        rt = registry.open_runtime("opencl")
        try:
            w, residual = rt.prepare_weight(weight), rng.standard_normal((n, m)).astype(np.float32)
            residual_buffer, out = rt.from_numpy(residual), rt.empty((n, m))
            fused = finishers_cap is None and n <= ops.MMA_ADD_NORM_N
            for _ in range(2):
                x, norm = rng.standard_normal((n, k)).astype(np.float32), rt.from_numpy(norm_weight)
                x_buffer, launches = rt.from_numpy(x), rt.launch_count
                ops.linear_add_rmsnorm(rt, x_buffer, w, residual_buffer, norm, eps, out)
                assert rt.launch_count - launches == (1 if fused else 2)
                residual, normed = reference.linear_add_rmsnorm(x, weight, residual, norm_weight, eps)
                np.testing.assert_allclose(rt.to_numpy(residual_buffer), residual, rtol=1e-3, atol=1e-3)
                np.testing.assert_allclose(rt.to_numpy(out), normed, rtol=1e-3, atol=1e-3)
            built = {(key[1], dict(key[2]).get("ADD_NORM")) for key in rt._kernels}
            assert (("int4_mma", True) in built) == fused
            assert (("add_rmsnorm", None) in built) == (not fused)
            tiles = {dict(key[2])["NT8"] for key in rt._kernels if dict(key[2]).get("ADD_NORM")}
            assert tiles == (set() if not fused else {1} if n <= 8 else {2})  # 17-32: the 16-token shape
        finally:
            rt.close()
            ops._norm_finishers_cap.cache_clear()


def test_tail_finishers_rule(monkeypatch):
    """How many work-groups finish a launch's add + RMSNorm: one per token where a launch's work-groups run side
    by side, at most one per group and half the compute units, capped by PERFX_OPENCL_NORM_FINISHERS; else the
    last work-group alone. A cap that is not a whole number is refused."""
    from types import SimpleNamespace

    from perfx_opencl import ops

    from perfx_core.errors import InvalidArgumentError

    def finishers(n: int, groups: int, concurrent: bool = True) -> int:
        rt = SimpleNamespace(concurrent_groups=concurrent, device=SimpleNamespace(details={"compute_units": 132}))
        return ops._tail_finishers(rt, n, groups)

    try:
        monkeypatch.delenv("PERFX_OPENCL_NORM_FINISHERS", raising=False)
        ops._norm_finishers_cap.cache_clear()
        assert [finishers(16, 128), finishers(16, 8), finishers(200, 1000), finishers(16, 128, False)] == [16, 8, 66, 1]
        monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", "4")
        ops._norm_finishers_cap.cache_clear()
        assert [finishers(16, 128), finishers(2, 128), finishers(16, 128, False)] == [4, 2, 1]
        for bad in ("x", "-1", "\u00b2"):  # the last: a superscript two, which str.isdigit accepts
            monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", bad)
            ops._norm_finishers_cap.cache_clear()
            with pytest.raises(InvalidArgumentError, match="PERFX_OPENCL_NORM_FINISHERS"):
                finishers(16, 128)
    finally:
        ops._norm_finishers_cap.cache_clear()


def test_matrix_unit_shape_loads_chunks_ahead_within_a_group(registry, monkeypatch):
    """The mma shape rule's UC (chunks loaded ahead): 4 where a warp holds two row tiles of sums and one, three or
    four token tiles, 1 with two token tiles or four row tiles, never more than a group's chunks, an override capped
    the same way, and always 1 in the portable emulation (its barriers)."""
    from perfx_opencl import ops

    rt = registry.open_runtime("opencl")
    try:
        ops.mma_overrides.cache_clear()
        monkeypatch.delenv("PERFX_OPENCL_MMA_SHAPE", raising=False)
        # No kernel is built here: the rule is read as on a device without and with mma.sync.
        rt.__dict__["native_mma"] = False  # the emulation
        assert ops._mma_config(rt, 8, 4096, 4096, 128)["UC"] == 1
        rt.__dict__["native_mma"] = True
        uc = {(n, m, group, silu): ops._mma_config(rt, n, m, 4096, group, silu)["UC"] for n, m, group, silu in [
            (4, 4096, 128, False), (12, 4096, 128, False), (24, 4096, 128, False), (40, 4096, 128, False),
            (32, 4096, 128, False),
            (24, 11008, 128, True), (4, 11008, 128, True), (4, 4096, 32, False), (24, 4096, 64, False),
        ]}  # fmt: skip
        assert uc == {
            (4, 4096, 128, False): 4, (12, 4096, 128, False): 1, (24, 4096, 128, False): 4,
            (40, 4096, 128, False): 1, (32, 4096, 128, False): 4, (24, 11008, 128, True): 1, (4, 11008, 128, True): 4,
            (4, 4096, 32, False): 1, (24, 4096, 64, False): 2,
        }  # fmt: skip
        monkeypatch.setenv("PERFX_OPENCL_MMA_SHAPE", "UC=8")
        ops.mma_overrides.cache_clear()
        assert ops._mma_config(rt, 12, 4096, 4096, 128)["UC"] == 4
    finally:
        ops.mma_overrides.cache_clear()
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("variable, value", [("PERFX_OPENCL_GEMV", "QX=1"), ("PERFX_OPENCL_MMA", "1")])
def test_smollm2_with_a_forced_kernel_matches_numpy(registry, smollm2, monkeypatch, variable, value):
    """The quantized-activation GEMV (decode) or the mma kernel (prompts, and the logits check's ~32 tokens),
    forced where they are not the default: the same greedy tokens as NumPy and logits NMSE < 1e-4."""
    from perfx_opencl import ops

    monkeypatch.setenv(variable, value)
    ops.gemv_overrides.cache_clear()
    model = perfx_core.load(backend="opencl", context_length=128)
    try:
        ours = model.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        ours.run()
        ref = smollm2.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        ref.run()
        assert ours.token_ids == ref.token_ids, (ours.text, ref.text)
        ids = model.tokenizer.encode(PROMPT, add_special=True) + ref.token_ids
        got, want = model.logits(ids), smollm2.logits(ids)
        assert float(((got - want) ** 2).sum() / (want**2).sum()) < 1e-4
    finally:
        model.close()
        monkeypatch.delenv(variable)
        ops.gemv_overrides.cache_clear()


def test_tiled_prefill_attention_with_small_tiles_conforms(registry, monkeypatch):
    """Devices with little local memory (or head_dim 256 on 48 KB) run the prefill attention in 8-row tiles,
    also inside the mixed steps' one-launch attention."""
    from perfx_opencl import ops

    tiles = []
    monkeypatch.setattr(ops, "_prefill_tile", lambda rt, hd, beside=0: tiles.append((hd, beside)) or 8)
    assert_backend_conforms("opencl", ops=["attention_prefill", "attention_mixed"])
    assert (256, 0) in tiles and any(beside for _, beside in tiles)


@pytest.mark.parametrize(
    "part, groups_per_cu, score_bytes",
    [(16, 512, 8192), (64, 1, 8192), (16, 1, 256)],
    ids=["many-splits", "fewest-splits", "more-splits-than-a-merge-slice"],
)
def test_decode_attention_conforms_however_the_context_is_split(
    registry, monkeypatch, part, groups_per_cu, score_bytes
):
    """The fused decode kernel cuts each row's context into runs sized by depth and device (ops._decode_plan):
    many short runs (empty trailing ones included, merged by the last work-group), one per MAX_SPLIT, or runs
    so short that the merge takes the splits in several slices of MAX_SPLIT. That last one on attention_decode
    only: the mixed kernel's decode rows merge with the same code (merge_splits), and its variants with tiny
    score buffers cost PoCL ~160 s of code generation."""
    from perfx_opencl import ops

    plans = []
    real_plan = ops._decode_plan

    def plan(*args):
        plans.append(real_plan(*args))
        return plans[-1]

    monkeypatch.setattr(ops, "DECODE_PART", part)
    monkeypatch.setattr(ops, "DECODE_GROUPS_PER_CU", groups_per_cu)
    monkeypatch.setattr(ops, "DECODE_SCORE_BYTES", score_bytes)
    monkeypatch.setattr(ops, "MIXED_DECODE_SCORE_BYTES", min(score_bytes, ops.MIXED_DECODE_SCORE_BYTES))
    monkeypatch.setattr(ops, "_decode_plan", plan)
    assert_backend_conforms("opencl", ops=["attention_decode"] + (["attention_mixed"] if score_bytes >= 1024 else []))
    splits = [p[0] for p in plans if p is not None]
    assert max(splits) > (8 if part == 16 else 1) and min(splits) == 1
    if score_bytes < 1024:
        assert any(p[0] > p[1]["MAX_SPLIT"] for p in plans if p is not None)


def test_decode_splits_follow_depth_and_device(registry):
    """Few splits where the kv heads and rows already fill the device, more at depth, never longer than
    MAX_SPLIT, and the same for every position of one graph-signature bucket."""
    from perfx_opencl import ops

    from perfx_core.backend import AttentionSpec, KVCacheSpec

    rt = registry.open_runtime("opencl")
    try:
        rt.device = dataclasses.replace(rt.device, details={**rt.device.details, "compute_units": 132})
        spec = AttentionSpec(32, 32, 128)
        cache = rt.new_kv_cache(KVCacheSpec(1, 16, 4096, 32, 128, "float16"))

        def splits(positions):
            return ops._decode_plan(rt, cache, np.array(positions), spec, ops.DECODE_SCORE_BYTES)[0]

        assert splits([10]) == 1 and splits([511]) == 8  # one split per DECODE_PART positions at most
        assert splits([2047]) == splits([2000]) == 17  # 4 work-groups per compute unit, 32 kv heads, batch 1
        assert splits([2047] * 16) == 2  # batch 16: the rows fill the device
        assert splits([4095] * 16) == 2  # runs of 2048 positions: MAX_SPLIT at one query head per kv head
        assert ops._decode_plan(rt, cache, np.array([4095]), spec, ops.DECODE_SCORE_BYTES)[1]["MAX_SPLIT"] == 2048
    finally:
        rt.close()


def test_long_prompt_attention_on_matrix_units_conforms(registry, monkeypatch):
    """Prompt chunks beyond the rows the tiled kernel stores itself, with a float16 cache, run flash attention
    on the matrix units (kernels/attention_mma.cl; its emulation here): several key tiles and row blocks, a
    partial last block, a start inside a tile, grouped-query heads, a sliding window shorter than a tile with
    soft-capping and a custom scale, against the float64 reference."""
    from perfx_opencl.runtime import OpenCLRuntime

    from perfx_core import conformance

    monkeypatch.setenv("PERFX_OPENCL_MMA", "1")
    built = []
    kernel = OpenCLRuntime.kernel

    def recording(rt, file, name, **defines):
        built.append(name)
        return kernel(rt, file, name, **defines)

    monkeypatch.setattr(OpenCLRuntime, "kernel", recording)
    rt = registry.open_runtime("opencl")
    try:
        windowed = {"window": 40, "softcap": 8.0, "scale": 0.1}
        for heads, start, t_len, features in [
            ((4, 2, 64), 70, 150, {}),
            ((2, 1, 128), 0, 65, {}),
            ((4, 2, 64), 30, 150, windowed),
        ]:
            case = conformance._attention_case(
                "attention_prefill", heads, "float16", [1], [start], t_len, max_seq=256, **features
            )
            result = conformance._run_case(rt, "attention_prefill", *case, seed=0)
            assert result.passed, result
    finally:
        rt.close()
    assert built.count("attention_prefill_mma") == 3


# -- GGUF Q4_K weights as their own factors (kernels/int4_group.cl, Q4_K_FACTORS) -------------------------------


@pytest.mark.parametrize("n, mma", [(1, "0"), (5, "0"), (80, "0"), (20, "1")])
def test_q4_k_weights_keep_the_files_bytes_and_exact_values(registry, monkeypatch, n, mma):
    """A Q4_K weight's sc, m, d and dmin stay on the device as they are (0.578 bytes per weight, the file's 0.5625
    plus nothing but the layout) and every kernel multiplies them out exactly: the embedding's rows equal the
    float64 values bit for bit, the GEMV (1 token), its batched form (5), the tiled GEMM (80) and the matrix-unit
    kernel (20: half inputs, so half's rounding) stay at float rounding of those values, which scales rounded to
    float16 (2^-12 relative) would miss by orders of magnitude."""
    from perfx_opencl import ops

    from perfx_core import reference
    from perfx_core.synthetic import random_q4_k

    monkeypatch.setenv("PERFX_OPENCL_MMA", mma)
    rng = np.random.default_rng(n)
    m, k = 200, 768
    weight = random_q4_k(m, k, rng)
    values = reference.weight_values(weight)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = x.astype(np.float64) @ values.T
    rounded = x @ reference.dequantize_int4(weight.packed, weight.scale, weight.bias, 32).T  # float16 scales
    assert float(((rounded - want) ** 2).sum() / (want**2).sum()) > 1e-9
    rt = registry.open_runtime("opencl")
    try:
        w = rt.prepare_weight(weight)
        assert w.k_factors and rt.weight_bytes(w) == m * k // 2 + m * (k // 32) * 2 + m * (k // 256) * 4
        out = rt.empty((n, m))
        ops.int4_gemm(rt, rt.from_numpy(x), w, out)
        got = rt.to_numpy(out)
        error = float(((got - want) ** 2).sum() / (want**2).sum())
        assert error < (1e-6 if mma == "1" else 1e-11), error
        assert any(key[1] == "int4_mma" for key in rt._kernels) == (mma == "1")
        ids = rng.integers(0, m, 7).astype(np.int32)
        rows = rt.empty((7, k))
        ops.embedding(rt, w, ids, rows)
        np.testing.assert_array_equal(rt.to_numpy(rows), values[ids].astype(np.float32))
    finally:
        rt.close()
