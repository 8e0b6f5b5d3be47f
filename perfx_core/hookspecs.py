"""The pluggy hooks of the ``perfx`` project: how backends and operator implementations are contributed."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("perfx")
hookimpl = pluggy.HookimplMarker("perfx")


@hookspec
def perfx_register_backends(register):
    """Contribute backends.

    Call ``register(backend)`` once per backend, where ``backend`` is an instance of
    ``perfx_core.backend.Backend`` with a unique ``name``. Nothing is returned. A name that is already
    registered raises ``PluginError`` naming both plugins.
    """


@hookspec
def perfx_register_ops(register):
    """Contribute operator implementations, for your own backend or to replace one of another backend.

    Call ``register(backend_name, op_name, function, priority=0)``. ``op_name`` is one of
    ``perfx_core.ops.OP_NAMES`` and ``function`` follows that op's contract (``docs/ops.md``), taking the
    backend's runtime as its first argument. For each (backend, op) the implementation with the highest
    priority wins; built-in backends register theirs with priority 0, so a plugin replaces one with any
    priority above 0. ``backend_name`` may be ``"*"`` for an implementation that works on every backend
    (the built-in composite ops use this with priority -100). Nothing is returned.
    """
