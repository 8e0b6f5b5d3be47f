"""perfx: a plugin-based, multi-backend int4 inference engine for Llama-family models."""

from .errors import (
    BackendError,
    BackendUnavailableError,
    ContextLengthError,
    InvalidArgumentError,
    ModelBusyError,
    ModelFormatError,
    ModelNotFoundError,
    PerfxError,
    PluginError,
    TokenizerError,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The API pulls in tokenizer libraries; load it on first use so `import perfx_core` stays light.
    if name in ("load", "Model"):
        from . import api

        return getattr(api, name)
    if name == "load_tokenizer":
        from .tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'perfx_core' has no attribute {name!r}")


__all__ = [
    "Model",
    "load",
    "load_tokenizer",
    "BackendError",
    "BackendUnavailableError",
    "ContextLengthError",
    "InvalidArgumentError",
    "ModelBusyError",
    "ModelFormatError",
    "ModelNotFoundError",
    "PerfxError",
    "PluginError",
    "TokenizerError",
]
