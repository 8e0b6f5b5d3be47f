"""Registers the ``opencl`` and ``opencl-adreno`` backends and their ops through the ``perfx`` hooks.

Importing this module does not import pyopencl: without it the backends are still listed, and
``devices()``/``open()`` raise BackendUnavailableError saying how to install it.
"""

from __future__ import annotations

from perfx_core.hookspecs import hookimpl

from . import ops
from .backend import AdrenoBackend, OpenCLBackend

BACKENDS = (OpenCLBackend, AdrenoBackend)


@hookimpl(trylast=True)
def perfx_register_backends(register):
    for backend in BACKENDS:
        register(backend())


@hookimpl(trylast=True)
def perfx_register_ops(register):
    for backend in BACKENDS:
        for name in ops.OPS:
            register(backend.name, name, getattr(ops, name), priority=0)
