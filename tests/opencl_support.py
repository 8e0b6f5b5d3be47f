"""What the OpenCL test modules share: whether OpenCL can run here, and the prompt (conftest.py has their
``registry`` fixture).

OpenCL is usable where pyopencl opens a device that builds a kernel (PoCL on a CPU is enough). Where it is not, the
modules skip with the reason, except where CI installs PoCL (PERFX_REQUIRE_OPENCL=1, backend_availability.py):
there they run and fail, so a broken OpenCL setup cannot pass as a skip.
"""

from __future__ import annotations

import pytest
from backend_availability import required

from perfx_core.errors import BackendError, BackendUnavailableError

PROMPT = "The capital of France is"


def _why_unusable() -> str | None:
    try:
        from perfx_opencl.backend import OpenCLBackend
    except ImportError as exc:
        return f"pyopencl is not installed (pip install 'perfx[opencl]'): {exc}"
    try:
        OpenCLBackend().open().close()
    except BackendUnavailableError as exc:
        return str(exc)
    except BackendError as exc:
        return f"no OpenCL device could build a kernel: {exc}"
    return None


REASON = _why_unusable()
opencl_usable = pytest.mark.skipif(
    REASON is not None and not required("opencl"), reason=f"OpenCL unusable here: {REASON}"
)
