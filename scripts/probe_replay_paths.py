"""What queueing one kernel costs on this host, by path, alone and while a second Python thread is busy (as a
server's HTTP loop is): pyopencl's enqueue, the OpenCL call through ctypes holding the GIL (PyDLL) and releasing
it (CDLL); and whether the driver has command buffers (cl_khr_command_buffer), which would replay a whole step in
one call. Prints microseconds per launch. (Why perfx_opencl queues replays from a native thread: docs/opencl.md,
session 9.)

    python scripts/probe_replay_paths.py [any]     # "any": also a CPU device (PoCL), else the first GPU
"""

import ctypes
import ctypes.util
import glob
import os
import shutil
import sys
import threading
import time
from ctypes import POINTER, byref, c_int, c_size_t, c_uint, c_void_p

import numpy as np
import pyopencl as cl

which = sys.argv[1] if len(sys.argv) > 1 else "gpu"
dev = next(d for p in cl.get_platforms() for d in p.get_devices() if (d.type & cl.device_type.GPU) or which == "any")
print(dev.name, "|", dev.platform.name, dev.platform.version, "|", dev.version, "| driver", dev.driver_version)
print("command buffer exts:", [e for e in dev.extensions.split() if "command_buffer" in e])
try:
    print("ext versions:", [(e.name, e.version) for e in dev.extensions_with_version if "command" in e.name])
except Exception as exc:
    print("no extensions_with_version", exc)
print("gcc:", shutil.which("gcc"), shutil.which("cc"), "numpy", np.__version__, "python", sys.version.split()[0])
ctx = cl.Context([dev])
q = cl.CommandQueue(ctx)
SRC = "__kernel void bump(__global float* a, int n) { int i = get_global_id(0); if (i < n) a[i] += 1.0f; }"
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 4096)
prg = cl.Program(ctx, SRC).build()
kernels = []
for _ in range(8):
    k = cl.Kernel(prg, "bump")
    k.set_args(buf, np.int32(4096))
    kernels.append(k)
N = 2000
libs = glob.glob(os.path.join(os.path.dirname(cl.__file__), ".libs", "libOpenCL*")) or [
    ctypes.util.find_library("OpenCL")
]
print("lib", libs[0])


def load(kind):
    lib = kind(libs[0])
    f = lib.clEnqueueNDRangeKernel
    f.argtypes = [c_void_p, c_void_p, c_uint, c_void_p, c_void_p, c_void_p, c_uint, c_void_p, c_void_p]
    f.restype = c_int
    fl = lib.clFlush
    fl.argtypes = [c_void_p]
    fl.restype = c_int
    return lib, f, fl


gsize = (c_size_t * 1)(4096)
lsize = (c_size_t * 1)(128)
qp = q.int_ptr
kps = [k.int_ptr for k in kernels]


def run_pyopencl():
    for i in range(N):
        cl.enqueue_nd_range_kernel(q, kernels[i & 7], (4096,), (128,))
        if i % 16 == 15:
            q.flush()


def make_ctypes(kind):
    _, f, fl = load(kind)

    def run():
        for i in range(N):
            f(qp, kps[i & 7], 1, None, gsize, lsize, 0, None, None)
            if i % 16 == 15:
                fl(qp)

    return run


paths = {"pyopencl": run_pyopencl, "ctypes_pydll": make_ctypes(ctypes.PyDLL), "ctypes_cdll": make_ctypes(ctypes.CDLL)}


def timed(run):
    q.finish()
    t = time.perf_counter()
    run()
    queued = time.perf_counter() - t
    q.finish()
    return 1e6 * queued / N


sys.setswitchinterval(0.001)
for name, run in paths.items():
    timed(run)
    alone = min(timed(run) for _ in range(3))
    stop, count = threading.Event(), [0]

    def busy(stop: threading.Event = stop, count: list = count) -> None:
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=busy)
    th.start()
    time.sleep(0.01)
    c0 = count[0]
    t0 = time.perf_counter()
    contended = [timed(run) for _ in range(3)]
    rate = (count[0] - c0) / (time.perf_counter() - t0)
    stop.set()
    th.join()
    print(
        f"{name:>13}: alone {alone:6.2f} us/launch; with a busy thread {min(contended):6.2f}-{max(contended):6.2f} us"
        f" (busy thread {rate / 1e6:.2f} M iter/s)"
    )

# command buffers
ext = [e for e in dev.extensions.split() if e == "cl_khr_command_buffer"]
if ext:
    lib, f, fl = load(ctypes.CDLL)
    gaddr = lib.clGetExtensionFunctionAddressForPlatform
    gaddr.argtypes = [c_void_p, ctypes.c_char_p]
    gaddr.restype = c_void_p

    def fn(name, restype, *argtypes):
        addr = gaddr(dev.platform.int_ptr, name.encode())
        if not addr:
            raise SystemExit(f"no {name}")
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)

    create = fn("clCreateCommandBufferKHR", c_void_p, c_uint, POINTER(c_void_p), c_void_p, POINTER(c_int))
    command = fn(
        "clCommandNDRangeKernelKHR",
        c_int,
        c_void_p,
        c_void_p,
        c_void_p,
        c_void_p,
        c_uint,
        c_void_p,
        c_void_p,
        c_void_p,
        c_uint,
        c_void_p,
        c_void_p,
        c_void_p,
    )
    finalize = fn("clFinalizeCommandBufferKHR", c_int, c_void_p)
    enqueue = fn("clEnqueueCommandBufferKHR", c_int, c_uint, POINTER(c_void_p), c_void_p, c_uint, c_void_p, c_void_p)
    queues = (c_void_p * 1)(qp)
    err = c_int(0)
    for n in (256,):
        cb = create(1, queues, None, byref(err))
        print("create", err.value, bool(cb))
        for i in range(n):
            rc = command(cb, None, None, kps[i & 7], 1, None, gsize, lsize, 0, None, None, None)
            if rc:
                print("command rc", rc)
                break
        print("finalize", finalize(cb))
        host = np.zeros(4096, np.float32)
        cl.enqueue_copy(q, buf, host)
        q.finish()
        for _ in range(3):
            t = time.perf_counter()
            rc = enqueue(0, None, cb, 0, None, None)
            t1 = time.perf_counter()
            q.finish()
            t2 = time.perf_counter()
            print(f"cb of {n}: enqueue rc {rc} {1e6 * (t1 - t):.1f} us, finish after {1e6 * (t2 - t1):.1f} us")
        cl.enqueue_copy(q, host, buf)
        q.finish()
        print("value after", host[0], "expected", 3 * n)
        # individual launches of the same n for comparison (device time)
        t = time.perf_counter()
        for i in range(n):
            f(qp, kps[i & 7], 1, None, gsize, lsize, 0, None, None)
        fl(qp)
        t1 = time.perf_counter()
        q.finish()
        t2 = time.perf_counter()
        print(f"individual {n}: queue {1e6 * (t1 - t):.1f} us, finish after {1e6 * (t2 - t1):.1f} us")
