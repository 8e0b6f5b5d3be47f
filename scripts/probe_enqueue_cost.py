"""Host cost of queueing one OpenCL kernel through pyopencl, the floor under a replayed step's host time.

    python scripts/probe_enqueue_cost.py [--device N] [--launches 2000]

Times `enqueue_nd_range_kernel` of a tiny kernel in a loop: without flushes, flushing every 16 or 64 launches
(the runtime flushes every FLUSH_EVERY), then with a second Python thread busy (as the server's event loop is
while the scheduler thread queues a step) at three GIL switch intervals. Prints microseconds per launch.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import pyopencl as cl

SOURCE = "__kernel void bump(__global float* a, int n) { int i = get_global_id(0); if (i < n) a[i] += 1.0f; }"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0, help="index among all platforms' devices")
    parser.add_argument("--launches", type=int, default=2000)
    args = parser.parse_args()
    device = [d for platform in cl.get_platforms() for d in platform.get_devices()][args.device]
    context = cl.Context([device])
    queue = cl.CommandQueue(context)
    buffer = cl.Buffer(context, cl.mem_flags.READ_WRITE, 4 * 4096)
    kernels = []
    for _ in range(8):  # distinct kernel objects with their arguments set once, as the runtime's launch cache has
        kernel = cl.Kernel(cl.Program(context, SOURCE).build(), "bump")
        kernel.set_args(buffer, np.int32(4096))
        kernels.append(kernel)
    print(f"{device.name} ({device.platform.name})")

    def per_launch_us(flush_every: int) -> tuple[float, float]:
        queue.finish()
        start = time.perf_counter()
        for i in range(args.launches):
            cl.enqueue_nd_range_kernel(queue, kernels[i % 8], (4096,), (128,))
            if flush_every and i % flush_every == flush_every - 1:
                queue.flush()
        queued = time.perf_counter() - start
        queue.finish()
        return 1e6 * queued / args.launches, 1e6 * (time.perf_counter() - start) / args.launches

    for flush_every in (0, 16, 64):
        per_launch_us(flush_every)  # warm-up
        queued, finished = per_launch_us(flush_every)
        print(f"flush every {flush_every or '-':>2}: {queued:6.2f} us per launch queued, {finished:6.2f} to finish")
    stop = threading.Event()

    def busy() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    default_interval = sys.getswitchinterval()
    for interval in (0.005, 0.001, 0.0002):
        sys.setswitchinterval(interval)
        stop.clear()
        thread = threading.Thread(target=busy)
        thread.start()
        time.sleep(0.01)
        queued, _ = per_launch_us(16)
        stop.set()
        thread.join()
        print(f"a busy Python thread, switch interval {1e3 * interval:.1f} ms: {queued:6.2f} us per launch queued")
    sys.setswitchinterval(default_interval)


if __name__ == "__main__":
    main()
