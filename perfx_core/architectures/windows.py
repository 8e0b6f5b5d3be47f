"""Sliding-window attention settings as the two formats give them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def hf_sliding_window(raw: Mapping[str, Any], all_layers: bool = False) -> dict[str, Any]:
    """``sliding_window`` and which layers use it: transformers' ``layer_types`` when the config lists them,
    else every layer (``all_layers``) or none."""
    window = raw.get("sliding_window")
    if window in (None, 0) or raw.get("use_sliding_window") is False:
        return {}
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list):
        layers = [t == "sliding_attention" for t in layer_types]
        return {"sliding_window": window, "sliding_layers": layers} if any(layers) else {}
    return {"sliding_window": window} if all_layers else {}


def pattern_layers(n_layers: int, period: int) -> list[bool]:
    """Every ``period``-th layer is global, the others sliding (llama.cpp's swa pattern: layer i slides when
    i % period < period - 1; transformers' layer_types for Gemma say the same)."""
    return [i % period < period - 1 for i in range(n_layers)]
