"""Typed errors: every error a user can cause is a PerfxError whose message says what to do."""

from __future__ import annotations


class PerfxError(Exception):
    """Base class of every error perfx raises for a problem the user can fix."""


class InvalidArgumentError(PerfxError, ValueError):
    """An argument is out of range or of the wrong kind (e.g. temperature < 0)."""


class ModelFormatError(PerfxError):
    """A model file is malformed, truncated or uses something perfx does not support."""


class ModelNotFoundError(PerfxError, FileNotFoundError):
    """The model path does not exist, or the bundled default model is not installed."""


class TokenizerError(PerfxError):
    """The tokenizer metadata is missing or inconsistent."""


class BackendError(PerfxError):
    """A backend failed: it is not registered, its device cannot be opened, or an op failed."""


class BackendUnavailableError(BackendError):
    """A registered backend cannot run on this machine; the message says why."""


class PluginError(PerfxError):
    """A plugin registered something invalid; the message names the plugin."""


class ModelBusyError(PerfxError):
    """Every KV-cache slot of the model is held by a generation of another thread."""


class RequestCancelledError(PerfxError):
    """The caller cancelled the work (a server request whose client went away)."""


class ContextLengthError(InvalidArgumentError):
    """Prompt tokens plus requested new tokens do not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
            f"exceeds the context length of {context_length} tokens; shorten the prompt or lower max_tokens"
        )
