"""The two Ray Serve deployments of ``perfx serve --ray`` and how they are put together (``build_app``).

``PerfxEngine``: one replica per engine. It loads the model (its __init__ returns once /health would say 200, so
Serve routes nothing to it before), runs perfx's ASGI app in-process and streams each request's ASGI messages
back, with ``x-perfx-replica`` on every response.

``PerfxIngress``: Serve's HTTP proxy hands it every request. It applies the same guard as ``perfx serve`` (Host,
API key, Content-Type, body size), reads the body, keys it by prompt prefix and forwards it through the engine's
handle (router.PrefixAffinityRouter picks the replica). /health and /metrics it answers from every replica.
A replica that dies before answering is replaced in the request by another (nothing was sent, so nothing can
be repeated); one that dies while streaming ends that stream with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import uvicorn
from prometheus_client import CollectorRegistry, Counter
from ray import serve
from ray.exceptions import ActorDiedError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send
from uvicorn.lifespan.on import LifespanOn

from ..app import create_app
from ..config import ServeError, ServerConfig
from ..guard import GuardMiddleware, allowed_hosts
from ..protocol import APIError
from . import live_replicas, router
from .asgi_bridge import ForwardedRequest, add_headers, call_app
from .devices import replica_device, replica_gpus
from .metrics_merge import ReplicaMetrics, merge
from .prefix_key import prefix_key
from .settings import ReplicaSettings

log = logging.getLogger("perfx.serving")
APP_NAME = "perfx"
REPLICA_HEADER = b"x-perfx-replica"
INGRESS_ID = b"ingress"  # the header's value on answers no engine replica gave (a request refused at the door)
SWITCH_INTERVAL_S = 0.001  # the GIL switch interval of a serving process, as `perfx serve` sets it
CONTROL_HEADROOM = 8  # requests a replica takes beyond --max-running + --max-queue: /health, /metrics, /tokenize
CONTROL_TIMEOUT_S = 5.0  # for one replica's /health or /metrics
ANY_REPLICA_TIMEOUT_S = 1.0  # for /health or /metrics from whichever replica, before the router knows any
CONTROL_POLL_S = 0.05  # how often a wait for one replica's answer checks that the replica is still there
RETRIES_BEFORE_RESPONSE = 2  # other replicas tried when the one chosen died before answering
GRACEFUL_SHUTDOWN_S = 120.0  # a replica scaled down finishes its streams for up to this long
_JSON = (b"content-type", b"application/json")


@serve.deployment(name="PerfxEngine")
class PerfxEngine:
    async def __init__(self, config: ServerConfig, model_size: int, bundled_model: bool):
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the scheduler's steps wait less for the event loop's thread
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        config = _config_on_this_node(config, model_size, bundled_model, self.node)
        if config.device is None:
            config = replace(config, device=_reserved_device(config.backend))
        self.config = config
        self.headers = [(REPLICA_HEADER, self.replica.encode())]
        self._control_headers = _control_headers(config)
        self.app = create_app(config)
        self.lifespan = LifespanOn(uvicorn.Config(self.app, lifespan="on", log_config=None))
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise ServeError(f"perfx's app failed to start on replica {self.replica}")
        while True:  # /health answers 503 while the model loads in its thread
            status, body = await self._get("/health")
            if status == 200:
                break
            if body.get("status") == "error":
                raise ServeError(f"the model failed to load on replica {self.replica} ({self.node}): {body['error']}")
            await asyncio.sleep(0.1)
        log.info("replica %s on %s (pid %d) serves %s", self.replica, self.node, os.getpid(), config.model_id)

    async def handle_request(self, request: ForwardedRequest, prefix_key: str | None = None):
        """The response to ``request`` as batches of ASGI messages (``prefix_key`` is for the router)."""
        async for batch in call_app(self.app, request, self.headers):
            yield batch

    async def health(self, replica_id: str | None = None) -> dict[str, Any]:
        status, body = await self._get("/health")
        return {"replica": self.replica, "ok": status == 200, **body}

    async def replica_metrics(self, replica_id: str | None = None) -> ReplicaMetrics:
        _, text = await self._get("/metrics", parse=False)
        return ReplicaMetrics(self.replica, self.node, os.getpid(), text)

    async def check_health(self) -> None:
        """Serve's periodic health check: a replica whose server stopped serving is replaced."""
        status, body = await self._get("/health")
        if status != 200:
            raise ServeError(f"replica {self.replica} is not serving: {body}")

    async def __del__(self) -> None:
        if hasattr(self, "lifespan"):  # (not when __init__ failed before starting the app)
            await self.lifespan.shutdown()  # the scheduler stops and the model is closed

    async def _get(self, path: str, parse: bool = True) -> tuple[int, Any]:
        """GET ``path`` from this replica's own app, with the API key: (status, JSON body or text)."""
        status, chunks = 500, []
        async for batch in call_app(self.app, ForwardedRequest("GET", path, headers=self._control_headers)):
            for message in batch:
                if message["type"] == "http.response.start":
                    status = message["status"]
                elif message["type"] == "http.response.body":
                    chunks.append(message.get("body", b""))
        text = b"".join(chunks).decode()
        return status, (json.loads(text) if parse else text)


@serve.deployment(name="PerfxIngress")
@serve.ingress()
class PerfxIngress:
    def __init__(self, engine: DeploymentHandle, config: ServerConfig):
        self.engine, self.config = engine, config
        self.streams = engine.options(stream=True)
        self.app_name = serve.get_replica_context().app_name
        self.open_requests = 0
        self.registry = CollectorRegistry()
        self.retries = Counter(
            "perfx_ingress_retries",
            "Requests sent to another replica because theirs died before answering",
            registry=self.registry,
        )
        self.failures = Counter(
            "perfx_ingress_replica_failures",
            "Requests ended by their replica's death, by whether it had started answering",
            ["stage"],
            registry=self.registry,
        )

    def __serve_build_asgi_app__(self):
        return _with_ingress_header(GuardMiddleware(self._route, self.config))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served
        if self.open_requests >= self.config.limit_concurrency:
            await _send_error(send, APIError(503, "too many open requests; retry later", code="overloaded"))
            return
        self.open_requests += 1
        try:
            path, method = scope["path"], scope["method"]
            if path == "/health" and method in ("GET", "HEAD"):
                await self._health(send)
            elif path == "/metrics" and method in ("GET", "HEAD"):
                await self._metrics(send)
            else:
                await self._forward(scope, receive, send)
        finally:
            self.open_requests -= 1

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await asyncio.wait_for(_read_body(receive), self.config.header_timeout_s)
        except asyncio.TimeoutError:
            error = APIError(408, f"the request body did not arrive within {self.config.header_timeout_s:g} s")
            await _send_error(send, error)
            return
        except APIError as error:  # the guard's body limit
            await _send_error(send, error)
            return
        if body is None:
            return  # the client left while sending its body
        request = ForwardedRequest(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
            body=body,
            client=tuple(scope["client"]) if scope.get("client") else None,
            server=tuple(scope["server"]) if scope.get("server") else None,
            scheme=scope.get("scheme", "http"),
        )
        key = prefix_key(request.path, body) if request.method == "POST" else None
        for attempt in range(RETRIES_BEFORE_RESPONSE + 1):
            responses = self.streams.handle_request.remote(request, prefix_key=key)
            started = streaming = False
            try:
                async for batch in responses:
                    for message in batch:
                        if message["type"] == "http.response.start":
                            started = True
                            streaming = b"text/event-stream" in dict(message.get("headers", ())).get(
                                b"content-type", b""
                            )
                        await send(message)
                return
            except RayActorError as exc:
                if not started and isinstance(exc, ActorDiedError) and attempt < RETRIES_BEFORE_RESPONSE:
                    self.retries.inc()
                    continue
                self.failures.labels("streaming" if started else "before_response").inc()
                await _replica_failed(send, started, streaming, exc)
                return
            finally:
                responses.cancel()  # a no-op once it has ended; stops the replica's work when we leave early

    async def _health(self, send: Send) -> None:
        answers = [a for a in await self._ask_every_replica(self.engine.health) if a is not None]
        ready = [a["replica"] for a in answers if a["ok"]]
        if ready:
            body = {"status": "ok", "model": self.config.model_id, "replicas": len(ready)}
            await _send_json(send, 200, body, ",".join(ready).encode())
            return
        errors = [a.get("error") for a in answers if a.get("error")]
        body = {"status": "error" if errors else "loading", "error": errors[0] if errors else None, "replicas": 0}
        await _send_json(send, 503, body, b",".join(a["replica"].encode() for a in answers) or INGRESS_ID)

    async def _metrics(self, send: Send) -> None:
        replicas = [m for m in await self._ask_every_replica(self.engine.replica_metrics) if m is not None]
        text = merge(replicas, extra=self.registry.collect())
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        headers.append((REPLICA_HEADER, ",".join(m.replica for m in replicas).encode() or INGRESS_ID))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": text})

    async def _ask_every_replica(self, method: Any) -> list[Any]:
        """``method``'s answer from every engine replica this process routes to (from any one while the router
        has not heard of them yet); None for those that did not answer in time. One after another: calls made
        while serving one request share its Serve request id, by which the router hands out the replica it found,
        so concurrent calls could take each other's replicas."""
        targets: tuple[str | None, ...] = live_replicas.live_replicas(self.app_name) or (None,)
        return [await self._ask(method, target) for target in targets]

    async def _ask(self, method: Any, target: str | None) -> Any:
        """``method``'s answer from replica ``target``; None if it fails, takes longer than CONTROL_TIMEOUT_S, or
        the router drops the replica meanwhile (it died: no use waiting). ``target`` None: any replica, within
        ANY_REPLICA_TIMEOUT_S (there may be none yet: /health must say so quickly)."""
        response = method.remote(replica_id=target)

        async def result() -> Any:
            return await response

        answer = asyncio.ensure_future(result())
        deadline = time.monotonic() + (CONTROL_TIMEOUT_S if target is not None else ANY_REPLICA_TIMEOUT_S)
        try:
            while not (await asyncio.wait({answer}, timeout=CONTROL_POLL_S))[0]:
                gone = target is not None and target not in live_replicas.live_replicas(self.app_name)
                if gone or time.monotonic() > deadline:
                    log.warning("replica %s: no answer (%s)", target or "(any)", "gone" if gone else "timed out")
                    return None
            return answer.result()
        except (ray.exceptions.RayError, ServeError) as exc:
            log.warning("replica %s failed to answer: %r", target or "(any)", exc)
            return None
        finally:
            if not answer.done():
                response.cancel()
                answer.cancel()
                answer.add_done_callback(_retrieve)  # its RequestCancelledError is expected: not worth a log line


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def build_app(
    config: ServerConfig, settings: ReplicaSettings, *, cluster_gpus: float = 0.0, bundled_model: bool = False
) -> serve.Application:
    """The Serve application: ingress and engine deployments with their replicas, resources and router."""
    gpus = replica_gpus(config.backend, cluster_gpus, settings.gpus)
    engine = PerfxEngine.options(
        ray_actor_options={
            "num_cpus": settings.cpus,
            "num_gpus": gpus,
            "runtime_env": {"env_vars": {**settings.thread_env(gpus), **settings.env}},
        },
        max_ongoing_requests=config.max_running + config.max_queue + CONTROL_HEADROOM,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5,
        health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=router.PrefixAffinityRouter,
            request_router_kwargs={"slots": config.max_running},
        ),
        **_replica_count(config, settings),
    )
    ingress = PerfxIngress.options(
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.limit_concurrency,
    )
    model_size = config.model_path.stat().st_size if config.model_path.is_file() else -1  # -1: a directory
    return ingress.bind(engine.bind(config, model_size, bundled_model), config)


def _replica_count(config: ServerConfig, settings: ReplicaSettings) -> dict[str, Any]:
    if not settings.autoscaled:
        return {"num_replicas": settings.replicas or 1}
    target = settings.target_ongoing_requests or config.max_running  # a full batch per replica
    autoscaling = {
        "min_replicas": settings.min_replicas,
        "max_replicas": settings.max_replicas,
        "target_ongoing_requests": target,
        **settings.autoscaling,
    }
    return {"autoscaling_config": autoscaling}


def _config_on_this_node(config: ServerConfig, model_size: int, bundled_model: bool, node: str) -> ServerConfig:
    """``config`` for this node: the model must be at the same path as where ``perfx serve --ray`` ran (the
    bundled model wherever this node's perfx installed it), and the same file."""
    path = config.model_path
    if bundled_model and not path.exists():
        from ...default_model import bundled_model_path

        path = Path(bundled_model_path())
        config = replace(config, model_path=path)
    if not path.exists():
        raise ServeError(
            f"the model file {path} is not on node {node}: put it at that path on every node (a shared "
            "filesystem, or a copy; docs/serving.md)"
        )
    if model_size >= 0 and not bundled_model and path.stat().st_size != model_size:
        raise ServeError(
            f"the model file {path} on node {node} has {path.stat().st_size} bytes, not the {model_size} of the "
            "file where perfx serve --ray was started: copy the same file to every node"
        )
    return config


def _reserved_device(backend_name: str) -> int | None:
    """The device index of the GPU Ray reserved for this replica, None when it reserved none."""
    gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not gpu_ids:
        return None
    from ...plugins import get_registry

    return replica_device(get_registry().backends[backend_name].devices(), gpu_ids)


def _control_headers(config: ServerConfig) -> tuple[tuple[bytes, bytes], ...]:
    """Headers that get a replica's own GET /health and /metrics past its guard."""
    hosts = allowed_hosts(config)
    host = "localhost" if hosts is None or "localhost" in hosts else sorted(hosts)[0]
    headers = [(b"host", host.encode())]
    if config.api_key:
        headers.append((b"authorization", f"Bearer {config.api_key}".encode()))
    return tuple(headers)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send_json(send: Send, status: int, body: Any, replica: bytes) -> None:
    headers = [_JSON, (REPLICA_HEADER, replica)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def _send_error(send: Send, error: APIError) -> None:
    await _send_json(send, error.status, error.body(), INGRESS_ID)


async def _replica_failed(send: Send, started: bool, streaming: bool, exc: Exception) -> None:
    """End a request whose replica died: a 503 if nothing was sent yet, an error event ending a stream."""
    error = APIError(
        503,
        f"the engine replica serving this request stopped ({type(exc).__name__}); send the request again",
        type="server_error",
        code="replica_failed",
    )
    if not started:
        await _send_error(send, error)
    elif streaming:
        event = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": event, "more_body": False})
    else:
        raise exc  # a whole JSON body cut short: the connection is dropped rather than the body ended as if whole


def _with_ingress_header(app: Callable[[Scope, Receive, Send], Awaitable[None]]):
    """``app`` with ``x-perfx-replica: ingress`` on the responses that do not name a replica already (those the
    guard refuses)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start" and not any(
                k.lower() == REPLICA_HEADER for k, _ in message.get("headers", ())
            ):
                message = add_headers(message, [(REPLICA_HEADER, INGRESS_ID)])
            await send(message)

        await app(scope, receive, send_named)

    return wrapped
