"""Per-step timing of a running server, for finding where a serving step's time goes.

Python imports ``sitecustomize`` at start-up from the first directory on its path that has one, so with this
directory on PYTHONPATH every Python process started under it runs the hooks below when PERFX_TRACE_STEPS names a
file. ``bench_serving.py --trace-steps FILE`` starts its server that way and prints the summary at the end:

    python benchmarks/bench_serving.py --backend opencl --trace-steps steps.jsonl ...
    python benchmarks/step_trace/summarize_steps.py steps.jsonl        # the summary again

Each scheduler step (Scheduler._step, which runs at most one prompt chunk and one decode or mixed step) becomes
one JSON line: the rows running, its wall time, the time inside the OpenCL runtime's graph replays (queueing
the kernels) and read-backs (waiting for the device), the time taking the rows' tokens (Scheduler._take_rows:
sampling bookkeeping, ends) and sending text (Scheduler._send_texts: detokenizing, stop strings, posting
events), the gap since the previous step, and when the step's text went out (``sent``: the perf_counter of the
first _send_texts call that had text; with overlapped output that is the previous step's text, sent after
this step was queued), from which summarize_steps.py gets the gaps between sends; the requests admitted just
before the step (``admitted``), the requests submitted by the HTTP side while it ran (``submitted``: their
parsing competes with the scheduler thread for the GIL) and the garbage collector's seconds inside it
(``gc``). With PERFX_OPENCL_PROFILE=1 it also has
the step's launches (steps that replay a recorded graph: not a step that records one or only prefills), the span
from its first kernel's start to its last kernel's end, and the kernels' summed
device time (busy) in all and per kernel name: span minus busy is the device idling inside the step. Lines are
appended once a second from a background thread, so the scheduler thread does no file I/O.

Being a ``sitecustomize``, it hides any other one further down the path (e.g. a distribution's) while in use.
"""

import atexit
import gc
import json
import os
import threading
import time

PATH = os.environ.get("PERFX_TRACE_STEPS")


def _install(path: str) -> None:
    try:
        from perfx_opencl import runtime

        from perfx_core.serving import scheduler
    except ImportError:  # a process without perfx (e.g. a tool started under the same PYTHONPATH): no trace
        return

    rows: list[dict] = []
    step: dict = {}  # the step being timed
    last_end = [0.0]
    between: dict = {"admitted": 0, "submitted": 0, "gc": 0.0}  # counted until the next step takes them
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        elif gc_start[0]:
            between["gc"] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)

    def timed(owner, name: str, field: str):
        original = getattr(owner, name)

        def wrapper(self, *args, **kwargs):
            if field == "replay" and self.kernel_events is not None and "first_event" not in step:
                step["first_event"], step["runtime"] = len(self.kernel_events), self
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                step[field] = step.get(field, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(runtime.OpenCLRuntime, "replay", "replay")
    timed(runtime.OpenCLRuntime, "to_numpy", "read")
    timed(scheduler.Scheduler, "_take_rows", "take")
    timed(scheduler.Scheduler, "_send_texts", "send")
    original_mixed, original_step = scheduler.Scheduler._queue_mixed_step, scheduler.Scheduler._step
    original_send = scheduler.Scheduler._send_texts
    original_admit, original_submit = scheduler.Scheduler._admit, scheduler.Scheduler.submit

    def admit(self):
        waiting = len(self._waiting)
        result = original_admit(self)
        between["admitted"] += waiting - len(self._waiting)
        return result

    def submit(self, request):  # an HTTP thread
        between["submitted"] += 1
        return original_submit(self, request)

    def mixed_step(self, *args, **kwargs):
        step["kind"] = "mixed"
        return original_mixed(self, *args, **kwargs)

    def send_texts(self):
        if "sent" not in step and any(seq.unsent for seq in self._running):
            step["sent"] = time.perf_counter()
        return original_send(self)

    def one_step(self):
        step.clear()
        admitted, between["admitted"] = between["admitted"], 0
        running, start = len(self._running), time.perf_counter()
        result = original_step(self)
        end = time.perf_counter()
        row = {"kind": step.get("kind", "plain"), "running": running, "total": end - start, "admitted": admitted}
        row["start"] = start
        row["submitted"], between["submitted"] = between["submitted"], 0
        row["gc"], between["gc"] = between["gc"], 0.0
        row["gap"] = start - last_end[0] if last_end[0] else None
        row.update({field: step.get(field, 0.0) for field in ("replay", "read", "take", "send")})
        row["sent"] = step.get("sent")
        if "first_event" in step:  # the device's view of the step, from the profiling events
            events = step["runtime"].kernel_events[step["first_event"] :]
            if events:
                starts = [event.profile.start for _, event in events]
                ends = [event.profile.end for _, event in events]
                busy = sum(e - s for s, e in zip(starts, ends, strict=True))
                row.update(launches=len(events), gpu_span=(max(ends) - min(starts)) * 1e-9, gpu_busy=busy * 1e-9)
                by_kernel: dict[str, float] = {}
                for (name, _), s, e in zip(events, starts, ends, strict=True):
                    by_kernel[name] = by_kernel.get(name, 0.0) + (e - s) * 1e-9
                row["gpu_by_kernel"] = by_kernel
            step["runtime"].kernel_events.clear()  # a server profiles for as long as it runs: keep it bounded
        rows.append(row)
        last_end[0] = time.perf_counter()
        return result

    scheduler.Scheduler._queue_mixed_step, scheduler.Scheduler._step = mixed_step, one_step
    scheduler.Scheduler._send_texts = send_texts  # (wrapping the timed wrapper)
    scheduler.Scheduler._admit, scheduler.Scheduler.submit = admit, submit

    def flush() -> None:
        done = rows[:]
        del rows[: len(done)]
        if done:
            with open(path, "a") as out:
                out.writelines(json.dumps(row) + "\n" for row in done)

    def flush_every_second() -> None:
        while True:
            time.sleep(1.0)
            flush()

    threading.Thread(target=flush_every_second, daemon=True, name="perfx-step-trace").start()
    atexit.register(flush)  # a server stopped by a signal may skip it: then up to a second of steps is lost


if PATH:
    _install(PATH)
