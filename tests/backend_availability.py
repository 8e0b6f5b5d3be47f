"""Running a test on a backend that may be absent: skip only where it cannot run here at all, fail otherwise.

A backend that is not installed or finds no device raises BackendUnavailableError: that machine cannot run the
test, so it skips. Anything else (a device that opens but fails to build a kernel, a wrong result) is a failure. Where
CI installs OpenCL (PoCL), PERFX_REQUIRE_OPENCL=1 turns even BackendUnavailableError into a failure, so a broken
OpenCL setup there cannot pass as a skip.
"""

from __future__ import annotations

import os

import pytest

from perfx_core.errors import BackendUnavailableError
from perfx_core.plugins import get_registry


def required(backend: str) -> bool:
    return backend.startswith("opencl") and os.environ.get("PERFX_REQUIRE_OPENCL") == "1"


def open_runtime_or_skip(backend: str, device: int | str | None = None):
    """The backend's runtime; skips (unless it is required here) when the backend cannot run on this machine."""
    try:
        return get_registry().open_runtime(backend, device)
    except BackendUnavailableError as exc:
        if required(backend):
            raise
        pytest.skip(f"{backend} cannot run here: {exc}")


def skip_unless_available(backend: str) -> None:
    open_runtime_or_skip(backend).close()
