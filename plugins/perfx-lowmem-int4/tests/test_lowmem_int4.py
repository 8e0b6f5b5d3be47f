"""perfx-lowmem-int4 as a user gets it: found by its entry point, chosen by priority, disabled by env, conformant."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from perfx_core.hookspecs import hookimpl
from perfx_core.plugins import get_registry, register_plugin, unregister_plugin
from perfx_core.testing import assert_backend_conforms, isolated_plugins
from perfx_core.weights import Int4Weight

PLUGIN = "lowmem-int4"
OUTRANKING = ("numba-cpu",)
INSTALLED = any(ep.name == PLUGIN for ep in importlib.metadata.entry_points(group="perfx"))

pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="perfx-lowmem-int4 is not installed: run `pip install -e plugins/perfx-lowmem-int4`"
)


@pytest.fixture
def plugin_env(monkeypatch):
    # perfx-numba-cpu (priority 20) outranks this plugin when both are installed: test this one alone.
    yield from isolated_plugins(monkeypatch, disable=OUTRANKING)


def test_discovered_through_entry_point(plugin_env):
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="perfx") if ep.name == PLUGIN]
    assert ep.value == "perfx_lowmem_int4"
    chosen = get_registry(refresh=True).resolve("numpy")
    assert chosen["int4_gemv"].plugin == PLUGIN
    assert chosen["int4_gemm"].plugin == PLUGIN
    assert chosen["dense_gemm"].plugin == "numpy"  # it replaces only what it registers


def test_chosen_by_priority(plugin_env):
    registry = get_registry(refresh=True)
    by_plugin = {impl.plugin: impl.priority for impl in registry.candidates("numpy", "int4_gemv")}
    assert by_plugin[PLUGIN] == 10 and by_plugin["numpy"] == 0

    def faster_gemv(rt, x, w, out):
        np.matmul(x, w.float32().T, out=out)

    class Faster:
        @hookimpl
        def perfx_register_ops(self, register):
            register("numpy", "int4_gemv", faster_gemv, priority=20)

    register_plugin(Faster(), "test-priority-20")
    try:
        assert get_registry().resolve("numpy")["int4_gemv"].plugin == "test-priority-20"
        assert get_registry().resolve("numpy")["int4_gemm"].plugin == PLUGIN
    finally:
        unregister_plugin("test-priority-20")
    assert get_registry().resolve("numpy")["int4_gemv"].plugin == PLUGIN


def test_can_be_disabled(plugin_env):
    plugin_env.setenv("PERFX_DISABLE_PLUGINS", ",".join((PLUGIN, *OUTRANKING)))
    chosen = get_registry(refresh=True).resolve("numpy")
    assert chosen["int4_gemv"].plugin == "numpy"
    assert chosen["int4_gemm"].plugin == "numpy"


def test_not_loaded_when_load_list_leaves_it_out(plugin_env):
    plugin_env.setenv("PERFX_LOAD_PLUGINS", "")
    assert get_registry(refresh=True).resolve("numpy")["int4_gemv"].plugin == "numpy"


def test_conforms(plugin_env):
    get_registry(refresh=True)
    assert_backend_conforms("numpy", ops=["int4_gemv", "int4_gemm", "linear", "qkv_proj", "gate_up_silu", "logits"])


def test_gemv_does_not_allocate_the_float_copy(plugin_env):
    rng = np.random.default_rng(0)
    m = k = 4096
    weight = Int4Weight(
        rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
        rng.uniform(-0.05, 0.05, (m, k // 64)).astype(np.float16),
        rng.normal(0.0, 0.1, (m, k // 64)).astype(np.float32),
        64,
    )
    rt = get_registry(refresh=True).open_runtime("numpy")
    assert rt.ops.sources["int4_gemv"].startswith(PLUGIN)
    w = rt.prepare_weight(weight)
    x = rt.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    out = rt.empty((1, m))
    before = rt.allocated_bytes
    rt.ops.int4_gemv(x, w, out)
    rt.ops.int4_gemv(x, w, out)  # a second call reuses the scratch: no growth at all
    float_copy = m * k * 4
    grown = rt.allocated_bytes - before
    assert grown <= 2 << 20, f"allocated bytes grew by {grown}, the float copy would be {float_copy}"
    assert rt.peak_allocated_bytes - before <= 2 << 20
    assert w._float32 is None
    expected = rt.to_numpy(x) @ w.float32().T  # now build the float copy, only to check the numbers
    np.testing.assert_allclose(rt.to_numpy(out), expected, rtol=1e-4, atol=1e-3)
