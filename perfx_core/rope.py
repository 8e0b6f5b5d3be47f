"""Rotary position embedding tables (rotate-half convention), with the frequency scalings of the files perfx reads.

- Llama-3 scaling (``config.rope_scaling``) or explicit per-frequency divisors (``rope_freq_divisors``,
  llama.cpp's rope_freqs.weight) slow some rotation speeds.
- Phi-3's LongRoPE (``config.long_rope``) divides the speeds by one of two factor sets and multiplies cos and sin
  by its attention factor. perfx builds its tables once, for the context it is loaded with, so the set is fixed
  by that length: the long factors when the table covers more positions than the original training context,
  the short ones otherwise (llama.cpp's rule, with its n_ctx). transformers instead picks per forward call, by
  the longest position in it (long once it exceeds the original context): the two agree whenever the loaded
  context and the sequence are on the same side of the original context, for instance a context above it and
  a prompt that exceeds it, or a context within it. A short prompt run with a long loaded context gets the long
  factors here (as in llama.cpp), where transformers would use the short ones for that call.
"""

from __future__ import annotations

import numpy as np

from .config import LlamaConfig, RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, divisors: tuple[float, ...] | None = None
) -> np.ndarray:
    """float64 (head_dim // 2,) rotation speeds; Llama-3 scaling (or explicit divisors) slows the low ones."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors is not None:
        return inv_freq / np.asarray(divisors, dtype=np.float64)
    if scaling is None:
        return inv_freq
    wavelength = 2 * np.pi / inv_freq
    long_wavelength = scaling.original_context_length / scaling.low_freq_factor
    short_wavelength = scaling.original_context_length / scaling.high_freq_factor
    # Between the two wavelengths, blend scaled and unscaled speeds linearly in context/wavelength.
    smooth = (scaling.original_context_length / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(
        wavelength < short_wavelength,
        inv_freq,
        np.where(wavelength > long_wavelength, inv_freq / scaling.factor, blended),
    )


def rope_divisors(config: LlamaConfig, max_seq_len: int) -> tuple[float, ...] | None:
    """The per-frequency divisors a table of ``max_seq_len`` positions uses (LongRoPE: the set for that length)."""
    long_rope = config.long_rope
    if long_rope is None:
        return config.rope_freq_divisors
    return long_rope.long_factors if max_seq_len > long_rope.original_context_length else long_rope.short_factors


def rope_cos_sin(config: LlamaConfig, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, float32 (max_seq_len, head_dim // 2), LongRoPE's attention factor included."""
    divisors = rope_divisors(config, max_seq_len)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, divisors)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    scale = 1.0 if config.long_rope is None else config.long_rope.attn_factor
    return (scale * np.cos(angles)).astype(np.float32), (scale * np.sin(angles)).astype(np.float32)
