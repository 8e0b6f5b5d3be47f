"""Qwen2 / Qwen2.5 (biases on the q, k and v projections) and Qwen3 (RMSNorm of each q and k head before RoPE,
head size independent of dim / heads). llama.cpp runs both with NeoX RoPE, so their GGUF rows are not permuted."""

from __future__ import annotations

from typing import Any

from .base import LLAMA_HF_TENSORS, Family
from .windows import hf_sliding_window


def _qwen2_hf(raw: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, **hf_sliding_window(raw)}


def _qwen3_hf(raw: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, **({"qkv_bias": True} if raw.get("attention_bias") else {}), **hf_sliding_window(raw)}


QWEN2 = Family(
    "qwen2", "qwen2", ("qwen2",), hf_tensors=LLAMA_HF_TENSORS, gguf_values=lambda m, a: {"qkv_bias": True},
    hf_values=_qwen2_hf, extra_ops=("add_bias",),
)  # fmt: skip
QWEN3 = Family(
    "qwen3", "qwen3", ("qwen3",), gguf_values=lambda m, a: {"qk_norm": True}, hf_values=_qwen3_hf,
    extra_ops=("head_rmsnorm",),
)  # fmt: skip
