"""Gemma 2 and Gemma 3: GeGLU MLP (tanh-approximated GELU), RMSNorm applied as (1 + w), norms before and after
attention and the MLP, embeddings scaled by sqrt(dim), q.k scaled by query_pre_attn_scalar^-1/2, sliding-window
layers between global ones. Gemma 2 soft-caps attention scores and logits; Gemma 3 norms each q and k head and
gives its sliding layers their own RoPE base. llama.cpp runs both with NeoX RoPE (rows not permuted) and adds the
1 to every norm weight when it converts them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .base import Family
from .windows import hf_sliding_window, pattern_layers

GEMMA_HF_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",  # Gemma's post_attention_layernorm is the attention's post-norm
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers when the file does not say (llama.cpp's default too)


def _common(dim: int) -> dict[str, Any]:
    return {"activation": "gelu_tanh", "post_norms": True, "embed_scale": math.sqrt(dim)}


def _hf_common(raw: Mapping[str, Any]) -> dict[str, Any]:
    values = {**_common(raw["hidden_size"]), **hf_sliding_window(raw)}
    scalar = raw.get("query_pre_attn_scalar")
    if scalar is not None:
        values["attn_scale"] = float(scalar) ** -0.5 if isinstance(scalar, (int, float)) else scalar
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        if raw.get(key) is not None:
            values[field] = raw[key]
    return values


def _gemma2_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
    values = _hf_common(raw)
    if "sliding_window" in values and "sliding_layers" not in values:  # transformers before layer_types
        values["sliding_layers"] = pattern_layers(raw["num_hidden_layers"], 2)
    return values


def _gemma3_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
    values = {**_hf_common(raw), "qk_norm": True}
    if "sliding_window" in values and "sliding_layers" not in values:
        values["sliding_layers"] = pattern_layers(raw["num_hidden_layers"], raw.get("sliding_window_pattern", 6))
    values["rope_local_theta"] = raw.get("rope_local_base_freq", LOCAL_ROPE_BASE)
    return values


def _attention_scale(meta: Mapping[str, Any], arch: str) -> float | None:
    """llama.cpp keeps no query_pre_attn_scalar in GGUF; it scales q.k by 1/sqrt(head size), except for the
    27B models, whose scalar is dim / heads (the only sizes where the two differ)."""
    dim, heads = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.attention.head_count")
    head = meta.get(f"{arch}.attention.key_length")
    n_layers = meta.get(f"{arch}.block_count")
    if n_layers in (46, 62) and isinstance(dim, int) and isinstance(heads, int) and heads > 0 and dim % heads == 0:
        return (dim // heads) ** -0.5  # Gemma 2 27B (46 blocks) and Gemma 3 27B (62)
    return None if head is None else float(head) ** -0.5


def _gguf_common(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    dim = meta.get(f"{arch}.embedding_length")
    values = _common(dim) if isinstance(dim, int) and dim > 0 else {"activation": "gelu_tanh", "post_norms": True}
    values["attn_scale"] = _attention_scale(meta, arch)
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        values["sliding_window"] = window
    return values


def _gemma2_gguf(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    values = _gguf_common(meta, arch)
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        if meta.get(f"{arch}.{key}") is not None:
            values[field] = meta[f"{arch}.{key}"]
    if "sliding_window" in values and isinstance(meta.get(f"{arch}.block_count"), int):
        values["sliding_layers"] = pattern_layers(meta[f"{arch}.block_count"], 2)
    return values


def _gemma3_gguf(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    values = {**_gguf_common(meta, arch), "qk_norm": True}
    if "sliding_window" in values and isinstance(meta.get(f"{arch}.block_count"), int):
        values["sliding_layers"] = pattern_layers(meta[f"{arch}.block_count"], 6)
    values["rope_local_theta"] = meta.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE)
    return values


# Gemma's turns: user and model only; a system message opens the first user turn. (The Gemma 3 270M GGUFs
# people download often carry no template; ChatML would put it off its format.)
GEMMA_CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\\n' -}}"
    "{{- system if loop.first else '' -}}"
    "{{- m['content'] | trim -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

GEMMA2 = Family(
    "gemma2", "gemma2", ("gemma2",), hf_norm_offset=1.0, hf_tensors=GEMMA_HF_TENSORS,
    gguf_values=_gemma2_gguf, hf_values=_gemma2_hf,
    extra_ops=("gelu_mul", "scale", "softcap", "linear_post_norm_add_rmsnorm"),
    attention_features=("window", "softcap", "scale"), chat_template=GEMMA_CHAT_TEMPLATE,
)  # fmt: skip
GEMMA3 = Family(
    "gemma3", "gemma3", ("gemma3_text", "gemma3"), hf_norm_offset=1.0, hf_tensors=GEMMA_HF_TENSORS,
    gguf_values=_gemma3_gguf, hf_values=_gemma3_hf,
    extra_ops=("gelu_mul", "scale", "head_rmsnorm", "linear_post_norm_add_rmsnorm"),
    attention_features=("window", "scale"), chat_template=GEMMA_CHAT_TEMPLATE,
)  # fmt: skip
