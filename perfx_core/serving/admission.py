"""What a request to a route that runs engine jobs (completions and chat, embeddings, responses) passes before
any job of it is made. The routes share it so that they check in one order and answer each refusal alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from .guard import read_json
from .job_events import ServingState, off_loop
from .model_names import response_model
from .scheduler import Scheduler

T = TypeVar("T")


async def admit(
    state: ServingState, request: Request, parse: Callable[[Any, str, Callable[[], bool]], T]
) -> tuple[Scheduler, Any, str, T]:
    """The scheduler, the body, the model name to report and ``parse(body, name, cancelled)``. Raises APIError,
    in this order: the server is not ready (503), the body is late or not JSON (408, 400), the model is not
    served (404), then ``parse``'s own; RequestCancelledError when the client leaves while ``parse`` runs. It
    runs in a worker thread, since tokenizing or rendering a chat template must not stall other streams."""
    scheduler = state.ready_scheduler()
    body = await read_json(request, state.config.header_timeout_s)
    name = response_model(state.config, body)
    parsed = await off_loop(request, lambda cancelled: parse(body, name, cancelled))
    return scheduler, body, name, parsed
