"""Model directories perfx loads besides GGUF files: its own format, Hugging Face float checkpoints, AutoAWQ.

``load_directory`` picks the format from the files' metadata (``perfx.json``; ``config.json`` and its
``quantization_config``), never from the directory's name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LlamaConfig, LlamaWeights
from ..errors import ModelFormatError
from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: LlamaConfig
    weights: LlamaWeights
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # tokenizer metadata (chat template) and, for perfx directories, perfx.json
    kind: str  # "perfx", "hf" or "awq"


def directory_kind(path: Path) -> str:
    """'perfx', 'awq' or 'hf' for a model directory; ModelFormatError when it is none of them."""
    from .awq_checkpoint import is_awq_config
    from .hf import read_json
    from .perfx_format import is_perfx_directory

    if is_perfx_directory(path):
        return "perfx"
    if (path / "config.json").is_file():
        return "awq" if is_awq_config(read_json(path / "config.json")) else "hf"
    raise ModelFormatError(
        f"{path} is a directory without perfx.json or config.json; perfx loads GGUF files, perfx directories "
        "(`perfx quantize`) and Hugging Face/AutoAWQ Llama directories"
    )


def load_directory(path: str | os.PathLike[str], quantize: str | None = None) -> LoadedModel:
    """Load a model directory. ``quantize="rtn"`` quantizes a float Hugging Face checkpoint to int4 on load."""
    from .hf_tokenizer import tokenizer_for_directory

    path = Path(path)
    kind = directory_kind(path)
    if quantize is not None and kind != "hf":
        raise ModelFormatError(f"{path} is already quantized ({kind}); load it without quantize=")
    meta: dict[str, Any] = {}
    if kind == "perfx":
        from .perfx_format import load_perfx_directory

        config, weights, meta = load_perfx_directory(path)
    elif kind == "awq":
        from .awq_checkpoint import load_awq_directory

        config, weights = load_awq_directory(path)
    else:
        from .hf import load_hf_directory

        config, weights = load_hf_directory(path, quantize=quantize)
    tokenizer, tok_meta = tokenizer_for_directory(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}; "
            "use the tokenizer files that belong to this model"
        )
    return LoadedModel(config, weights, tokenizer, {**tok_meta, "perfx": meta} if meta else tok_meta, kind)
