"""An OpenAI-compatible HTTP server (``perfx serve``) with continuous batching over fixed KV-cache slots.

``create_app(ServerConfig(...))`` builds the Starlette app; ``cli_commands.add_commands`` adds ``serve``.
"""

from __future__ import annotations

from .config import ServeError, ServerConfig

__all__ = ["ServeError", "ServerConfig", "create_app"]


def __getattr__(name: str):
    # Starlette is imported only when an app is built, so the CLI can list commands without it.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'perfx_core.serving' has no attribute {name!r}")
