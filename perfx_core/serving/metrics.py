"""Prometheus metrics of one server: load, tokens in and out, latency histograms and KV-cache slot use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class SchedulerState(Protocol):
    """What the gauges read from the scheduler they are attached to (serving.scheduler.Scheduler), named here so
    that the scheduler depends on its metrics and not the other way round."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def slots_used(self) -> int: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def engine(self) -> Any: ...  # its .recordings


CONTENT_TYPE = CONTENT_TYPE_LATEST
# Fine below 20 ms: a GPU decode step takes 3-10 ms, and the p99 of inter-token gaps is read from these (by
# linear interpolation inside a bucket, so to within a bucket's width: 0.25 ms from 1 to 12 ms).
LATENCY_BUCKETS = (
    *(i / 4000 for i in range(4, 49)),  # 1 .. 12 ms by 0.25 ms
    0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60,
)  # fmt: skip


class ServerMetrics:
    """The metrics, in a registry of their own so several servers can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._scheduler: SchedulerState | None = None
        r = self.registry
        self.prompt_tokens = Counter("perfx_prompt_tokens", "Prompt tokens admitted for prefill", registry=r)
        self.prompt_tokens_cached = Counter(
            "perfx_prompt_tokens_cached",
            "Prompt tokens found in a slot's prefix cache, not prefilled again (hit rate: over perfx_prompt_tokens)",
            registry=r,
        )
        self.generation_tokens = Counter("perfx_generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter(
            "perfx_requests_finished", "Requests ended, by finish reason", ["finish_reason"], registry=r
        )
        self.requests_rejected = Counter(
            "perfx_requests_rejected", "Requests refused before queueing, by HTTP status", ["status"], registry=r
        )
        self.time_to_first_token = Histogram(
            "perfx_time_to_first_token_seconds",
            "From request arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "perfx_inter_token_latency_seconds",
            "Between consecutive tokens of one request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_batch_size = Histogram(
            "perfx_decode_batch_size",
            "Sequences in each batched decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.engine_seconds = Histogram(
            "perfx_engine_step_seconds",
            "Engine time of each scheduler step, by kind (a prefill chunk, a batched decode)",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._gauge("perfx_model_loaded", "1 once the model is loaded and serving", lambda s: 1)
        self._gauge("perfx_requests_running", "Requests holding a KV-cache slot", lambda s: s.running)
        self._gauge("perfx_requests_waiting", "Requests queued for a slot", lambda s: s.waiting)
        self._gauge("perfx_kv_cache_slots_used", "KV-cache slots in use", lambda s: s.slots_used)
        self._gauge("perfx_kv_cache_slots_total", "KV-cache slots (= --max-running)", lambda s: s.n_slots)
        self._gauge("perfx_max_decode_batch_size", "Largest decode batch so far", lambda s: s.max_batch_size)
        self._gauge(
            "perfx_engine_step_recordings",
            "Engine steps recorded as graphs since start (after warm-up each one is a slow first step)",
            lambda s: s.engine.recordings,
        )

    def _gauge(self, name: str, doc: str, read: Callable[[SchedulerState], float]) -> None:
        gauge = Gauge(name, doc, registry=self.registry)
        gauge.set_function(lambda: float(read(self._scheduler)) if self._scheduler is not None else 0.0)

    def attach(self, scheduler: SchedulerState) -> None:
        self._scheduler = scheduler

    def render(self) -> bytes:
        return generate_latest(self.registry)
