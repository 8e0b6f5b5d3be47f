"""Int8 weights on the real SmolLM2 file, whose tied embedding / LM head is GGUF Q8_0: it stays int8 codes and
float16 scales (the file's 1.0625 bytes per weight, no float copy on any backend that takes int8), greedy tokens
are those of the float32 weights it replaced, and a backend without int8 ops gets the float32 values."""

from __future__ import annotations

import numpy as np
import pytest
from backend_availability import open_runtime_or_skip
from golden_text import GOLDEN_TEXT
from perfx_numpy import ops as numpy_ops
from perfx_numpy.runtime import NumpyBackend

import perfx_core
from perfx_core.gguf_file import read_gguf
from perfx_core.hookspecs import hookimpl
from perfx_core.ops import PRIMITIVE_OPS
from perfx_core.plugins import register_plugin, unregister_plugin
from perfx_core.testing import isolated_plugins

# Greedy continuation of GOLDEN_TEXT[:300], 40 tokens, with the embedding/LM head loaded as float32 (the NumPy
# backend, and the numba plugin's int8 copy of it): what the int8 weight must still give.
GREEDY = [268, 98, 2706, 288, 260, 5432, 30, 2306, 314, 253, 1942, 8664, 617, 314, 1035, 5649, 563, 260, 2950, 282]
GREEDY += [260, 8612, 30, 2306, 314, 597, 1035, 5649, 563, 260, 2950, 282, 260, 8612, 30, 2306, 314, 1035, 5649, 563]


@pytest.fixture(params=["numpy", "numba-cpu"])
def plugins(request, monkeypatch):
    """The NumPy backend alone, or with the installed plugins (numba-cpu wins the matmuls where installed)."""
    for _ in isolated_plugins(monkeypatch, load="" if request.param == "numpy" else None):
        yield request.param


def greedy(model, n: int) -> list[int]:
    generation = model.generate(GOLDEN_TEXT[:300], max_tokens=n, temperature=0, ignore_eos=True)
    generation.run()
    return generation.token_ids


def test_smollm2_q8_0_embedding_stays_int8_and_decodes_the_same(plugins, smollm2_path):
    model = perfx_core.load(smollm2_path, backend="numpy", context_length=512)
    try:
        engine = model.engine
        if plugins == "numba-cpu" and not engine.rt.ops.sources["int8_gemm"].startswith("numba-cpu:"):
            pytest.skip("perfx-numba-cpu is not installed")
        assert engine.embedding.kind == "int8" and engine.output is engine.embedding  # tied: one handle
        assert greedy(model, len(GREEDY)) == GREEDY
        file_bytes = read_gguf(smollm2_path).tensors["token_embd.weight"].nbytes
        assert engine.rt.weight_bytes(engine.embedding) == file_bytes == 49152 * 576 * 34 // 32
    finally:
        model.close()


class _NoInt8Plugin:
    """The NumPy backend under another name, registering no int8_gemm: a backend that takes no int8 weights."""

    @hookimpl
    def perfx_register_backends(self, register):
        register(type("NoInt8Backend", (NumpyBackend,), {"name": "noint8"})())

    @hookimpl
    def perfx_register_ops(self, register):
        for op in PRIMITIVE_OPS + numpy_ops.FAMILY_OPS:
            register("noint8", op, getattr(numpy_ops, op))


def test_smollm2_on_a_backend_without_int8_ops(monkeypatch, smollm2_path):
    """A backend without int8 ops gets the embedding as the exact float32 values (4 bytes per weight)."""
    for _ in isolated_plugins(monkeypatch, load=""):
        register_plugin(_NoInt8Plugin(), "noint8-test")
        try:
            model = perfx_core.load(smollm2_path, backend="noint8", context_length=512)
            try:
                engine = model.engine
                assert "int8" not in engine.rt.weight_formats
                assert engine.embedding.kind == "dense" and engine.embedding.weight.data.dtype == np.float32
                assert engine.rt.weight_bytes(engine.embedding) == 49152 * 576 * 4
                assert greedy(model, 16) == GREEDY[:16]
            finally:
                model.close()
        finally:
            unregister_plugin("noint8-test")


def test_smollm2_q8_0_embedding_stays_int8_on_opencl(registry, smollm2_path):
    """OpenCL takes int8 weights: the Q8_0 table is int8 codes and float16 scales on the device, the file's bytes."""
    rt = open_runtime_or_skip("opencl")
    assert "int8" in rt.weight_formats
    rt.close()
    model = perfx_core.load(smollm2_path, backend="opencl", context_length=512)
    try:
        engine = model.engine
        assert engine.embedding.kind == "int8" and engine.output is engine.embedding
        assert engine.embedding.codes.dtype == np.int8 and engine.embedding.scale.dtype == np.float16
        file_bytes = read_gguf(smollm2_path).tensors["token_embd.weight"].nbytes
        assert engine.rt.weight_bytes(engine.embedding) == file_bytes == 49152 * 576 * 34 // 32
        assert greedy(model, 16) == GREEDY[:16]
    finally:
        model.close()
