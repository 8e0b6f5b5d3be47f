"""What stands between the network and the routes: API key, Host and Content-Type checks, body limits, JSON
that cannot hurt the parser, and a connection that must send its headers in time.

- Host: a server bound to a loopback address answers only requests that name a loopback host (or one of
  ``--allowed-hosts``), so a web page cannot reach it through DNS rebinding.
- Content-Type: bodies must be ``application/json``. A browser sends ``text/plain`` cross-site without a CORS
  preflight; JSON needs one, which this server grants only to ``--allowed-origins`` (app.py: CORSMiddleware), so
  no other page can drive generations.
- JSON: nesting, huge integers and lone surrogates are 400s, not failures deeper in.
- Slow clients: a connection that has not finished its request headers within ``header_timeout_s`` is closed
  (uvicorn's own timeout only covers idle keep-alive connections), and a body must arrive within as long.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import ServerConfig
from .protocol import APIError

MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_ROUTES_METHODS = frozenset({"POST", "PUT", "PATCH"})


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def refusal(metrics: Any, error: APIError | None) -> Response:
    """The answer to a request refused before it ran, counted in perfx_requests_rejected by status: ``error``'s
    response, or 499 for a client that left (``error`` None)."""
    status = "499" if error is None else str(error.status)
    metrics.requests_rejected.labels(status).inc()
    return Response(status_code=499) if error is None else error_response(error)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """Host header names the server answers (lowercase, no port); None: any. ``--allowed-hosts`` wins; else a
    loopback-bound server answers loopback names only, and one bound elsewhere any name (its users choose)."""
    if config.allowed_hosts:
        return None if "*" in config.allowed_hosts else frozenset(h.lower() for h in config.allowed_hosts)
    if is_loopback(config.host):
        return LOOPBACK_NAMES | {config.host.lower()}
    return None


def host_name(header: bytes) -> str:
    """The Host header's name without its port: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class GuardMiddleware:
    """Host (421), API key on every route but /health (401), Content-Type (415) and body size (413)."""

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app, self.config = app, config
        self._expected = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._hosts = allowed_hosts(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope, dict(scope["headers"]))
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self._hosts is not None and host_name(headers.get(b"host", b"")) not in self._hosts:
            return APIError(
                421,
                "this server does not answer for that Host; start it with --allowed-hosts NAME to allow it",
                code="host_not_allowed",
            )
        if self._expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                return APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer KEY'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
        if scope["method"] in JSON_ROUTES_METHODS:
            media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media_type != b"application/json":
                return APIError(
                    415, "send the body as JSON with 'Content-Type: application/json'", code="unsupported_media_type"
                )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.config.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.config.max_body_bytes} bytes", code="request_too_large")

    def _limited(self, receive: Receive) -> Receive:
        """Counts bytes of bodies sent without (or with a false) Content-Length."""
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.config.max_body_bytes:
                    raise APIError(413, self._too_large().message, code="request_too_large")
            return message

        return limited


async def read_json(request: Request, timeout_s: float) -> Any:
    """The request body as JSON, checked so that nothing in it can fail the code that reads it."""
    try:
        raw = await asyncio.wait_for(request.body(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="timeout") from None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(
            400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except ValueError as exc:  # an integer beyond Python's digit limit
        raise APIError(400, f"the request body has an unreadable number: {exc}", code="invalid_json") from None
    check_json_value(body)
    return body


def check_json_value(body: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates (not text: they cannot be
    tokenized or sent back as UTF-8)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise APIError(400, "the request has a string with a lone UTF-16 surrogate", code="invalid_json")
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, depth + 1))
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete within
    ``header_timeout_s`` of the request's first byte (of the connection, for its first request)."""

    header_timeout_s = 10.0  # set per server by header_timeout_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": timeout_s})
