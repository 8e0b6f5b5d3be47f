"""Run an ASGI app on a request that arrived elsewhere (the ingress), in this process, and hand back what it
sends as batches of ASGI messages: what an engine replica streams back to the ingress through Ray.

Each request's body arrives whole (the ingress has read it within its limits). The app is told the client left
(``http.disconnect``) when the consumer stops reading early, so a cancelled stream frees its KV-cache slot as it
does behind uvicorn. The scope says ASGI 2.3, as uvicorn does: Starlette's streaming responses then listen for
that disconnect message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

from ..protocol import APIError

log = logging.getLogger("perfx.serving")
APP_EXIT_TIMEOUT_S = 5.0  # how long an app that was told of a disconnect gets to finish before it is cancelled


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (headers as raw (name, value) byte pairs)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    scheme: str = "http"

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.path.encode("utf-8", "surrogateescape"),
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": self.client,
            "server": self.server,
            "state": {},
        }


@dataclass
class _Exchange:
    """One request's channel between the app's task and the consumer of its messages."""

    body: bytes
    messages: asyncio.Queue = field(default_factory=asyncio.Queue)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    body_sent: bool = False

    async def receive(self) -> Message:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.gone.is_set():
            raise OSError("the client went away")  # what a server's send does then; the app stops sending
        self.messages.put_nowait(message)


def add_headers(message: Message, headers: Sequence[tuple[bytes, bytes]]) -> Message:
    """``message`` with ``headers`` added if it starts a response."""
    if message["type"] != "http.response.start":
        return message
    return {**message, "headers": [*message.get("headers", ()), *headers]}


async def call_app(
    app: ASGIApp, request: ForwardedRequest, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> AsyncIterator[list[Message]]:
    """Run ``app`` on ``request``; yield its messages, each batch what it sent since the last one (a step's
    token for every stream is one burst: fewer, larger hand-offs). ``extra_headers`` go on the response start.
    An app that fails before it answered gives a plain 500; closing the iterator early is a disconnect."""
    exchange = _Exchange(request.body)
    task = asyncio.ensure_future(app(request.scope(), exchange.receive, exchange.send))
    started = finished = False
    try:
        while True:
            getter = asyncio.ensure_future(exchange.messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if exchange.messages.empty():  # the app returned (or failed) and sent nothing more
                    break
                continue
            batch = [getter.result()]
            while not exchange.messages.empty():
                batch.append(exchange.messages.get_nowait())
            started = started or any(m["type"] == "http.response.start" for m in batch)
            finished = any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in batch)
            yield [add_headers(m, extra_headers) for m in batch]
            if finished:
                break
        error = task.exception() if task.done() and not task.cancelled() else None
        if error is not None:
            log.error("the app failed on %s %s: %r", request.method, request.path, error)
        if not started:
            yield [
                {"type": "http.response.start", "status": 500, "headers": [*_JSON, *extra_headers]},
                {"type": "http.response.body", "body": _INTERNAL_ERROR},
            ]
        elif not finished:
            yield [{"type": "http.response.body", "body": b"", "more_body": False}]
    finally:
        if not task.done():
            exchange.gone.set()  # the consumer stopped reading: the app's disconnect handling runs now
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_TIMEOUT_S)
            task.cancel()


_JSON = [(b"content-type", b"application/json")]
_INTERNAL_ERROR = json.dumps(APIError(500, "internal error", type="server_error").body()).encode()
