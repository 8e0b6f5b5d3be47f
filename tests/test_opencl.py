"""The OpenCL backends (``opencl``, ``opencl-adreno``): conformance, SmolLM2 end to end against NumPy, errors, memory.

Runs wherever pyopencl finds an OpenCL device that can build kernels (PoCL on a CPU is enough); skips with
the reason otherwise.
"""

from __future__ import annotations

import gc
import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")

import perfx_opencl.plugin  # noqa: E402
from perfx_opencl.runtime import KernelBuildError, OpenCLBackend  # noqa: E402

import perfx_core  # noqa: E402
from perfx_core.errors import BackendError, BackendUnavailableError  # noqa: E402
from perfx_core.plugins import get_registry, register_plugin  # noqa: E402
from perfx_core.testing import assert_backend_conforms  # noqa: E402

PROMPT = "The capital of France is"


def _why_unusable() -> str | None:
    try:
        OpenCLBackend().open().close()
    except BackendUnavailableError as exc:
        return str(exc)
    except BackendError as exc:
        return f"no OpenCL device could build a kernel: {exc}"
    return None


_REASON = _why_unusable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"OpenCL unusable here: {_REASON}")


@pytest.fixture
def registry():
    """The process-wide registry, with the OpenCL plugin registered even when its entry point is not installed."""
    reg = get_registry()
    if "opencl" not in reg.backends:
        reg = register_plugin(perfx_opencl.plugin, "opencl")
    return reg


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


@pytest.mark.slow
def test_smollm2_greedy_tokens_and_logits_match_numpy(registry, smollm2):
    model = perfx_core.load(backend="opencl", context_length=256)
    try:
        assert model.backend == "opencl"
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
