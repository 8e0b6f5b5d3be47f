"""The conformance kit passes the NumPy backend and catches each kind of fault in a deliberately broken one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from perfx_numpy import ops as numpy_ops
from perfx_numpy.runtime import NumpyBackend

from perfx_core import reference
from perfx_core.conformance import NORM_LIMIT, check_backend
from perfx_core.errors import InvalidArgumentError
from perfx_core.hookspecs import hookimpl
from perfx_core.ops import FORMAT_OPS, OP_NAMES, PRIMITIVE_OPS
from perfx_core.plugins import Registry, get_registry, make_plugin_manager, register_plugin, unregister_plugin
from perfx_core.testing import isolated_plugins
from perfx_core.weights import dequantize, quantize_rtn


@pytest.fixture
def clean_registry(monkeypatch):
    """Only the built-in plugins; the process-wide registry is rebuilt from the real environment afterwards."""
    yield from isolated_plugins(monkeypatch, load="")


def test_numpy_backend_conforms(clean_registry):
    report = check_backend("numpy", registry=get_registry())
    assert report.passed, report.format()
    assert {r.op for r in report.results} == set(OP_NAMES)
    assert all(r.source.startswith(("numpy:", "perfx_core:")) for r in report.results)
    assert "PASSED" in report.format()
    json.dumps(report.as_dict())  # serializable as it is, for `perfx check-backend --json` style output


def test_numpy_backend_conforms_with_installed_plugins():
    """Whatever currently wins each numpy op (an installed plugin's replacement included) conforms too."""
    report = check_backend("numpy", registry=Registry(make_plugin_manager()))
    assert report.passed, report.format()


def test_unknown_op_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="int4_gemv"):
        check_backend("numpy", ops=["int4_gemvv"])


def test_reference_int4_decoding_agrees_with_weights_module():
    rng = np.random.default_rng(0)
    w = quantize_rtn(rng.standard_normal((7, 64)).astype(np.float32), 32)
    np.testing.assert_allclose(reference.weight_values(w), dequantize(w, np.float64), rtol=1e-6, atol=1e-7)


# -- a backend with one fault of each kind ---------------------------------------------------------------


def wrong_rmsnorm(rt, x, weight, eps, out):
    """eps outside the square root: right for ordinary rows, wrong where eps matters."""
    out[...] = x / (np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True)) + eps) * weight


def overrunning_silu_mul(rt, gate_up, out):
    """Right values, plus a write to the element just past ``out`` through the buffer it is a view of."""
    numpy_ops.silu_mul(rt, gate_up, out)
    base = out.base.reshape(-1)
    start = (out.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize
    base[start + out.size] = 0.0


def raising_dense_gemm(rt, x, w, out):
    raise RuntimeError("kernel failed to build")


def unwritten_int4_gemv(rt, x, w, out):
    """Computes the result but forgets to store it in ``out``."""
    _ = x @ w.float32().T


def one_scale_int8_gemm(rt, x, w, out):
    """Every group multiplied by the first group's scale: right wherever a row's scales happen to agree."""
    weight = w.weight
    out[...] = x @ (weight.codes.astype(np.float32) * weight.scale[:, :1].astype(np.float32)).T


def cache_clobbering_prefill(rt, qkv, cache, layer, slot, start, rope, spec, out):
    """Right output, but it also zeroes the cache position after the new tokens."""
    numpy_ops.attention_prefill(rt, qkv, cache, layer, slot, start, rope, spec, out)
    end = start + qkv.shape[0]
    if end < cache.k.shape[3]:
        cache.k[layer, slot, :, end] = 0


class BrokenBackend(NumpyBackend):
    name = "broken"
    description = "the NumPy backend with deliberate faults, for testing the conformance kit"


FAULTS = {
    "rmsnorm": wrong_rmsnorm,
    "silu_mul": overrunning_silu_mul,
    "dense_gemm": raising_dense_gemm,
    "int4_gemv": unwritten_int4_gemv,
    "attention_prefill": cache_clobbering_prefill,
    "int8_gemm": one_scale_int8_gemm,
}


class BrokenPlugin:
    @hookimpl
    def perfx_register_backends(self, register):
        register(BrokenBackend())

    @hookimpl
    def perfx_register_ops(self, register):
        for op in PRIMITIVE_OPS + FORMAT_OPS["int8"]:
            register("broken", op, FAULTS.get(op, getattr(numpy_ops, op)))


@pytest.fixture(scope="module")
def broken_report():
    """One run of the kit on the broken backend, shared by the tests below (built-in plugins only)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PERFX_LOAD_PLUGINS", "")
        get_registry(refresh=True)
        register_plugin(BrokenPlugin(), "broken-test")
        try:
            report = check_backend("broken")
        finally:
            unregister_plugin("broken-test")
    get_registry(refresh=True)
    return report


def failures(report, op):
    return [r for r in report.results if r.op == op and not r.passed]


def test_broken_backend_fails(broken_report):
    assert not broken_report.passed
    text = broken_report.format()
    assert "FAILED" in text
    for op in FAULTS:
        assert failures(broken_report, op), f"the fault in {op} went unnoticed:\n{text}"
    for op in ("embedding", "int4_gemm", "add_rmsnorm", "attention_decode"):
        assert not failures(broken_report, op), text


def test_int8_cases_run_only_where_the_runtime_takes_int8(clean_registry):
    """A backend on the NumPy runtime that registers no int8_gemm takes no int8 weights (they reach it widened):
    the kit runs none of the int8 cases there, and passes."""

    class NoInt8Plugin:
        @hookimpl
        def perfx_register_backends(self, register):
            register(type("NoInt8Backend", (NumpyBackend,), {"name": "noint8"})())

        @hookimpl
        def perfx_register_ops(self, register):
            for op in PRIMITIVE_OPS:
                register("noint8", op, getattr(numpy_ops, op))

    registry = register_plugin(NoInt8Plugin(), "noint8-test")
    try:
        rt = registry.open_runtime("noint8")
        assert rt.weight_formats == frozenset() and "int8_gemm" not in rt.ops.sources
        rt.close()
        report = check_backend("noint8", ops=["embedding", "linear", "int8_gemm"], registry=registry)
        assert report.passed and report.results and not any("int8" in r.case for r in report.results)
    finally:
        unregister_plugin("noint8-test")
    numpy_report = check_backend("numpy", ops=["int8_gemm"], registry=get_registry())
    assert numpy_report.passed and len(numpy_report.results) >= 9


def test_wrong_numbers_fail_by_nmse(broken_report):
    bad = failures(broken_report, "rmsnorm")
    assert all(r.nmse is not None and r.nmse > NORM_LIMIT and r.error is None for r in bad)
    assert all("wrong_rmsnorm" in r.source for r in bad)


def test_out_of_bounds_write_is_named(broken_report):
    bad = failures(broken_report, "silu_mul")
    assert len(bad) == len([r for r in broken_report.results if r.op == "silu_mul"])
    for r in bad:
        assert r.nmse is not None and r.nmse <= NORM_LIMIT  # the values are right: only the guard catches it
        assert "out-of-bounds write" in r.error and "after out" in r.error
    assert "silu_mul  [broken-test:overrunning_silu_mul" in broken_report.format()


def test_raising_op_is_reported_not_fatal(broken_report):
    for r in failures(broken_report, "dense_gemm"):
        assert r.nmse is None and "RuntimeError: kernel failed to build" in r.error
    # composites that reach dense_gemm fail with the same reason; their int4 cases still run
    linear = [r for r in broken_report.results if r.op == "linear"]
    assert any("RuntimeError" in (r.error or "") for r in linear)


def test_unwritten_output_is_named(broken_report):
    for r in failures(broken_report, "int4_gemv"):
        assert "were never written" in r.error
    json.loads(json.dumps(broken_report.as_dict(), allow_nan=False))  # NaN NMSEs become strings


def test_kv_cache_write_outside_new_positions_is_caught(broken_report):
    bad = failures(broken_report, "attention_prefill")
    assert bad and all("KV cache k changed outside the new positions" in r.error for r in bad)
