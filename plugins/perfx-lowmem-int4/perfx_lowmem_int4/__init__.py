"""perfx-lowmem-int4: int4 matmuls for the NumPy backend that keep every weight packed (~4.5 bits) in memory.

The NumPy backend multiplies by a float32 copy of each int4 weight, made on first use and kept: 32 bits
per weight, so a 7B model needs ~28 GB. These replacements of ``int4_gemv`` and ``int4_gemm`` walk the
packed weight a block of rows at a time, dequantize the block into one reused scratch buffer and multiply
it with BLAS. Memory holds the packed weights plus a few MB; every call pays for the dequantization.
"""

from __future__ import annotations

import numpy as np

from perfx_core.errors import InvalidArgumentError
from perfx_core.hookspecs import hookimpl
from perfx_core.weights import Int4Weight

PRIORITY = 10  # above the NumPy backend's own ops (0), so installing the plugin is enough to use it

# Block sizes, measured on a 2-core x86 VM (README.md): a gemv block that stays in the 2 MB L2 cache between
# being written and being read by BLAS is ~35% faster than a 4 MB one; batched calls amortize better on
# larger blocks. The scratch buffer therefore grows to GEMM_BLOCK_BYTES at most.
GEMV_BLOCK_BYTES = 1 << 20
GEMM_BLOCK_BYTES = 4 << 20


def int4_matmul(rt, x, w, out) -> None:
    """out (n, m) = x (n, k) @ w.T for an int4 weight handle of the NumPy backend, never dequantizing it whole.

    With w[r, c] = q[r, c] * scale[r, c // g] + bias[r, c // g], the bias part is a small matmul of x's
    per-group sums with the bias matrix, so a block only needs q * scale: two passes instead of three.
    """
    weight = w.weight
    if not isinstance(weight, Int4Weight):
        raise InvalidArgumentError(f"perfx-lowmem-int4 got a {w.kind} weight; int4_gemv/int4_gemm take int4 weights")
    n = x.shape[0]
    m, k = weight.shape
    g = weight.group_size
    groups, half = k // g, g // 2
    block_bytes = GEMV_BLOCK_BYTES if n == 1 else GEMM_BLOCK_BYTES
    rows = max(1, min(m, block_bytes // (4 * k)))
    values = rt.scratch("lowmem_int4.values", (rows, k))  # float32 q * scale of one block
    codes = rt.scratch("lowmem_int4.codes", (rows, k // 2), np.uint8)  # one nibble of each packed byte
    group_sums = x.reshape(n, groups, g).sum(axis=-1)  # (n, groups): what multiplies the biases
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block, nibbles = values[: r1 - r0], codes[: r1 - r0]
        # Columns 2j and 2j + 1 are the low and high nibbles of byte j (perfx_core.weights); the multiply
        # converts the codes to float32 and scales them in one pass, writing each nibble to its columns.
        pairs = block.reshape(r1 - r0, groups, half, 2)
        scale, bias = weight.factors(slice(r0, r1))
        scale = scale[:, :, None]
        np.bitwise_and(weight.packed[r0:r1], 0x0F, out=nibbles)
        np.multiply(nibbles.reshape(r1 - r0, groups, half), scale, out=pairs[..., 0])
        np.right_shift(weight.packed[r0:r1], 4, out=nibbles)
        np.multiply(nibbles.reshape(r1 - r0, groups, half), scale, out=pairs[..., 1])
        target = out[:, r0:r1]
        np.matmul(x, block.T, out=target)
        target += group_sums @ bias.T


@hookimpl
def perfx_register_ops(register):
    register("numpy", "int4_gemv", int4_matmul, priority=PRIORITY)
    register("numpy", "int4_gemm", int4_matmul, priority=PRIORITY)
