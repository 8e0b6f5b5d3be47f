"""What a family module declares: its names in each format, and the config values beyond Llama's it reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import LlamaConfig

# perfx's optional per-block tensors -> (llama.cpp GGUF name, Hugging Face module path under model.layers.{i}).
OPTIONAL_TENSORS = {
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "post_attn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_ffn_norm": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
}
# Which config flag brings which optional tensors.
TENSORS_OF_FLAG = {
    "qkv_bias": ("bq", "bk", "bv"),
    "qk_norm": ("q_norm", "k_norm"),
    "post_norms": ("post_attn_norm", "post_ffn_norm"),
}
LLAMA_HF_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def no_values(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    gguf_arch: str | None  # general.architecture; None: its GGUF files say another family's (Mistral: 'llama')
    hf_model_types: tuple[str, ...]
    # llama.cpp's converter reorders the q/k rows of this architecture for its interleaved RoPE (perfx undoes it).
    gguf_permuted_qk: bool = False
    # Hugging Face stores this family's RMSNorm weights as w - 1 (applied as 1 + w); llama.cpp's GGUF adds 1.
    hf_norm_offset: float = 0.0
    # Phi-3 keeps q, k, v in one tensor and gate, up in another, in both formats.
    fused: bool = False
    # Per-block tensor paths of the Hugging Face checkpoint (perfx name -> path under model.layers.{i}).
    hf_tensors: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_HF_TENSORS))
    # Config values beyond Llama's: from the GGUF metadata (given the architecture name), from config.json.
    gguf_values: Callable[[Mapping[str, Any], str], dict[str, Any]] = no_values
    hf_values: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda raw: {}
    # What it needs beyond Llama's ops (for `perfx backends --ops`): op names, and attention features.
    extra_ops: tuple[str, ...] = ()
    attention_features: tuple[str, ...] = ()
    # The chat format of the family's instruct models, for files that ship no template (None: ChatML).
    chat_template: str | None = None


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """perfx name -> shape of one block's tensors, the optional ones the config asks for included."""
    d, f = config.dim, config.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,),
        "wq": (config.q_dim, d),
        "wk": (config.kv_dim, d),
        "wv": (config.kv_dim, d),
        "wo": (d, config.q_dim),
        "ffn_norm": (d,),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
    }
    optional = {
        "bq": (config.q_dim,),
        "bk": (config.kv_dim,),
        "bv": (config.kv_dim,),
        "q_norm": (config.head_dim,),
        "k_norm": (config.head_dim,),
        "post_attn_norm": (d,),
        "post_ffn_norm": (d,),
    }
    for name in optional_tensors(config):
        shapes[name] = optional[name]
    return shapes


def optional_tensors(config: LlamaConfig) -> list[str]:
    """The optional per-block tensors (OPTIONAL_TENSORS) that ``config``'s features bring."""
    return [name for flag, names in TENSORS_OF_FLAG.items() if getattr(config, flag) for name in names]
