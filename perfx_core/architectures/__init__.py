"""Model families: how each one's checkpoints (GGUF with llama.cpp's names, Hugging Face safetensors) map onto
perfx's config, tensors and ops. One small module per family; the forward pass (perfx_core.model) reads the
config's feature fields, so a family that needs no new behaviour needs no new model code."""

from __future__ import annotations

from ..errors import ModelFormatError
from .base import Family
from .gemma import GEMMA2, GEMMA3
from .llama import LLAMA, MISTRAL
from .phi3 import PHI3
from .qwen import QWEN2, QWEN3

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3)


def family_for_gguf(arch: object, where: str) -> Family:
    for family in FAMILIES:
        if family.gguf_arch == arch:
            return family
    names = ", ".join(sorted({f.gguf_arch for f in FAMILIES if f.gguf_arch}))
    raise ModelFormatError(f"{where} is a {arch!r} model; perfx runs these GGUF architectures: {names}")


def family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def family_for_hf(model_type: object, where: str, architectures: object = None) -> Family:
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    names = ", ".join(t for f in FAMILIES for t in f.hf_model_types)
    listed = f" ({', '.join(map(str, architectures))})" if isinstance(architectures, list) and architectures else ""
    raise ModelFormatError(f"{where}: model_type {model_type!r}{listed} is not a family perfx runs; it runs {names}")


__all__ = ["FAMILIES", "Family", "family_for_gguf", "family_for_hf", "family_named"]
