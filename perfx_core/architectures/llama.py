"""Llama 1/2/3, SmolLM, TinyLlama; Mistral (Llama with sliding-window attention, which its GGUF files do not
record: llama.cpp converts Mistral to the 'llama' architecture and runs it without the window)."""

from __future__ import annotations

from typing import Any

from .base import Family
from .windows import hf_sliding_window

LLAMA = Family("llama", "llama", ("llama",), gguf_permuted_qk=True)


def _mistral_values(raw: dict[str, Any]) -> dict[str, Any]:
    return hf_sliding_window(raw, all_layers=True)


MISTRAL = Family(
    "mistral", None, ("mistral",), gguf_permuted_qk=True, hf_values=_mistral_values, attention_features=("window",)
)
