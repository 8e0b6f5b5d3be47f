"""Model hyper-parameters and host-side weights of a Llama-family model, independent of the file format."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .weights import Weight


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    context_length: int  # what the model was trained for
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the rotation speeds (llama.cpp's rope_freqs.weight), when a file gives them
    # instead of scaling parameters; (head_dim // 2) values. Takes precedence over rope_scaling.
    rope_freq_divisors: tuple[float, ...] | None = None
    tied_embeddings: bool = False
    name: str = ""

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    """One transformer block, q/k rows in Hugging Face order (rotate-half RoPE), all (out, in)."""

    attn_norm: np.ndarray  # float32 (dim,)
    wq: Weight  # (q_dim, dim)
    wk: Weight  # (kv_dim, dim)
    wv: Weight  # (kv_dim, dim)
    wo: Weight  # (dim, q_dim)
    ffn_norm: np.ndarray  # float32 (dim,)
    w_gate: Weight  # (ffn_dim, dim)
    w_up: Weight  # (ffn_dim, dim)
    w_down: Weight  # (dim, ffn_dim)


@dataclass
class LlamaWeights:
    token_embedding: Weight  # (vocab, dim)
    layers: list[LayerWeights]
    norm: np.ndarray  # float32 (dim,)
    output: Weight  # (vocab, dim); the same object as token_embedding when tied
    notes: list[str] = field(default_factory=list)  # conversions made at load (e.g. K-quant re-quantized)
