"""Which model names a request may use (ServerConfig.served_model_names): without --served-model-name any name
is served, since the server has one model and many clients hard-code a name (responses then report the
file's name); with it, only the listed names, and another is a 404 as OpenAI and vLLM answer it."""

from __future__ import annotations

from typing import Any

from .config import ServerConfig
from .protocol import APIError


def response_model(config: ServerConfig, body: Any) -> str:
    """The name a response to ``body`` reports; raises APIError (404) for a name this server refuses. A
    ``model`` that is not a string is left to the request's own validation (a 400)."""
    requested = body.get("model") if isinstance(body, dict) else None
    name = config.response_model_name(requested)
    if name is None:
        raise APIError(
            404,
            f"model {requested!r} is not served here; this server serves {', '.join(config.model_names)}",
            param="model",
            code="model_not_found",
        )
    return name
