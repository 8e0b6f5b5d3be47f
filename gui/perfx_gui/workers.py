"""Workers for long jobs (loading, generating, benchmarking): QObjects moved to their own QThread.

They talk to the window only through signals named after events, and check a cancel flag between steps
(between tokens while generating). ``thread_for`` gives each job a thread that quits when it is done.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from perfx_core.errors import PerfxError

from .facts import is_out_of_memory, model_facts

STATS_INTERVAL_S = 0.2  # how often a running generation reports live stats


def describe_error(exc: BaseException) -> str:
    """A one-line reason for the user: PerfxError messages are written for users; others get their type."""
    if isinstance(exc, PerfxError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory" + (f": {exc}" if str(exc) else "")
    return f"{type(exc).__name__}: {exc}"


class Worker(QObject):
    """Base: a cancel flag and a ``done`` signal emitted once ``run`` returns, whatever happened."""

    done = Signal()

    def __init__(self) -> None:
        super().__init__()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Ask the job to stop at its next check (safe to call from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @Slot()
    def run(self) -> None:
        try:
            self.work()
        finally:
            self.done.emit()

    def work(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def thread_for(worker: Worker) -> QThread:
    """A new QThread, not yet started, that runs ``worker`` and quits when the worker is done.

    Connect to its ``finished`` signal before starting it, so that a job that ends at once is still seen.
    """
    thread = QThread()
    worker.moveToThread(thread)
    thread.started.connect(worker.run)
    worker.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)  # quits even while the UI waits
    return thread


class LoadWorker(Worker):
    """Loads a model with perfx_core.load, warms it up, and reads its facts."""

    # Every signal carries the worker first, so the window can ignore a superseded job.
    phase_changed = Signal(object, str)
    model_loaded = Signal(object, object, object)  # (worker, perfx_core Model, ModelFacts)
    load_failed = Signal(object, str, bool)  # (worker, reason, out_of_memory)
    load_cancelled = Signal(object)

    def __init__(self, path: str | None, backend: str, device: Any, context_length: int, warm_up: bool = True):
        super().__init__()
        self.path, self.backend, self.device = path, backend, device
        self.context_length, self.warm_up = context_length, warm_up

    def work(self) -> None:
        import perfx_core
        from perfx_core.default_model import resolve_model_path

        model = None
        try:
            self.phase_changed.emit(self, "Finding the model file")
            path = resolve_model_path(self.path)
            self.phase_changed.emit(self, f"Reading weights onto {self.backend}")
            model = perfx_core.load(path, backend=self.backend, device=self.device, context_length=self.context_length)
            if self.cancelled:
                return self._cancelled(model)
            if self.warm_up:  # backends do one-time work (weight layouts, kernels) on first use: do it now
                self.phase_changed.emit(self, "Warming up")
                model.engine.prefill([model.tokenizer.bos_id or 0], slot=0)
                if self.cancelled:
                    return self._cancelled(model)
            self.phase_changed.emit(self, "Reading model facts")
            facts = model_facts(model)
            if self.cancelled:
                return self._cancelled(model)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the user, and the app live on
            if model is not None:
                model.close()
            if not isinstance(exc, (PerfxError, MemoryError)):
                traceback.print_exc()
            self.load_failed.emit(self, describe_error(exc), is_out_of_memory(exc))
            return
        self.model_loaded.emit(self, model, facts)

    def _cancelled(self, model) -> None:
        model.close()
        self.load_cancelled.emit(self)


class GenerationWorker(Worker):
    """Streams one chat reply; profiles the decode steps (not prefill) when asked."""

    # Every signal carries the worker first, so the window can ignore a superseded job.
    generation_started = Signal(object)
    token_generated = Signal(object, str)
    stats_updated = Signal(object, dict)
    generation_finished = Signal(object, dict)
    generation_failed = Signal(object, str)

    def __init__(self, model: Any, messages: list[dict], sampling: dict, profile: bool = False):
        super().__init__()
        self.model, self.messages, self.sampling, self.profile = model, messages, sampling, profile
        self._profiling = False
        self._decode_start = 0.0

    def work(self) -> None:
        model = self.model
        ops = model.runtime.ops
        try:
            generation = model.chat(self.messages, **self.sampling)
        except BaseException as exc:  # noqa: BLE001
            self.generation_failed.emit(self, describe_error(exc))
            return
        self.generation_started.emit(self)
        last_report = 0.0
        first = True
        try:
            for event in generation:
                if first:
                    first = False
                    self._decode_start = time.perf_counter()
                    if self.profile:  # profile the decode steps only: per-token numbers stay meaningful
                        ops.start_profiling()
                        self._profiling = True
                if event.text:
                    self.token_generated.emit(self, event.text)
                now = time.perf_counter()
                if now - last_report >= STATS_INTERVAL_S:
                    last_report = now
                    self.stats_updated.emit(self, self._snapshot(generation))
                if self.cancelled:
                    break
        except BaseException as exc:  # noqa: BLE001
            self.generation_failed.emit(self, describe_error(exc))
        finally:
            generation.close()
            profile = ops.stop_profiling() if self._profiling else None
            stats = self._snapshot(generation, profile)
            stats["finish_reason"] = "cancelled" if self.cancelled else generation.stats.finish_reason
            stats["decode_tokens_per_s"] = generation.stats.decode_tokens_per_s or stats["decode_tokens_per_s"]
            stats["peak_host_bytes"] = generation.stats.peak_host_bytes
            stats["text"] = generation.text
        self.generation_finished.emit(self, stats)

    def _snapshot(self, generation, profile=None) -> dict:
        s = generation.stats
        rt = self.model.runtime
        steps = max(0, s.generated_tokens - 1)
        profiled_steps = steps
        if profile is not None and "logits" in profile.calls:
            profiled_steps = int(profile.calls["logits"])  # one per forward pass, so per decoded token
        elapsed = time.perf_counter() - self._decode_start if self._decode_start else 0.0
        if profile is None and self._profiling and rt.ops.profile is not None:
            profile = rt.ops.profile
        return {
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "time_to_first_token_s": s.time_to_first_token_s,
            "prefill_tokens_per_s": s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0,
            "decode_tokens_per_s": steps / elapsed if steps and elapsed > 0 else 0.0,
            "decode_steps": profiled_steps,
            "device_bytes": rt.allocated_bytes,
            "device_peak_bytes": rt.peak_allocated_bytes,
            "op_profile": profile.as_dict() if profile is not None else None,
            "finish_reason": "",
        }


class BenchWorker(Worker):
    """Runs perfx_core.bench.run_bench on each (backend, device) in turn; cancel takes effect between them."""

    bench_progress = Signal(str)
    bench_result = Signal(dict)
    bench_failed = Signal(str, str)  # (backend, reason)

    def __init__(self, model_path: str | None, targets: list[tuple[str, Any]], settings: dict):
        super().__init__()
        self.model_path, self.targets, self.settings = model_path, targets, settings

    def work(self) -> None:
        from perfx_core.bench import run_bench

        for i, (backend, device) in enumerate(self.targets):
            if self.cancelled:
                return
            self.bench_progress.emit(f"Benchmarking {backend} ({i + 1}/{len(self.targets)})…")
            try:
                report = run_bench(self.model_path, backend=backend, device=device, **self.settings)
            except BaseException as exc:  # noqa: BLE001
                self.bench_failed.emit(backend, describe_error(exc))
                continue
            self.bench_result.emit(report)
