"""The Starlette app: OpenAI routes, /health, /metrics, API-key and body-size checks, SSE streaming.

The model loads in a background thread once the server listens (/health answers 503 until then); the
scheduler thread then owns it. Each request gets an asyncio.Queue that the scheduler fills through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import RequestCancelledError
from .admission import admit
from .choices import counts_prompt, generation_jobs
from .config import ServerConfig
from .embeddings import embeddings_endpoint
from .guard import GuardMiddleware, error_response, read_json, refusal
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import APIError, ParsedRequest, parse_request
from .responses import ChoiceResult, ResponseBuilder
from .responses_api import responses_endpoint
from .scheduler import Failed, Finished, GenerationRequest, PromptLogprobs, QueueFullError, Scheduler, TextDelta
from .tokenizer_routes import detokenize_body, tokenize_body, tokenizer_info_body

log = logging.getLogger("perfx.serving")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


class ServerState:
    """What the routes share: config, metrics, and (once loaded) the model and its scheduler."""

    def __init__(self, config: ServerConfig, on_load_failed: Callable[[BaseException], None] | None):
        self.config = config
        self.metrics = ServerMetrics()
        self.model: Any = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.on_load_failed = on_load_failed
        self._closed = False
        self._lock = threading.Lock()
        self._posts: dict[asyncio.AbstractEventLoop, _EventPost] = {}  # one per loop (one in a server)

    def event_post(self, loop: asyncio.AbstractEventLoop) -> _EventPost:
        """The scheduler-to-``loop`` hand-off shared by every request served on that loop."""
        with self._lock:
            post = self._posts.get(loop)
            if post is None:
                post = self._posts[loop] = _EventPost(loop)
            return post

    @contextmanager
    def held_events(self) -> Iterator[None]:
        """Events posted inside wait until the end to wake their loops (see _EventPost)."""
        with self._lock:
            posts = list(self._posts.values())
        for post in posts:
            post.hold()
        try:
            yield
        finally:
            for post in posts:
                post.release()

    def load(self) -> None:
        """Runs in a background thread: load the model, then start the scheduler that owns it."""
        import perfx_core

        c = self.config
        try:
            started = time.perf_counter()
            model = perfx_core.load(
                c.model_path,
                backend=c.backend,
                device=c.device,
                context_length=c.context_length,
                n_slots=c.max_running,
                prefill_chunk=c.prefill_chunk,
                kv_dtype=c.kv_dtype,
            )
            on_gpu = model.engine.rt.device.kind == "gpu"
            mixed_steps = c.mixed_steps if c.mixed_steps is not None else on_gpu
            # Kernels compile now (/health still 503), not while requests wait; the steps that are only recorded
            # (seconds more on a GPU) are recorded by the scheduler while it is idle.
            log.info("warming up (building kernels); /health answers 503 until it is done")
            warm_up = model.engine.warm_up_steps(mixed_steps=mixed_steps, mixed_chunk=c.mixed_chunk)
            for step in warm_up:
                if step != "kernels":
                    break
            scheduler = Scheduler(
                model.engine,
                model.tokenizer,
                max_queue=c.max_queue,
                prefill_chunk=c.prefill_chunk,
                metrics=self.metrics,
                mixed_steps=mixed_steps,
                mixed_chunk=c.mixed_chunk,
                overlap_output=c.overlap_output if c.overlap_output is not None else on_gpu,
                hold_events=self.held_events,
                idle_work=warm_up,
            )
            with self._lock:
                if self._closed:  # the server stopped while we were loading
                    model.close()
                    return
                self.model, self.scheduler = model, scheduler
                self.metrics.attach(scheduler)
                # The model, its kernels and its recorded steps are ~10^5 long-lived objects that a full garbage
                # collection would walk (~0.1 s on a small VM), stalling every stream at once. None of them is
                # garbage while the server runs, so they move out of the collector's view (close() undoes it).
                gc.collect()
                gc.freeze()
                scheduler.start()
            log.info(
                "loaded %s on %s in %.1f s; serving %d slots of %d tokens",
                c.model_path.name,
                model.backend,
                time.perf_counter() - started,
                c.max_running,
                model.context_length,
            )
        except BaseException as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("the model failed to load: %s", self.load_error)
            if self.on_load_failed is not None:
                self.on_load_failed(exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            scheduler, model = self.scheduler, self.model
        if scheduler is not None:
            scheduler.stop()
        if model is not None and (scheduler is None or scheduler.stopped):
            model.close()  # a step still running past stop()'s timeout keeps the model; the process is ending
            gc.unfreeze()  # what the model left in reference cycles can be collected again

    def ready_scheduler(self) -> Scheduler:
        if self.scheduler is None:
            why = f"the model failed to load ({self.load_error})" if self.load_error else "the model is still loading"
            raise APIError(503, f"{why}; poll /health until it answers 200", type="server_error", code="not_ready")
        return self.scheduler


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _EventPost:
    """Hands events from the scheduler thread to one event loop, waking the loop once per burst: a step emits
    a token to every running request at once, and one wake-up per event would have the loop's thread contend
    for the GIL with the scheduler's next step that many times. While held (the scheduler handling a step's
    text, Scheduler(hold_events=...)) events only queue up: woken at the first one, the loop's thread would
    take the GIL from the scheduler in the middle of that work (for up to the switch interval), delaying the
    tokens of every sequence after that point by as much."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False  # a _deliver is on its way and will take everything pending
        self._held = False

    def post(self, queue: asyncio.Queue, event: Any) -> None:  # scheduler thread
        with self._lock:
            self._pending.append((queue, event))
            if self._held or self._scheduled:
                return
            self._scheduled = True
        self._wake()

    def hold(self) -> None:  # scheduler thread
        self._held = True

    def release(self) -> None:  # scheduler thread
        with self._lock:
            self._held = False
            if not self._pending or self._scheduled:
                return
            self._scheduled = True
        self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            with self._lock:
                self._pending.clear()  # else every later post would wait behind this one forever
                self._scheduled = False

    def _deliver(self) -> None:  # event loop
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


class _Stream:
    """One request's hand-off from the scheduler thread to the event loop: (prompt index, event) pairs."""

    def __init__(self, post: _EventPost):
        self.post = post
        self.queue: asyncio.Queue = asyncio.Queue()

    def emitter(self, index: int) -> Callable[[Any], None]:
        def emit(event: Any) -> None:  # scheduler thread
            self.post.post(self.queue, (index, event))

        return emit


class _GenerationResponse(StreamingResponse):
    """An SSE response that cancels its generation however it ends, even if the client left before the body
    iterator started (an async generator that never ran has no ``finally`` to run)."""

    def __init__(self, content: AsyncIterator[str], jobs: list[GenerationRequest], scheduler: Scheduler):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.jobs, self.scheduler = jobs, scheduler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _cancel(self.scheduler, self.jobs)  # a no-op for finished requests: the scheduler let them go


def _cancel(scheduler: Scheduler, jobs: list[GenerationRequest]) -> None:
    for job in jobs:
        job.cancel()
    scheduler.wake()


def create_app(config: ServerConfig, on_load_failed: Callable[[BaseException], None] | None = None) -> ASGIApp:
    """The ASGI app serving ``config.model_path``. ``on_load_failed`` is called (in the loader thread) on failure."""
    state = ServerState(config, on_load_failed)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=state.load, name="perfx-model-loader", daemon=True).start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.close)

    async def health(request: Request) -> Response:
        if state.scheduler is not None:
            return JSONResponse({"status": "ok", "model": config.model_id})
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(name) for name in config.model_names]})

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(config.model_path.stat().st_mtime),
            "owned_by": "perfx",
            "max_model_len": state.model.context_length if state.model else None,
        }

    async def model_info(request: Request) -> Response:
        if request.path_params["model_id"] not in config.model_names:
            error = APIError(
                404, f"model {request.path_params['model_id']!r} is not served here", code="model_not_found"
            )
            return error_response(error)
        return JSONResponse(model_card(request.path_params["model_id"]))

    async def tokenize(request: Request) -> Response:
        return await _tokenizer_route(request, tokenize_body)

    async def detokenize(request: Request) -> Response:
        return await _tokenizer_route(request, detokenize_body)

    async def tokenizer_info(request: Request) -> Response:
        try:
            state.ready_scheduler()
        except APIError as error:
            return error_response(error)
        return JSONResponse(tokenizer_info_body(state.model, config.model_id))

    async def _tokenizer_route(request: Request, handler: Callable[..., dict]) -> Response:
        try:
            state.ready_scheduler()
            body = await read_json(request, config.header_timeout_s)
            result = await run_in_threadpool(handler, body, state.model)
        except APIError as error:
            return error_response(error)
        return JSONResponse(result)

    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        def parse(body: Any, name: str, cancelled: Callable[[], bool]) -> ParsedRequest:
            return parse_request(body, chat=chat, model_id=name, model=state.model, cancelled=cancelled)

        try:
            scheduler, _, _, parsed = await admit(state, request, parse)
        except APIError as error:
            return refusal(state.metrics, error)
        except RequestCancelledError:  # the client left while its prompt was being prepared
            return refusal(state.metrics, None)
        stream = _Stream(state.event_post(asyncio.get_running_loop()))
        jobs = generation_jobs(parsed, stream.emitter)  # n per prompt, sharing its prefill
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFullError as exc:
            _cancel(scheduler, jobs)  # the prompts already queued go too: the request is refused whole
            return refusal(state.metrics, APIError(429, str(exc), type="rate_limit_error", code="queue_full"))
        builder = ResponseBuilder(parsed, state.model.tokenizer)
        if parsed.stream:
            return _GenerationResponse(_stream_events(scheduler, jobs, stream, parsed, builder), jobs, scheduler)
        return await _whole_response(request, scheduler, jobs, stream, parsed, builder)

    async def _whole_response(
        request: Request,
        scheduler: Scheduler,
        jobs: list[GenerationRequest],
        stream: _Stream,
        parsed: ParsedRequest,
        builder: ResponseBuilder,
    ) -> Response:
        choices = [ChoiceResult(i, text=p.text if parsed.echo else "") for i, p in enumerate(parsed.prompts)]
        pieces: list[list[str]] = [[c.text] for c in choices]
        left = len(jobs)
        try:
            while left:
                try:
                    index, event = await asyncio.wait_for(stream.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        _cancel(scheduler, jobs)
                        return Response(status_code=499)
                    continue
                choice = choices[index]
                if isinstance(event, TextDelta):
                    pieces[index].append(event.text)
                    if event.logprob is not None:
                        choice.logprobs.append(event.logprob)
                elif isinstance(event, PromptLogprobs):
                    choice.logprobs[:0] = event.entries
                elif isinstance(event, Finished):
                    choice.finish_reason = event.finish_reason
                    choice.completion_tokens = event.completion_tokens
                    choice.prompt_tokens = event.prompt_tokens if counts_prompt(parsed, index) else 0
                    left -= 1
                elif isinstance(event, Failed):
                    _cancel(scheduler, jobs)
                    return error_response(APIError(500, event.message, type="server_error"))
        except BaseException:
            _cancel(scheduler, jobs)
            raise
        for choice, texts in zip(choices, pieces, strict=True):
            choice.text = "".join(texts)
        return JSONResponse(builder.whole(choices))

    async def _stream_events(
        scheduler: Scheduler,
        jobs: list[GenerationRequest],
        stream: _Stream,
        parsed: ParsedRequest,
        builder: ResponseBuilder,
    ) -> AsyncIterator[str]:
        finished = 0
        offsets = [0] * len(jobs)  # characters of each choice's text streamed so far (completions' text_offset)
        usage = [0, 0]
        try:
            for index, prompt in enumerate(parsed.prompts):
                if parsed.chat:
                    yield _sse(builder.chunk(None, first=True, index=index))
                elif parsed.echo:
                    offsets[index] = len(prompt.text)
                    if parsed.logprobs is None:
                        yield _sse(builder.chunk(prompt.text, index=index))
            while finished < len(jobs):
                index, event = await stream.queue.get()
                if isinstance(event, TextDelta):
                    logprobs = (event.logprob,) if event.logprob is not None else ()
                    chunk = builder.chunk(event.text, index=index, logprobs=logprobs, text_offset=offsets[index])
                    if chunk is not None:
                        yield _sse(chunk)
                    offsets[index] += len(event.text)
                elif isinstance(event, PromptLogprobs):  # echo with logprobs: the prompt's text and its scores
                    text = parsed.prompts[index].text
                    yield _sse(builder.chunk(text, index=index, logprobs=event.entries))
                elif isinstance(event, Finished):
                    finished += 1
                    usage[0] += event.prompt_tokens if counts_prompt(parsed, index) else 0
                    usage[1] += event.completion_tokens
                    yield _sse(builder.chunk(None, event.finish_reason, index=index))
                elif isinstance(event, Failed):
                    finished = len(jobs)
                    _cancel(scheduler, jobs)
                    yield _sse(APIError(500, event.message, type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
            if parsed.include_usage:
                yield _sse(builder.usage_chunk(*usage))
            yield "data: [DONE]\n\n"
        finally:
            if finished < len(jobs):  # the client went away (the send failed or Starlette cancelled us)
                _cancel(scheduler, jobs)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(
            APIError(
                exc.status_code,
                str(exc.detail),
                type="not_found_error" if exc.status_code == 404 else "invalid_request_error",
            )
        )

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/models/{model_id:path}", model_info),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings_endpoint(state), methods=["POST"]),
            Route("/v1/responses", responses_endpoint(state), methods=["POST"]),
        ],
        exception_handlers={HTTPException: on_http_error, APIError: on_api_error},
        lifespan=lifespan,
    )
    app.state.perfx = state
    guarded = GuardMiddleware(app, config)
    if not config.allowed_origins:
        return guarded
    # Outside the guard: a browser's preflight carries no API key, and error answers need the CORS headers too.
    return CORSMiddleware(
        guarded,
        allow_origins=list(config.allowed_origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],  # the openai SDK sends x-stainless-* headers besides Authorization and Content-Type
        max_age=600,
    )
