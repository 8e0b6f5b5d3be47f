"""Registers the NumPy backend and its ops through the same ``perfx`` hooks a third-party plugin uses."""

from __future__ import annotations

from perfx_core.hookspecs import hookimpl
from perfx_core.ops import FORMAT_OPS, PRIMITIVE_OPS

from . import ops
from .runtime import NumpyBackend


@hookimpl(trylast=True)
def perfx_register_backends(register):
    register(NumpyBackend())


@hookimpl(trylast=True)
def perfx_register_ops(register):
    # Every primitive op, and the ops of the weight formats its runtime takes (NumpyRuntime.weight_formats).
    formats = tuple(op for f in ("int8", "int5", "int6") for op in FORMAT_OPS[f])
    for name in PRIMITIVE_OPS + ops.FAMILY_OPS + formats + ("write_columns",):
        register("numpy", name, getattr(ops, name), priority=0)
