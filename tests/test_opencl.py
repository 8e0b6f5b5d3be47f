"""The OpenCL backends (``opencl``, ``opencl-adreno``): conformance, devices, program builds and their cache, weights
on the device, memory, SmolLM2 end to end against NumPy, ``perfx tune``.

Runs wherever pyopencl finds an OpenCL device that can build kernels (PoCL on a CPU is enough); skips with the
reason otherwise (tests/opencl_support.py). The graph tests are in test_opencl_graphs.py, the kernel variants in
test_opencl_kernels.py: three modules, so that the test workers share PoCL's compile time.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest
from opencl_support import PROMPT, opencl_usable

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")

from perfx_opencl.runtime import KernelBuildError  # noqa: E402

import perfx_core  # noqa: E402
from perfx_core.errors import BackendError  # noqa: E402
from perfx_core.testing import assert_backend_conforms  # noqa: E402

pytestmark = opencl_usable


def _entry_point_installed() -> bool:
    return any(ep.name == "opencl" for ep in importlib.metadata.entry_points(group="perfx"))


@pytest.mark.skipif(not _entry_point_installed(), reason="perfx is not pip-installed with the opencl entry point")
def test_perfx_backends_lists_both_opencl_backends(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "perfx_core", "backends", "--ops"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\nopencl  (" in out and "\nopencl-adreno  (" in out
    assert "device 0:" in out.split("\nopencl  (")[1]
    assert "opencl:int4_gemv" in out


@pytest.mark.parametrize("backend", ["opencl", "opencl-adreno"])
def test_backend_conforms(registry, backend):
    assert_backend_conforms(backend)


def test_adreno_backend_can_be_forced_on_any_device(registry):
    rt = registry.open_runtime("opencl-adreno")
    try:
        assert rt.backend_name == "opencl-adreno" and rt.variant == "adreno"
        assert rt.use_images == bool(rt.cl_device.image_support)
    finally:
        rt.close()


def test_device_by_name_and_index(registry):
    backend = registry.get_backend("opencl")
    devices = backend.devices()
    assert devices and all(d.kind in ("cpu", "gpu") and d.memory_bytes > 0 for d in devices)
    rt = backend.open(devices[0].name[:8])
    assert rt.device.name == devices[0].name
    rt.close()
    with pytest.raises(BackendError, match="devices 0.."):
        backend.open(len(devices) + 5)
    with pytest.raises(BackendError, match="no opencl device matches"):
        backend.open("no-such-device-name")


def test_kernel_build_failure_raises_backend_error_with_log(registry):
    rt = registry.open_runtime("opencl")
    try:
        with pytest.raises(BackendError) as info:
            rt.build("__kernel void broken(__global float* x) { x[0] = undeclared_name; }", label="broken.cl")
        assert isinstance(info.value, KernelBuildError)
        assert "broken.cl" in str(info.value) and "undeclared_name" in info.value.log
    finally:
        rt.close()


def test_built_programs_are_cached_on_disk_and_a_bad_entry_is_rebuilt(registry, tmp_path, monkeypatch):
    from perfx_opencl import program_cache

    source = f"__kernel void twice(__global float* x) {{ x[get_global_id(0)] *= 2.0f; }} // {tmp_path}\n"
    rt = registry.open_runtime("opencl")
    try:
        path = program_cache.entry_path(rt, source, ("-DX=1",))
        assert not path.exists() and str(path).startswith(str(tmp_path))  # conftest: PERFX_CACHE_DIR in tmp_path
        rt.build(source, ("-DX=1",), label="twice.cl")
        assert path.stat().st_size > 0 and rt.load_stats["programs_built"] >= 1

        def run_from_a_new_process_state(expect_cached: bool) -> None:
            rt._state.programs.clear()  # as a new process would start
            hits = rt.load_stats["programs_from_cache"]
            program = rt.build(source, ("-DX=1",), label="twice.cl")
            assert rt.load_stats["programs_from_cache"] == hits + expect_cached
            x = rt.from_numpy(np.arange(4, dtype=np.float32))
            program.twice(rt.queue, (4,), None, x.buffer)
            assert rt.to_numpy(x).tolist() == [0.0, 2.0, 4.0, 6.0]

        run_from_a_new_process_state(expect_cached=True)
        path.write_bytes(b"not a program binary")
        run_from_a_new_process_state(expect_cached=False)  # refused, rebuilt from source and stored again
        assert path.read_bytes() != b"not a program binary"
        monkeypatch.setenv("PERFX_OPENCL_PROGRAM_CACHE", "0")
        path.unlink()
        run_from_a_new_process_state(expect_cached=False)
        assert not path.exists()
    finally:
        rt.close()


def test_int4_weights_are_repacked_on_the_device_into_the_chunk_major_layout(registry):
    from perfx_core.weights import Int4Weight

    rng = np.random.default_rng(0)
    m, k, group = 5, 128, 64
    weight = Int4Weight(
        rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
        rng.standard_normal((m, k // group)).astype(np.float16),
        rng.standard_normal((m, k // group)).astype(np.float32),
        group,
    )
    rt = registry.open_runtime("opencl")
    try:
        handle = rt.prepare_weight(weight)
        chunks = weight.packed.reshape(m, k // 32, 16).transpose(1, 0, 2)
        np.testing.assert_array_equal(rt.to_numpy(handle.packed), chunks)
        np.testing.assert_array_equal(rt.to_numpy(handle.scale), weight.scale.T)
        np.testing.assert_array_equal(rt.to_numpy(handle.bias), weight.bias.T)
        assert rt.load_stats["weights_s"] > 0
    finally:
        rt.close()


def test_views_share_storage_and_are_bounds_checked(registry):
    rt = registry.open_runtime("opencl")
    try:
        base = rt.from_numpy(np.arange(12, dtype=np.float32))
        view = rt.view(base, 5, (2, 3))
        np.testing.assert_array_equal(rt.to_numpy(view), np.arange(5, 11, dtype=np.float32).reshape(2, 3))
        rt.write(view, np.zeros(6, np.float32))
        assert rt.to_numpy(base).tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 11]
        with pytest.raises(BackendError, match="outside"):
            rt.view(base, 10, (3,))
    finally:
        rt.close()


def test_allocated_bytes_follow_the_model(registry, smollm2_path):
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        start = rt.allocated_bytes
        model = LlamaModel(config, weights, rt, max_seq_len=64, prefill_chunk=16)
        loaded = rt.allocated_bytes
        assert loaded - start > 50 * 2**20  # SmolLM2-135M in int4 is ~100 MB on the device
        assert rt.peak_allocated_bytes >= loaded
        model.prefill([1, 2, 3])
        del model
        gc.collect()
        assert rt.allocated_bytes - start < 2**20  # only the runtime's small index and scratch buffers remain
    finally:
        rt.close()


def test_kv_cache_is_float16_by_default_on_gpus(registry, smollm2_path):
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        assert rt.default_kv_dtype == ("float16" if rt.device.kind == "gpu" else "float32")
        rt.device = dataclasses.replace(rt.device, kind="gpu")  # as a GPU reports itself
        assert LlamaModel(config, weights, rt, max_seq_len=32, prefill_chunk=16).cache.k.dtype == np.float16
        chosen = LlamaModel(config, weights, rt, max_seq_len=32, prefill_chunk=16, kv_dtype="float32")
        assert chosen.cache.k.dtype == np.float32  # float32 stays selectable
    finally:
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_smollm2_greedy_tokens_and_logits_match_numpy(registry, smollm2, kv_dtype):
    """Against the float32 NumPy reference, with either KV-cache dtype (float16 is the default on GPUs)."""
    model = perfx_core.load(backend="opencl", context_length=256, kv_dtype=kv_dtype)
    try:
        assert model.backend == "opencl" and model.engine.cache_spec.dtype == kv_dtype
        ours = model.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True)
        ours.run()
        ref = smollm2.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True)
        ref.run()
        assert ours.token_ids == ref.token_ids, (ours.text, ref.text)
        assert "Paris" in ours.text

        ids = model.tokenizer.encode(PROMPT, add_special=True) + ref.token_ids[:27]  # ~32 tokens
        got, want = model.logits(ids), smollm2.logits(ids)
        nmse = float(((got - want) ** 2).sum() / (want**2).sum())
        assert nmse < 1e-4, nmse
    finally:
        model.close()


# -- perfx tune ----------------------------------------------------------------------------------------------


def test_perfx_tune_caches_per_device_and_the_runtime_uses_it(registry, tmp_path, monkeypatch):
    """`perfx tune` on a real (tiny, Q4_0) GGUF: the cache file holds a shape per matmul and token count, a
    fresh runtime launches with it, and a stale, corrupt or foreign file is ignored, never trusted."""
    import json

    from perfx_opencl import ops, tuning
    from tiny_gguf import write_tiny_llama_gguf

    from perfx_core.cli import main
    from perfx_core.gguf_file import read_gguf
    from perfx_core.gguf_loader import read_llama_config

    monkeypatch.setenv("PERFX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, tensor_type="Q4_0", dim=128, ffn_dim=256, seed=3)
    vocab = read_llama_config(read_gguf(path)).vocab_size
    assert main(["tune", "-b", "opencl", "-m", str(path), "--quick"]) == 0
    rt = registry.open_runtime("opencl")
    try:
        path = tuning.cache_path(rt)
        data = json.loads(path.read_text())
        assert data["device"] == rt.device.name
        assert data["kernel_hash"] == tuning.kernel_hash()
        # qkv (4 heads x 32 + 2 x 2 kv heads x 32 = 256 rows), wo, gate|up (SiLU), down, logits; n = 1..16
        # keyed by the file's weight form: Q4_0 is symmetric with 32-column groups
        assert {key.rsplit(":", 1)[0] for key in data["gemv"]} == {
            "gemv:256x128:g32s",
            "gemv:128x128:g32s",
            "silu:256x128:g32s",
            "gemv:128x256:g32s",
            f"gemv:{vocab}x128:g32s",
        }
        assert len(data["gemv"]) == 5 * len(tuning.SMALL_NS)
        chosen = data["gemv"]["silu:256x128:g32s:nt4"]
        assert ops.gemv_tuning(rt, True, 256, 128, 4, "g32s") == chosen  # a new runtime reads the file
        defaults = {**ops.GEMV_TUNING, "CR": 1, "QX": int(rt.native_int_dot)}
        assert ops.gemv_tuning(rt, True, 256, 128, 4, "g128") == defaults  # another form's weights do not

        for bad in ('{"format": 1, "kernel_hash": "0", "gemv": {}}', "{not json", '{"format": 1, "gemv": 3}'):
            path.write_text(bad)
            ops.clear_plans(rt)
            assert ops.gemv_tuning(rt, True, 256, 128, 4, "g32s") == defaults
        # Shapes that would crash or hang a launch:
        for impossible in ({"RW": 0}, {"CR": 0}, {"UC": 0}, {"XS": 2}, {"QX": 2}, {"KS": "8"}):
            data["gemv"]["silu:256x128:g32s:nt4"] = {**chosen, **impossible}
            path.write_text(json.dumps(data))
            ops.clear_plans(rt)
            tuned = tuning.load(rt)
            assert "silu:256x128:g32s:nt4" not in tuned and "silu:256x128:g32s:nt2" in tuned
    finally:
        rt.close()


def test_shipped_tuning_serves_its_device_until_the_user_tunes(registry, tmp_path, monkeypatch):
    """A device perfx was measured on launches with the shipped shapes (tuned/<device>-<variant>.json) without
    `perfx tune`, also for a weight form it has no entry of; an impossible shipped entry is ignored, and the
    user's own result for a shape wins."""
    import json

    from perfx_opencl import ops, tuning

    monkeypatch.setenv("PERFX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "tuned")
    shipped = {"RW": 16, "KS": 4, "CR": 2, "UC": 1, "XS": 0, "QX": 0}
    rt = registry.open_runtime("opencl")
    try:
        name = f"{tuning._slug(rt.device.name)}-{rt.variant}.json"
        entries = {"gemv:64x128:g128:nt1": shipped, "gemv:32x128:g128:nt1": {**shipped, "RW": 0}}
        (tmp_path / "tuned").mkdir()
        (tmp_path / "tuned" / name).write_text(json.dumps({"gemv": entries}))
        defaults = {**ops.GEMV_TUNING, "QX": int(rt.native_int_dot)}
        assert ops.gemv_tuning(rt, False, 64, 128, 1) == shipped
        assert ops.gemv_tuning(rt, False, 64, 128, 1, "g32s") == shipped  # no Q4_0 entry: the g128 one
        assert ops.gemv_tuning(rt, False, 32, 128, 1) == defaults
        mine = {**shipped, "KS": 8}
        tuning.save(rt, {"gemv:64x128:g32s:nt1": mine})
        ops.clear_plans(rt)
        assert ops.gemv_tuning(rt, False, 64, 128, 1, "g32s") == mine
        assert ops.gemv_tuning(rt, False, 64, 128, 1) == shipped
    finally:
        rt.close()


def test_perfx_tune_refuses_a_backend_without_kernels(capsys):
    from perfx_core.cli import main

    assert main(["tune", "-b", "numpy", "--quick"]) == 2
    assert "has nothing to tune" in capsys.readouterr().err


def test_a_q4_0_model_computes_without_stored_biases_what_the_numpy_backend_does(tmp_path):
    """A GGUF Q4_0 model on OpenCL keeps no biases (each is -8 * its scale, kernels/int4_group.cl): the GEMV of
    one token and the prompt path (GEMM or matrix units) and the embedding give the NumPy backend's logits."""
    from tiny_gguf import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q4_0", dim=128, ffn_dim=256, seed=6).path
    ids = [1, 5, 9, 3, 7, 2, 8, 4] * 5
    with perfx_core.load(path, backend="opencl") as cl_model, perfx_core.load(path, backend="numpy") as np_model:
        assert cl_model.engine.layers[0].w_qkv.bias is None and cl_model.engine.embedding.bias is None
        for n in (1, len(ids)):
            got, want = cl_model.logits(ids[:n]), np_model.logits(ids[:n])
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
