"""Random-weight Llama models of real shapes, for benchmarks (timing does not depend on weight values).

Built directly in perfx's int4 format (random codes, plausible scales), so a Llama-2-7B-shaped model
is made in seconds on the benchmark machine itself instead of being shipped there.
"""

from __future__ import annotations

import numpy as np

from .config import LayerWeights, LlamaConfig, LlamaWeights
from .errors import InvalidArgumentError
from .weights import K_SUPER, BlockWeight, Int4KScales, Int4Weight

LLAMA2_7B = LlamaConfig(
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    head_dim=128,
    ffn_dim=11008,
    norm_eps=1e-5,
    rope_theta=10000.0,
    context_length=4096,
    name="llama-2-7b-shape (random int4 weights)",
)


Q4_0_BLOCK_BYTES = 18  # float16 scale + 16 bytes of 32 nibbles


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF Q4_0 blocks (rows, cols / 32 * 18) with random codes and scales near 0.01."""
    blocks = rng.integers(0, 256, size=(rows * cols // 32, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    scales = (0.005 + 0.01 * rng.random(rows * cols // 32, dtype=np.float32)).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 32 * Q4_0_BLOCK_BYTES)


def random_q4_0_weight(rows: int, cols: int, rng: np.random.Generator) -> BlockWeight:
    """A random weight as a GGUF Q4_0 file holds it (symmetric, 32-column groups), for runtimes that take blocks."""
    from gguf import GGMLQuantizationType

    from .gguf_blocks import q4_decoder

    blocks = random_q4_0(rows, cols, rng)
    return BlockWeight((blocks,), "q4_0", cols, lambda: Int4Weight(*q4_decoder(GGMLQuantizationType.Q4_0)(blocks), 32))


def random_int4(rows: int, cols: int, group_size: int, rng: np.random.Generator) -> Int4Weight:
    """Uniform random codes with scales near 0.01 and a symmetric zero point (w = (q - 8) * scale)."""
    packed = np.frombuffer(rng.bytes(rows * cols // 2), dtype=np.uint8).reshape(rows, cols // 2).copy()
    scale = (0.005 + 0.01 * rng.random((rows, cols // group_size), dtype=np.float32)).astype(np.float16)
    return Int4Weight(packed, scale, -8.0 * scale.astype(np.float32), group_size)


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> Int4Weight:
    """An int4 weight as GGUF Q4_K makes one: random codes, 6-bit sc and m per 32 columns, float16 d and dmin per
    256 (``cols`` a multiple of 256), carried as its own factors (Int4Weight.k_scales)."""
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    d, dmin = (rng.uniform(1e-4, 2e-3, (rows, cols // K_SUPER)).astype(np.float16) for _ in range(2))
    sc, mins = (rng.integers(0, 64, (rows, cols // 32), dtype=np.uint8) for _ in range(2))
    factors = Int4KScales(d, dmin, sc, mins)
    return Int4Weight(packed, *factors.scale_bias(), 32, factors)


def random_llama_weights(
    config: LlamaConfig, group_size: int = 128, seed: int = 0, symmetric: bool = False
) -> LlamaWeights:
    """Random int4 weights of ``config``'s shapes; ``symmetric``: as GGUF Q4_0 blocks (32-column groups, no
    zero point), the file's form, for runtimes that convert blocks themselves."""
    if symmetric and group_size != 32:
        raise InvalidArgumentError("symmetric (GGUF Q4_0) weights have 32-column groups")
    rng = np.random.default_rng(seed)
    d, f = config.dim, config.ffn_dim

    def matrix(rows: int, cols: int) -> Int4Weight | BlockWeight:
        return random_q4_0_weight(rows, cols, rng) if symmetric else random_int4(rows, cols, group_size, rng)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    layers = [
        LayerWeights(
            attn_norm=norm(),
            wq=matrix(config.q_dim, d),
            wk=matrix(config.kv_dim, d),
            wv=matrix(config.kv_dim, d),
            wo=matrix(d, config.q_dim),
            ffn_norm=norm(),
            w_gate=matrix(f, d),
            w_up=matrix(f, d),
            w_down=matrix(d, f),
        )
        for _ in range(config.n_layers)
    ]
    embedding = matrix(config.vocab_size, d)
    output = embedding if config.tied_embeddings else matrix(config.vocab_size, d)
    return LlamaWeights(embedding, layers, norm(), output)


COLD_BYTES_DEFAULT = 256 << 20  # assumed last-level cache when a backend does not report its own


def cold_copies(rt, weight: Int4Weight, max_copies: int = 64) -> list:
    """Prepared copies of ``weight``, together at least 4x the device's last-level cache (``cache_bytes`` in
    its details), so a benchmark cycling through them reads memory as a model does, not a warm cache: a
    4096x4096 int4 matrix (8.4 MB) fits in an H200's 50 MB L2, and timing it alone overstates its speed."""
    cache = int(rt.device.details.get("cache_bytes") or COLD_BYTES_DEFAULT)
    copies = max(1, min(max_copies, -(-4 * cache // max(1, weight.nbytes))))
    return [rt.prepare_weight(weight) for _ in range(copies)]
