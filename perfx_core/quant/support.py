"""Which models ``perfx quantize`` can quantize: every family perfx runs, as long as each config feature is one
the calibration forward (forward.py), the scale folding (awq.py) and perfx's format implement.

A field added to LlamaConfig for a new family is refused, at any value but its default, until it is named in
IMPLEMENTED_FIELDS (after those parts learn it): quantizing with it ignored would write a wrong model silently.
"""

from __future__ import annotations

import dataclasses

from ..architectures import FAMILIES
from ..config import LlamaConfig, show
from ..errors import ModelFormatError
from .forward import ACTIVATIONS

IMPLEMENTED_FIELDS = frozenset(
    {
        # Llama
        "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps", "rope_theta",
        "context_length", "rope_scaling", "rope_freq_divisors", "tied_embeddings", "name", "arch",
        # Phi-3's LongRoPE (the config carries its factors; the format stores the config)
        "long_rope",
        # Qwen2 / Qwen3, Gemma 2 / 3, Mistral and Phi-3 windows
        "qkv_bias", "qk_norm", "activation", "post_norms", "embed_scale", "attn_scale", "attn_softcap",
        "final_softcap", "sliding_window", "sliding_layers", "rope_local_theta",
    }
)  # fmt: skip


def check_quantizable(config: LlamaConfig, implemented: frozenset[str] = IMPLEMENTED_FIELDS) -> None:
    """ModelFormatError naming what perfx quantize lacks for ``config``; nothing when it handles all of it."""
    families = {f.name for f in FAMILIES}
    if config.arch not in families:
        raise ModelFormatError(
            f"perfx quantize has no {config.arch!r} family (it quantizes {', '.join(sorted(families))})"
        )
    lacking = [
        f"{f.name} = {show(getattr(config, f.name))}"
        for f in dataclasses.fields(LlamaConfig)
        if f.name not in implemented and getattr(config, f.name) != f.default
    ]
    if config.activation not in ACTIVATIONS:
        lacking.append(f"activation = {config.activation!r} (its calibration forward runs {', '.join(ACTIVATIONS)})")
    if lacking:
        raise ModelFormatError(
            f"perfx quantize cannot quantize this {config.arch} model: it does not implement {'; '.join(lacking)}. "
            "Load the model directly (GGUF or Hugging Face directory) instead"
        )
