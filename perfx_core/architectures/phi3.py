"""Phi-3 / Phi-3.5: q, k, v in one projection and gate, up in another (kept fused in GGUF too), NeoX RoPE, a
sliding window where the config sets one. The long-context (128k) models' LongRoPE ("longrope", formerly "su")
is read by the formats (formats/hf_rope.py; in GGUF, rope_factors_long/short.weight and the rope.scaling keys)
into config.long_rope, and perfx_core.rope applies it."""

from __future__ import annotations

from typing import Any

from .base import Family
from .windows import hf_sliding_window

PHI3_HF_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "w_qkv": "self_attn.qkv_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate_up": "mlp.gate_up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def _phi3_hf(raw: dict[str, Any]) -> dict[str, Any]:
    return hf_sliding_window(raw, all_layers=True)


def _phi3_gguf(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    window = meta.get(f"{arch}.attention.sliding_window")
    return {"sliding_window": window} if window else {}


PHI3 = Family(
    "phi3",
    "phi3",
    ("phi3",),
    fused=True,
    hf_tensors=PHI3_HF_TENSORS,
    gguf_values=_phi3_gguf,
    hf_values=_phi3_hf,
    attention_features=("window",),
)
