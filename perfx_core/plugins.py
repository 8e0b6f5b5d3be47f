"""Plugin loading and the registry of backends and op implementations built from the ``perfx`` hooks.

Built-in backends register through the same ``perfx`` entry-point group as third-party plugins. When perfx
runs from a source checkout that was not pip-installed (no entry points), the built-in modules listed in
DEFAULT_PLUGINS are registered directly so the engine still works.

Environment:
  PERFX_LOAD_PLUGINS=a,b     load only these entry-point plugins (empty string: none)
  PERFX_DISABLE_PLUGINS=a,b  block these plugins (entry-point names) even if installed
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .backend import Backend
from .errors import BackendError, PluginError
from .ops import FORMAT_OPS, GENERIC_OPS, GENERIC_PRIORITY, OP_NAMES, OpTable

ENTRY_POINT_GROUP = "perfx"
# (plugin name, module) of the built-in plugins, used when their entry points are not installed.
DEFAULT_PLUGINS = (("numpy", "perfx_numpy.plugin"), ("opencl", "perfx_opencl.plugin"))


@dataclass(frozen=True)
class OpImplementation:
    backend: str
    op: str
    function: Callable[..., None]
    priority: int
    plugin: str

    @property
    def source(self) -> str:
        return f"{self.plugin}:{getattr(self.function, '__qualname__', repr(self.function))} (priority {self.priority})"


class Registry:
    """Backends and op implementations contributed by the loaded plugins."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.backends: dict[str, Backend] = {}
        self.backend_plugin: dict[str, str] = {}
        self.ops: list[OpImplementation] = []
        self._collect()

    def _collect(self) -> None:
        for impl in self.pm.hook.perfx_register_backends.get_hookimpls():
            impl.function(register=self._backend_registrar(impl.plugin_name))
        for impl in self.pm.hook.perfx_register_ops.get_hookimpls():
            impl.function(register=self._op_registrar(impl.plugin_name))
        for op, fn in GENERIC_OPS.items():
            self.ops.append(OpImplementation("*", op, fn, GENERIC_PRIORITY, "perfx_core"))

    def _backend_registrar(self, plugin: str) -> Callable[[Backend], None]:
        def register(backend: Backend) -> None:
            if not isinstance(backend, Backend) or not getattr(backend, "name", ""):
                raise PluginError(f"plugin {plugin!r} registered {backend!r}, which is not a named perfx Backend")
            if backend.name in self.backends:
                raise PluginError(
                    f"plugin {plugin!r} registered backend {backend.name!r}, already registered by "
                    f"{self.backend_plugin[backend.name]!r}; disable one of them with PERFX_DISABLE_PLUGINS"
                )
            self.backends[backend.name] = backend
            self.backend_plugin[backend.name] = plugin

        return register

    def _op_registrar(self, plugin: str) -> Callable[..., None]:
        def register(backend_name: str, op_name: str, function: Callable[..., None], priority: int = 0) -> None:
            if op_name not in OP_NAMES:
                raise PluginError(f"plugin {plugin!r} registered unknown op {op_name!r}; ops are {', '.join(OP_NAMES)}")
            if not callable(function):
                raise PluginError(f"plugin {plugin!r} registered a non-callable for op {op_name!r}")
            if not isinstance(priority, int):
                raise PluginError(f"plugin {plugin!r} gave op {op_name!r} a non-integer priority {priority!r}")
            self.ops.append(OpImplementation(backend_name, op_name, function, priority, plugin))

        return register

    def candidates(self, backend: str, op: str) -> list[OpImplementation]:
        """Implementations of ``op`` usable on ``backend``, best first."""
        found = [i for i in self.ops if i.op == op and i.backend in (backend, "*")]
        return sorted(found, key=lambda i: i.priority, reverse=True)

    def resolve(self, backend: str) -> dict[str, OpImplementation]:
        """The chosen implementation of every op for ``backend``; raises if a primitive op is missing (the ops of
        optional weight formats, ops.FORMAT_OPS, may be: the runtime then gets those weights widened)."""
        optional = {op for ops in FORMAT_OPS.values() for op in ops}
        chosen: dict[str, OpImplementation] = {}
        missing = []
        for op in OP_NAMES:
            found = self.candidates(backend, op)
            if found:
                chosen[op] = found[0]
            elif op not in optional:
                missing.append(op)
        if missing:
            raise BackendError(f"backend {backend!r} has no implementation of: {', '.join(missing)}")
        return chosen

    def get_backend(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            known = ", ".join(sorted(self.backends)) or "none"
            raise BackendError(
                f"no backend named {name!r}; registered backends: {known} (see `perfx backends`)"
            ) from None

    def open_runtime(self, backend: str, device: int | str | None = None) -> Any:
        """Open a device of ``backend`` and attach its resolved op table."""
        backend_obj = self.get_backend(backend)
        chosen = self.resolve(backend)
        runtime = backend_obj.open(device)
        runtime.ops = OpTable(runtime, {op: (impl.function, impl.source) for op, impl in chosen.items()})
        # A format whose ops nothing registered for this backend (a NumPy-based backend of a test, say) is not
        # one this runtime takes after all: its weights reach it widened.
        runtime.weight_formats = frozenset(
            f for f in runtime.weight_formats if all(op in chosen for op in FORMAT_OPS.get(f, (f,)))
        )
        return runtime


def _names_from_env(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def make_plugin_manager(extra_plugins: tuple[tuple[str, Any], ...] = ()) -> pluggy.PluginManager:
    """A plugin manager with entry-point plugins, built-in defaults and ``extra_plugins`` registered."""
    pm = pluggy.PluginManager("perfx")
    pm.add_hookspecs(hookspecs)
    only = _names_from_env("PERFX_LOAD_PLUGINS")
    disabled = _names_from_env("PERFX_DISABLE_PLUGINS") or set()
    for name in disabled:
        pm.set_blocked(name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled or (only is not None and ep.name not in only and ep.name not in dict(DEFAULT_PLUGINS)):
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the engine (or `perfx backends`) down
            reason = f"{type(exc).__name__}: {exc}"
            FAILED_PLUGINS[ep.name] = reason
            warnings.warn(
                f"perfx plugin {ep.name!r} ({ep.value}) failed to import and is skipped ({reason}); "
                "fix or uninstall it, or set PERFX_DISABLE_PLUGINS",
                stacklevel=2,
            )
            continue
        FAILED_PLUGINS.pop(ep.name, None)
        pm.register(module, name=ep.name)
    for name, module_name in DEFAULT_PLUGINS:
        if pm.get_plugin(name) is None and not pm.is_blocked(name):
            pm.register(importlib.import_module(module_name), name=name)
    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
    return pm


_lock = threading.Lock()
_registry: Registry | None = None
FAILED_PLUGINS: dict[str, str] = {}  # entry-point plugins that failed to import: name -> reason


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use (``refresh=True`` re-reads plugins and environment)."""
    global _registry
    with _lock:
        if _registry is None or refresh:
            _registry = Registry(make_plugin_manager())
        return _registry


def register_plugin(plugin: Any, name: str) -> Registry:
    """Register a plugin object at run time (tests, notebooks) and rebuild the registry."""
    global _registry
    with _lock:
        pm = (_registry or Registry(make_plugin_manager())).pm
        pm.register(plugin, name=name)
        _registry = Registry(pm)
        return _registry


def unregister_plugin(name: str) -> Registry:
    global _registry
    with _lock:
        pm = (_registry or Registry(make_plugin_manager())).pm
        plugin = pm.get_plugin(name)
        if plugin is not None:
            pm.unregister(plugin, name=name)
        _registry = Registry(pm)
        return _registry
