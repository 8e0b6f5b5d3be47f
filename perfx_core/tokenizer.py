"""Tokenizers built from the `tokenizer.ggml.*` metadata of a GGUF file.

`load_tokenizer(path)` reads a GGUF file (a vocabulary-only file works) and `tokenizer_from_metadata(metadata)`
builds the tokenizer from an already-read metadata dict. The shared base class and metadata readers live in
`tokenizer_base`, the subword algorithms in `tokenizer_spm` (SentencePiece, `llama`) and `tokenizer_bpe`
(byte-level BPE, `gpt2`); this module picks one and re-exports the names callers use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .config import show
from .errors import TokenizerError
from .tokenizer_base import END_OF_TURN_NAMES, Tokenizer, TokenType, Vocab, malformed
from .tokenizer_bpe import ByteLevelBPETokenizer
from .tokenizer_spm import SentencePieceTokenizer

__all__ = [
    "END_OF_TURN_NAMES",
    "SUPPORTED_MODELS",
    "ByteLevelBPETokenizer",
    "SentencePieceTokenizer",
    "TokenType",
    "Tokenizer",
    "Vocab",
    "load_tokenizer",
    "tokenizer_from_metadata",
]

SUPPORTED_MODELS = ("llama", "gpt2")


def tokenizer_from_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer described by GGUF metadata (`tokenizer.ggml.*` keys)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(
            "the GGUF file has no tokenizer (metadata 'tokenizer.ggml.model' is missing); "
            "use a GGUF converted with its vocabulary"
        )
    if not isinstance(model, str):
        raise malformed(
            "tokenizer.ggml.model", f"must be a tokenizer name such as 'llama' or 'gpt2', got {show(model)}"
        )
    if model == "llama":
        return SentencePieceTokenizer.from_metadata(metadata)
    if model == "gpt2":
        return ByteLevelBPETokenizer.from_metadata(metadata)
    raise TokenizerError(
        f"tokenizer model {show(model)} (metadata 'tokenizer.ggml.model') is not supported; "
        f"supported: {', '.join(repr(m) for m in SUPPORTED_MODELS)} (SentencePiece and byte-level BPE)"
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a GGUF file; vocabulary-only files (no tensors) work."""
    from .gguf_file import read_gguf  # deferred: callers that already hold the metadata never need it

    return tokenizer_from_metadata(read_gguf(path, tensors=False).metadata)
