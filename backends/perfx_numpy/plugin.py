"""Registers the NumPy backend and its ops through the same ``perfx`` hooks a third-party plugin uses."""

from __future__ import annotations

from perfx_core.hookspecs import hookimpl
from perfx_core.ops import PRIMITIVE_OPS

from . import ops
from .runtime import NumpyBackend


@hookimpl(trylast=True)
def perfx_register_backends(register):
    register(NumpyBackend())


@hookimpl(trylast=True)
def perfx_register_ops(register):
    for name in PRIMITIVE_OPS + ops.FAMILY_OPS:  # the NumPy backend implements every primitive op
        register("numpy", name, getattr(ops, name), priority=0)
