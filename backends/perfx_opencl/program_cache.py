"""Built OpenCL programs kept on disk (``<user cache dir>/opencl-programs/``), so a second process loads them
instead of compiling them again.

NVIDIA's driver compiles OpenCL C from source in every process (pyopencl leaves the caching to it there), and a
7B model's kernels are a few dozen programs. An entry is the device binary that clGetProgramInfo(CL_PROGRAM_BINARIES)
returned (PTX on NVIDIA), named by a hash of everything that decides it: the source, the build options, the
platform, device and driver, and perfx's version. A binary the driver refuses is dropped and rebuilt from source.
PERFX_OPENCL_PROGRAM_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from perfx_core.settings import cache_dir


def enabled() -> bool:
    return os.environ.get("PERFX_OPENCL_PROGRAM_CACHE", "1") != "0"


def entry_path(rt, source: str, options: tuple[str, ...]) -> Path:
    from perfx_core import __version__

    device, platform = rt.cl_device, rt.cl_device.platform
    identity = "\0".join(
        (
            __version__,
            platform.name,
            platform.version,
            device.name,
            device.version,
            device.driver_version,
            " ".join(options),
            source,
        )
    )
    return cache_dir() / "opencl-programs" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.bin"


def load(rt, path: Path, options: tuple[str, ...]) -> Any | None:
    """The program built from the binary at ``path``, or None (no entry, or one the driver refuses)."""
    cl = rt.cl
    try:
        binary = path.read_bytes()
    except OSError:
        return None
    try:
        program = cl.Program(rt.context, [rt.cl_device], [binary])
        program.build(options=list(options), devices=[rt.cl_device])
        return program
    except (cl.Error, ValueError):  # another driver version's binary, or a damaged file
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def store(rt, path: Path, program: Any) -> None:
    """Write ``program``'s binary to ``path`` (atomically: a reader never sees half a file); a cache that cannot
    be written is skipped, since it only saves time."""
    try:
        binary = program.get_info(rt.cl.program_info.BINARIES)[0]
    except rt.cl.Error:
        return
    if not binary:
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)
        except OSError:
            os.unlink(tmp)
            raise
