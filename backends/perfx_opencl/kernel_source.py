"""Where the OpenCL C sources live and how a kernel file's program text is put together.

At the bottom of the backend's imports: the runtime builds programs from it and the tuning cache hashes it.
"""

from __future__ import annotations

import functools
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
# Prepended to every kernel file: the device-wide fence, the add + RMSNorm tail of the matmul kernels, the int4
# weights' group bias and the gated MLP's activations.
KERNEL_PRELUDE = ("device_fence.cl", "add_norm_tail.cl", "int4_group.cl", "gate_activation.cl")
# Pieces only some kernel files need, after the prelude: the KV cache's layout, the matrix units, the int8 weights'
# layout and byte decoding, the tiled GEMMs' loads, multiply-adds and stores.
FILE_PRELUDES = {
    "attention": ("kv_layout.cl",),
    "attention_mma": ("kv_layout.cl", "mma.cl"),
    "int4_mma": ("mma.cl",),
    "int4_gemm": ("gemm_tile.cl",),
    "int8": ("int8_weight.cl",),
    "int8_gemm": ("int8_weight.cl", "gemm_tile.cl"),
    "int8_mma": ("mma.cl", "int8_weight.cl"),
}


def paths(file: str) -> list[Path]:
    """The files whose text makes up the program of ``kernels/<file>.cl``, in order."""
    names = (*KERNEL_PRELUDE, *FILE_PRELUDES.get(file, ()), f"{file}.cl")
    return [KERNEL_DIR / name for name in names]


def program_source(file: str) -> str:
    """Kernel file ``file`` behind the shared pieces (text, not #includes: no include path to set)."""
    return "".join(path.read_text() for path in paths(file))


@functools.cache
def mentions(file: str, name: str) -> bool:
    """Whether ``name`` (a define) appears in the program text of ``kernels/<file>.cl``: where it does not, defining
    it cannot change the program, so a build without it is the same binary (and cache entry)."""
    return name in program_source(file)
