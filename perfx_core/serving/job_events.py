"""Running scheduler jobs from a route outside app.py (embeddings, responses): submit them, read their events
on the event loop through the server's shared hand-off (ServerState.event_post), and cancel them whenever the
route ends before they do (the client left, an error)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import APIError
from .scheduler import GenerationRequest, QueueFullError, Scheduler

DISCONNECT_POLL_S = 0.5  # how often a request that is not streaming checks whether its client is still there
T = TypeVar("T")


class ServingState(Protocol):
    """What these routes use of the server's shared state (app.ServerState)."""

    config: ServerConfig
    metrics: ServerMetrics
    model: Any

    def ready_scheduler(self) -> Scheduler: ...

    def event_post(self, loop: asyncio.AbstractEventLoop) -> Any: ...


class ClientGone(Exception):
    """The client closed its connection while its request waited: its jobs are cancelled."""


class JobRun:
    """One HTTP request's jobs and their events, as (job index, event) pairs."""

    def __init__(self, state: ServingState, scheduler: Scheduler):
        self.scheduler = scheduler
        self._post = state.event_post(asyncio.get_running_loop())
        self._queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list[GenerationRequest] = []

    def emitter(self, index: int) -> Callable[[Any], None]:
        def emit(event: Any) -> None:  # scheduler thread
            self._post.post(self._queue, (index, event))

        return emit

    def submit(self, jobs: Sequence[GenerationRequest]) -> None:
        """Queue ``jobs``; when the scheduler is full every job of this run is cancelled and a 429 raised."""
        self.jobs.extend(jobs)
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except QueueFullError as exc:
            self.cancel()
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None

    async def next_event(self, request: Request | None = None) -> tuple[int, Any]:
        """The next (job index, event). With ``request``, raises ClientGone once its client has left."""
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.cancel()
                    raise ClientGone from None

    def cancel(self) -> None:
        """A no-op for jobs that have finished: the scheduler has let them go."""
        for job in self.jobs:
            job.cancel()
        self.scheduler.wake()


class JobStreamResponse(StreamingResponse):
    """Server-sent events that cancel the run's jobs however the response ends, even when the client left before
    the body started (an async generator that never ran has no ``finally``)."""

    def __init__(self, content: AsyncIterator[str], run: JobRun):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()


async def off_loop(request: Request, work: Callable[[Callable[[], bool]], T]) -> T:
    """``work(cancelled)`` in a worker thread (tokenizing, rendering a chat template), with ``cancelled()`` turning
    true when the client goes away meanwhile."""
    gone = threading.Event()
    task = asyncio.ensure_future(run_in_threadpool(work, gone.is_set))
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            gone.set()
    return task.result()
