"""Replays queued from a native thread (native/replay.c), so queueing a step's kernels neither holds nor waits
for Python's GIL.

Why: a replayed step is ~160-290 kernel launches. From Python each holds the GIL: on the H200 host NVIDIA's
driver takes ~6 us per launch alone and ~15 us while another Python thread is busy (a server's HTTP loop),
and the text of the previous step can only go out once the whole step is queued. Here a POSIX thread queues
them while the caller goes on; the runtime joins it before its next use of the queue.

The C file is compiled on first use with the system C compiler ($CC, else cc, gcc or clang) into perfx's cache
directory, as Triton builds its launchers, and loaded with ctypes. Without a compiler, on a platform where the
OpenCL library cannot be found, or with PERFX_OPENCL_NATIVE_REPLAY=0, replays are queued from Python as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from perfx_core.errors import BackendError
from perfx_core.settings import cache_dir

from .flush_policy import flushes_after

log = logging.getLogger("perfx.opencl")

SOURCE = Path(__file__).parent / "native" / "replay.c"


class _Job(ctypes.Structure):
    """perfx_replay_job in native/replay.c: the same fields in the same order."""

    _fields_ = [
        ("enqueue", ctypes.c_void_p),
        ("flush", ctypes.c_void_p),
        ("queue", ctypes.c_void_p),
        ("count", ctypes.c_int32),
        ("kernels", ctypes.c_void_p),
        ("dims", ctypes.c_void_p),
        ("global_sizes", ctypes.c_void_p),
        ("local_sizes", ctypes.c_void_p),
        ("has_local", ctypes.c_void_p),
        ("flush_after", ctypes.c_void_p),
        ("failed_at", ctypes.c_int32),
        ("status", ctypes.c_int32),
        ("thread", ctypes.c_void_p),  # pthread_t: an unsigned long or a pointer, 8 bytes where this runs
    ]


class ReplayPlan:
    """One recorded step's launches laid out for the C loop: kernel handles, sizes and flush points."""

    def __init__(self, native: NativeReplayer, launches: tuple[tuple[Any, tuple[int, ...], Any, str], ...]):
        n = len(launches)
        self.names = [name for _, _, _, name in launches]
        self._kernels = np.array([kernel.int_ptr for kernel, _, _, _ in launches], dtype=np.uint64)
        self._dims = np.array([len(global_size) for _, global_size, _, _ in launches], dtype=np.uint32)
        self._global = np.zeros((n, 3), dtype=np.uint64)
        self._local = np.zeros((n, 3), dtype=np.uint64)
        self._has_local = np.zeros(n, dtype=np.uint8)
        for i, (_, global_size, local_size, _) in enumerate(launches):
            self._global[i, : len(global_size)] = global_size
            if local_size is not None:
                self._local[i, : len(local_size)] = local_size
                self._has_local[i] = 1
        self._flush_after = np.array([flushes_after(i) for i in range(1, n + 1)], dtype=np.uint8)
        self.job = _Job(
            native.enqueue_address,
            native.flush_address,
            None,
            n,
            *(a.ctypes.data for a in (self._kernels, self._dims, self._global, self._local)),
            self._has_local.ctypes.data,
            self._flush_after.ctypes.data,
            -1,
            0,
            None,
        )
        self.native = native

    def start(self, queue: Any, graph: Any) -> ReplayPlan:
        """Queue the launches on ``queue`` from a new thread and return this plan, whose ``join()`` must follow;
        ``graph`` (whose launches these are) stays alive until then."""
        self.job.queue = queue.int_ptr
        error = self.native.start_thread(ctypes.byref(self.job))
        if error:
            raise BackendError(f"OpenCL: could not start a thread to queue a replayed step (error {error})")
        _IN_FLIGHT[id(self)] = graph
        return self

    def join(self) -> None:
        """Wait for the thread; a launch the driver refused raises BackendError naming it."""
        try:
            status = self.native.join_thread(ctypes.byref(self.job))
        finally:
            _IN_FLIGHT.pop(id(self), None)
        if status:
            at = self.job.failed_at
            what = (
                f"kernel {self.names[at]} (launch {at + 1} of {len(self.names)})" if at < len(self.names) else "a flush"
            )
            raise BackendError(f"OpenCL: replaying a recorded step failed: {what} returned error {status}")


# The graphs of replays whose thread may still run (the kernels and the buffers they use), by plan: kept alive
# until joined, even if the model drops its graphs or the runtime is closed meanwhile. (One plan is never in
# flight twice: every use of the queue joins the replay first.)
_IN_FLIGHT: dict[int, Any] = {}


class NativeReplayer:
    """The compiled library and the OpenCL entry points its loop calls."""

    def __init__(self, library: Path, enqueue_address: int, flush_address: int):
        # start holds the GIL (pthread_create is quick: no hand-off to another thread and back); join releases it.
        self.start_thread = ctypes.PyDLL(str(library)).perfx_replay_start
        self.join_thread = ctypes.CDLL(str(library)).perfx_replay_join
        for function in (self.start_thread, self.join_thread):
            function.argtypes, function.restype = [ctypes.POINTER(_Job)], ctypes.c_int
        self.enqueue_address, self.flush_address = enqueue_address, flush_address

    def plan(self, launches: tuple) -> ReplayPlan:
        return ReplayPlan(self, launches)


def enabled() -> bool:
    return os.environ.get("PERFX_OPENCL_NATIVE_REPLAY", "1") != "0"


@functools.cache
def replayer() -> NativeReplayer | None:
    """The native replayer of this process, built on first use; None where it cannot be (see module docstring)."""
    if ctypes.sizeof(ctypes.c_size_t) != 8 or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    opencl = _opencl_library()
    if opencl is None:
        log.info("native replays off: the OpenCL library pyopencl uses was not found")
        return None
    try:
        entry = ctypes.CDLL(opencl)
        enqueue = ctypes.cast(entry.clEnqueueNDRangeKernel, ctypes.c_void_p).value
        flush = ctypes.cast(entry.clFlush, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        log.warning("native replays off: the OpenCL entry points of %s: %s", opencl, exc)
        return None
    for rebuild in (False, True):  # a cached library that does not load (e.g. another C library) is built again
        library = _build(rebuild)
        if library is None:
            return None
        try:
            return NativeReplayer(library, enqueue, flush)
        except (OSError, AttributeError) as exc:
            log.warning("native replays: loading %s failed: %s", library, exc)
    return None


def _opencl_library() -> str | None:
    """The OpenCL library pyopencl loaded into this process (from /proc/self/maps), else the system's."""
    import ctypes.util

    import pyopencl

    maps = Path("/proc/self/maps")
    if maps.exists():
        mapped = {
            parts[5] for parts in (line.split(maxsplit=5) for line in maps.read_text().splitlines()) if len(parts) == 6
        }
        loaded = sorted(path for path in mapped if Path(path).name.startswith("libOpenCL"))
        ours = [path for path in loaded if path.startswith(str(Path(pyopencl.__file__).parent))]
        if ours or loaded:
            return (ours or loaded)[0]
    return ctypes.util.find_library("OpenCL")


def _compiler() -> str | None:
    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def _build(rebuild: bool = False) -> Path | None:
    """The compiled library in the cache (built now if missing, or again with ``rebuild``), or None with the
    reason logged: a missing compiler or an unwritable cache leaves replays in Python, it is never an error."""
    compiler = _compiler()
    try:
        key = SOURCE.read_bytes() + f"{sys.platform} {os.uname().machine} {compiler}".encode()
        target = cache_dir() / "opencl-native" / f"replay-{hashlib.sha256(key).hexdigest()[:16]}.so"
        if target.exists() and not rebuild:
            return target
        if compiler is None:
            log.info("native replays off: no C compiler (set CC, or install cc/gcc/clang)")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: a concurrent process never loads a half-written library.
        handle, partial = tempfile.mkstemp(prefix="replay-", suffix=".so.partial", dir=target.parent)
        os.close(handle)
        try:
            command = [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", partial, str(SOURCE)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                log.warning("native replays off: %s failed: %s", " ".join(command), done.stderr.strip()[-2000:])
                return None
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native replays off: building %s failed: %s", SOURCE.name, exc)
        return None
    return target
