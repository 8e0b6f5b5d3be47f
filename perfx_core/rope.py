"""Rotary position embedding tables (rotate-half convention), with Llama-3 frequency scaling."""

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


def rope_cos_sin(config: LlamaConfig, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, float32 (max_seq_len, head_dim // 2)."""
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_divisors)
    angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
