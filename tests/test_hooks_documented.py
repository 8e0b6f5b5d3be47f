"""Every hook is documented in docs/plugins.md with its exact signature and docstring, and has its own test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from perfx_numpy import ops as numpy_ops
from perfx_numpy.runtime import NumpyBackend

from perfx_core import hookspecs
from perfx_core.errors import PluginError
from perfx_core.hookspecs import hookimpl
from perfx_core.ops import PRIMITIVE_OPS
from perfx_core.plugins import Registry, get_registry, make_plugin_manager, register_plugin, unregister_plugin
from perfx_core.testing import isolated_plugins

ROOT = Path(__file__).resolve().parents[1]
PLUGINS_DOC = ROOT / "docs" / "plugins.md"


def hook_specs() -> dict[str, object]:
    """The hooks declared in perfx_core.hookspecs (pluggy marks each with a ``perfx_spec`` attribute)."""
    return {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "perfx_spec")}


def normalized(text: str) -> str:
    return " ".join(text.split())


def test_there_are_hooks():
    assert set(hook_specs()) >= {"perfx_register_backends", "perfx_register_ops"}


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_is_documented_with_its_signature_and_docstring(name):
    doc = PLUGINS_DOC.read_text()
    fn = hook_specs()[name]
    signature = f"{name}{inspect.signature(fn)}"
    assert f"### `{signature}`" in doc, f"docs/plugins.md needs a '### `{signature}`' section"
    assert normalized(inspect.getdoc(fn)) in normalized(doc), f"docs/plugins.md must quote the docstring of {name}"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_has_a_test_named_after_it(name):
    pattern = re.compile(rf"^\s*def test_{name}\b", re.MULTILINE)
    found = [path for path in (ROOT / "tests").rglob("test_*.py") if pattern.search(path.read_text())]
    assert found, f"no test named test_{name} under tests/"


# -- the hooks themselves --------------------------------------------------------------------------------


@pytest.fixture
def fresh_registry(monkeypatch):
    """Built-in plugins only, rebuilt from the real environment after the test."""
    yield from isolated_plugins(monkeypatch, load="")


class TinyBackend(NumpyBackend):
    name = "tiny"
    description = "the NumPy runtime under another name, to test backend registration"


class TinyBackendPlugin:
    @hookimpl
    def perfx_register_backends(self, register):
        register(TinyBackend())

    @hookimpl
    def perfx_register_ops(self, register):
        for op in PRIMITIVE_OPS:
            register("tiny", op, getattr(numpy_ops, op))


def test_perfx_register_backends(fresh_registry):
    register_plugin(TinyBackendPlugin(), "tiny-plugin")
    try:
        registry = get_registry()
        assert registry.backend_plugin["tiny"] == "tiny-plugin"
        rt = registry.open_runtime("tiny")
        assert rt.ops.sources["rmsnorm"].startswith("tiny-plugin:")
        assert rt.ops.sources["linear"].startswith("perfx_core:")  # composites come for free
        x = rt.from_numpy(np.full((2, 4), 2.0, dtype=np.float32))
        out = rt.empty((2, 4))
        rt.ops.rmsnorm(x, rt.from_numpy(np.ones(4, dtype=np.float32)), 0.0, out)
        np.testing.assert_allclose(rt.to_numpy(out), 1.0)
    finally:
        unregister_plugin("tiny-plugin")
    assert "tiny" not in get_registry().backends


def test_perfx_register_ops(fresh_registry):
    calls = []

    def counting_silu_mul(rt, gate_up, out):
        calls.append(gate_up.shape)
        numpy_ops.silu_mul(rt, gate_up, out)

    class Replacement:
        @hookimpl
        def perfx_register_ops(self, register):
            register("numpy", "silu_mul", counting_silu_mul, priority=5)

    register_plugin(Replacement(), "silu-replacement")
    try:
        chosen = get_registry().resolve("numpy")["silu_mul"]
        assert (chosen.plugin, chosen.priority, chosen.function) == ("silu-replacement", 5, counting_silu_mul)
        rt = get_registry().open_runtime("numpy")
        gate_up = rt.from_numpy(np.ones((3, 8), dtype=np.float32))
        out = rt.empty((3, 4))
        rt.ops.silu_mul(gate_up, out)
        assert calls == [(3, 8)]
    finally:
        unregister_plugin("silu-replacement")
    assert get_registry().resolve("numpy")["silu_mul"].plugin == "numpy"


class NotABackend:
    name = "impostor"


def _backends_plugin(*backends):
    class Plugin:
        @hookimpl
        def perfx_register_backends(self, register):
            for backend in backends:
                register(backend)

    return Plugin()


def _ops_plugin(*args, **kwargs):
    class Plugin:
        @hookimpl
        def perfx_register_ops(self, register):
            register(*args, **kwargs)

    return Plugin()


@pytest.mark.parametrize(
    "plugin, message",
    [
        (_ops_plugin("numpy", "int4_gemvv", numpy_ops.int4_gemv), "unknown op 'int4_gemvv'"),
        (_ops_plugin("numpy", "rmsnorm", "not a function"), "non-callable"),
        (_ops_plugin("numpy", "rmsnorm", numpy_ops.rmsnorm, priority=1.5), "non-integer priority"),
        (_backends_plugin(NumpyBackend()), "already registered by 'numpy'"),
        (_backends_plugin(NotABackend()), "not a named perfx Backend"),
    ],
    ids=["unknown-op", "non-callable", "float-priority", "duplicate-backend", "non-backend"],
)
def test_bad_registration_raises_plugin_error_naming_the_plugin(fresh_registry, plugin, message):
    with pytest.raises(PluginError, match="'bad-plugin'") as raised:
        Registry(make_plugin_manager(extra_plugins=(("bad-plugin", plugin),)))
    assert message in str(raised.value)


def test_bad_plugin_registered_at_run_time_can_be_removed(fresh_registry):
    with pytest.raises(PluginError, match="'bad-plugin'"):
        register_plugin(_ops_plugin("numpy", "no_such_op", numpy_ops.rmsnorm), "bad-plugin")
    unregister_plugin("bad-plugin")
    assert get_registry().resolve("numpy")["rmsnorm"].plugin == "numpy"


def test_a_plugin_that_fails_to_import_is_skipped_and_reported(monkeypatch, tmp_path):
    """A broken installed plugin must not take down the engine or `perfx backends`."""
    import importlib.metadata
    import sys

    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[perfx]\nbroken = perfx_no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delenv("PERFX_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("PERFX_DISABLE_PLUGINS", raising=False)
    try:
        with pytest.warns(UserWarning, match="'broken'.*failed to import"):
            registry = get_registry(refresh=True)
        assert "numpy" in registry.backends
        from perfx_core.plugins import FAILED_PLUGINS

        assert "ModuleNotFoundError" in FAILED_PLUGINS["broken"]
    finally:
        monkeypatch.undo()
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        get_registry(refresh=True)
