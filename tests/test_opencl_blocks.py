"""GGUF Q4_0/Q4_1/Q4_K weights reach the OpenCL device as the file's bytes and are re-packed there (load time): the
device copy must equal, bit for bit, the one made from the host's conversion. (tests/test_opencl.py runs models
loaded this way against the NumPy backend: SmolLM2's Q4_1 file, and a Q4_0 one whose biases are derived.)"""

from __future__ import annotations

import numpy as np
import pytest
from backend_availability import open_runtime_or_skip
from tiny_gguf import write_tiny_llama_gguf

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")

from perfx_core.gguf_loader import load_llama_gguf  # noqa: E402
from perfx_core.weights import BlockWeight, Int4Weight, concat_rows  # noqa: E402


@pytest.fixture(scope="module")
def runtime():
    rt = open_runtime_or_skip("opencl")
    yield rt
    rt.close()


def _device_arrays(rt, handle) -> list[np.ndarray | None]:
    return [None if t is None else rt.to_numpy(t) for t in (handle.packed, handle.scale, handle.bias)]


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q4_K"])
def test_file_blocks_repacked_on_the_device_equal_the_host_conversion(tmp_path, runtime, tensor_type):
    dim, ffn = (256, 512) if tensor_type == "Q4_K" else (128, 256)  # K-quant rows are whole 256-blocks
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, dim=dim, ffn_dim=ffn, seed=5).path
    assert runtime.block_formats >= {"q4_0", "q4_1", "q4_k"}
    _, kept, _ = load_llama_gguf(path, keep_blocks=runtime.block_formats)
    _, host, _ = load_llama_gguf(path)
    layer_kept, layer_host = kept.layers[1], host.layers[1]
    pairs = [
        (
            concat_rows([layer_kept.wq, layer_kept.wk, layer_kept.wv]),
            concat_rows([layer_host.wq, layer_host.wk, layer_host.wv]),
        ),
        (layer_kept.w_down, layer_host.w_down),
        (kept.token_embedding, host.token_embedding),
    ]
    for blocks, int4 in pairs:
        assert isinstance(blocks, BlockWeight) and blocks.block_format == tensor_type.lower()
        assert isinstance(int4, Int4Weight) and blocks.shape == int4.shape
        kept_handle, int4_handle = runtime.prepare_weight(blocks), runtime.prepare_weight(int4)
        got, want = _device_arrays(runtime, kept_handle), _device_arrays(runtime, int4_handle)
        # device bytes: 0.5 per weight of codes, 2 per 32 of scale (Q4_K: sc and m), 4 per 32 of bias (Q4_0: none;
        # Q4_K: 4 per 256 of d and dmin), the host conversion's as the file's (it carries Q4_K's factors too)
        weights = int4.shape[0] * int4.shape[1]
        per_group = {"Q4_0": 2, "Q4_1": 6, "Q4_K": 2}[tensor_type]
        expected = weights // 2 + weights // 32 * per_group + (weights // 256 * 4 if tensor_type == "Q4_K" else 0)
        assert runtime.weight_bytes(kept_handle) == expected
        assert runtime.weight_bytes(int4_handle) == (
            expected if tensor_type == "Q4_K" else weights // 2 + weights // 32 * 6
        )
        assert kept_handle.k_factors == int4_handle.k_factors == (tensor_type == "Q4_K")
        for g, w in zip(got[:2], want[:2], strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
        if tensor_type == "Q4_0":  # no biases kept: the kernels derive them, -8 * scale, which is what they are
            assert got[2] is None
            np.testing.assert_array_equal(want[2], want[1].astype(np.float32) * np.float32(-8))
        else:
            np.testing.assert_array_equal(got[2], want[2])
        # and the host fallback of a kept weight is the host conversion itself
        fallback = blocks.as_int4()
        for a, b in zip((fallback.packed, fallback.bias), (int4.packed, int4.bias), strict=True):
            np.testing.assert_array_equal(a, b)
        if tensor_type == "Q4_K":
            for a, b in zip(fallback.k_scales.arrays, int4.k_scales.arrays, strict=True):
                np.testing.assert_array_equal(a, b)


def test_weights_prepared_together_share_buffers_and_compute_as_alone():
    """prepare_weights puts a layer's int4 arrays in one buffer, at offsets the kernels add (INT4_WEIGHT_PARAMS),
    its size rounded up to 2 MiB; later weights' arrays go where they fit in what it left. Matmuls and embedding
    rows read through those offsets must equal the float computation."""
    rng = np.random.default_rng(3)

    def int4(m, k, group=32):
        return Int4Weight(
            rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
            (rng.standard_normal((m, k // group)) * 0.05).astype(np.float16),
            (rng.standard_normal((m, k // group)) * 0.05).astype(np.float32),
            group,
        )

    big = int4(2048, 1024)  # 1.375 MiB of arrays: a buffer of 2 MiB
    small = [int4(64, 128), int4(96, 128)]
    runtime = open_runtime_or_skip("opencl")  # its own: no earlier test's buffers with room left
    try:
        _check_shared_weights(runtime, rng, big, small)
    finally:
        runtime.close()


def _check_shared_weights(runtime, rng, big, small):
    from perfx_core.weights import dequantize

    (h_big,) = runtime.prepare_weights([big])
    h_small = runtime.prepare_weights(small)
    arrays = [(h.packed, h.scale, h.bias) for h in (h_big, *h_small)]
    shared = arrays[0][0].alloc
    assert shared.nbytes == 2 << 20
    assert all(t.alloc is shared for parts in arrays for t in parts)  # the small ones in the first one's slack
    offsets = sorted(t.offset * t.dtype.itemsize for parts in arrays for t in parts)
    assert offsets[0] == 0 and len(set(offsets)) == len(offsets)
    for w, h in zip((big, *small), (h_big, *h_small), strict=True):
        m, k = w.shape
        np.testing.assert_array_equal(runtime.to_numpy(h.packed), w.packed.reshape(m, k // 32, 16).transpose(1, 0, 2))
        np.testing.assert_array_equal(runtime.to_numpy(h.scale), w.scale.T)
        want_w = dequantize(w)
        for n in (1, 3, 80):  # the GEMV, its passes and the tiled GEMM
            x = rng.standard_normal((n, k)).astype(np.float32)
            out = runtime.empty((n, m))
            runtime.ops.linear(runtime.from_numpy(x), h, out)
            got, want = runtime.to_numpy(out), x @ want_w.T
            assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
        ids = np.array([0, m - 1, m // 2])
        rows = runtime.empty((len(ids), k))
        runtime.ops.embedding(h, ids, rows)
        np.testing.assert_allclose(runtime.to_numpy(rows), want_w[ids], rtol=1e-6, atol=1e-6)
