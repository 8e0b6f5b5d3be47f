"""Check the matrix-unit int4 kernel (kernels/int4_mma.cl) against float64 over forced shapes, on a device where
it is native: UC 1, 2 and 4 (runs of chunks loaded ahead, with single chunks before and after them), three token
tiles, 32-, 64- and 128-column groups, gate|up with SiLU, partial row and token tiles. PoCL's emulation only runs
UC = 1.

    python scripts/check_mma_shapes.py        # one line per case, "OK" when NMSE < 1e-6; exit status 1 if any is not
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("PERFX_OPENCL_MMA", "1")

from perfx_opencl import ops  # noqa: E402

from perfx_core import reference  # noqa: E402
from perfx_core.plugins import get_registry  # noqa: E402
from perfx_core.synthetic import random_int4  # noqa: E402

# rows, k, group, tokens, SiLU
CASES = [
    (4096, 11008, 128, 16, False),
    (300, 11008, 128, 31, False),
    (200, 4096, 64, 9, True),
    (72, 4096, 32, 5, False),
    (72, 1152, 128, 20, True),
    (150, 4096, 128, 2, True),
    (72, 1152, 128, 24, False),
]
SHAPES = (
    "UC=1",
    "",
    "UC=2",
    "UC=4,KW=8",
    "UC=4,MT=1,NT8=4",
    "KW=2,UC=4",
    "NT8=3,UC=4",
    "MT=4,NT8=3,KW=2",
)  # "": the default rule


def main() -> int:
    rt = get_registry().open_runtime("opencl")
    print(f"{rt.device.name}: matrix units {'native' if rt.native_mma else 'emulated (UC = 1 only)'}")
    rng = np.random.default_rng(0)
    failures = 0
    try:
        for rows, k, group, n, silu in CASES:
            weight = random_int4(2 * rows if silu else rows, k, group, rng)
            x = rng.standard_normal((n, k)).astype(np.float32)
            want = reference.gate_up_silu(x, weight) if silu else reference.matmul(x, weight)  # float64
            w = rt.prepare_weight(weight)
            for shape in SHAPES:
                os.environ["PERFX_OPENCL_MMA_SHAPE"] = shape
                ops.mma_overrides.cache_clear()
                ops.clear_plans(rt)
                out = rt.empty((n, rows))
                (ops.gate_up_silu if silu else ops.int4_gemm)(rt, rt.from_numpy(x), w, out)
                got = rt.to_numpy(out)
                nmse = float(((got - want) ** 2).sum() / (want**2).sum())
                built = ops._mma_config(rt, n, rows, k, group, silu)
                ok = nmse < 1e-6
                failures += not ok
                print(f"{rows}x{k} g{group} n={n} silu={silu} {shape or 'default':<16} built {built}: "
                      f"nmse {nmse:.2e} {'OK' if ok else 'BAD'}")  # fmt: skip
    finally:
        os.environ.pop("PERFX_OPENCL_MMA_SHAPE", None)
        ops.mma_overrides.cache_clear()
        rt.close()
    print(f"{len(CASES) * len(SHAPES) - failures} OK, {failures} not")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
