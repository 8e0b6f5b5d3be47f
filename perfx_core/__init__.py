"""perfx: a plugin-based, multi-backend int4 inference engine for Llama-family models."""

from .errors import (
    BackendError,
    BackendUnavailableError,
    ContextLengthError,
    InvalidArgumentError,
    ModelFormatError,
    ModelNotFoundError,
    PerfxError,
    PluginError,
    TokenizerError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ContextLengthError",
    "InvalidArgumentError",
    "ModelFormatError",
    "ModelNotFoundError",
    "PerfxError",
    "PluginError",
    "TokenizerError",
]
