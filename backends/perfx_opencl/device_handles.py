"""The device handles the runtime hands out and the ops' kernels take: tensors (views into device buffers) and
prepared weights (runtime.py prepare_weights), each weight carrying ``kind`` (perfx_core.ops.weight_kind) and
``shape``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


class Allocation:
    """One device buffer; its bytes count in the runtime's allocated_bytes until it is garbage collected."""

    def __init__(self, buffer: Any, nbytes: int):
        self.buffer = buffer
        self.nbytes = nbytes
        self.image: Any = None  # an image1d_buffer over the buffer, made on demand (Adreno GEMV)


class CLTensor:
    """A contiguous row-major tensor ``offset`` elements into an allocation."""

    __slots__ = ("alloc", "offset", "shape", "dtype")

    def __init__(self, alloc: Allocation, offset: int, shape: tuple[int, ...], dtype: np.dtype):
        self.alloc = alloc
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    @property
    def buffer(self) -> Any:
        return self.alloc.buffer

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"CLTensor(shape={self.shape}, dtype={self.dtype}, offset={self.offset})"


@dataclass(eq=False)
class CLInt4Weight:
    """An int4 weight as uploaded, chunk-major (kernels/int4.cl): packed (k/32, m, 16) uint8, scale (k/g, m)
    float16, bias (k/g, m) float32; no bias for a GGUF Q4_0 weight, whose biases are -8 * scale; with
    ``k_factors`` a GGUF Q4_K's own factors instead: scale (k/32, m) sc | m << 8, bias (k/256, m) the float16 bits
    d | -dmin << 16 (int4_group.cl)."""

    shape: tuple[int, int]
    group_size: int
    packed: CLTensor
    scale: CLTensor
    bias: CLTensor | None
    k_factors: bool = False
    kind: str = "int4"


@dataclass(eq=False)
class CLInt8Weight:
    """An int8 weight as uploaded, chunk-major (kernels/int8_weight.cl): codes (k/16, m, 16) int8, scale (k/g, m)
    float16 or float32, as the host weight has it; also an int6 or Q5_0 weight expanded to this form for the
    matrix units (ops._as_int8: float32 scales per 16 columns, d * sub being exact only in float32)."""

    shape: tuple[int, int]
    group_size: int
    codes: CLTensor
    scale: CLTensor
    kind: str = "int8"


@dataclass(eq=False)
class CLSplitWeight:
    """A GGUF 5- or 6-bit weight as uploaded (kernels/int8_weight.cl's int6 and int5 forms): its planes by name,
    chunk-major. int6: lo, hi, sub, d; int5: lo, hi, scale and bias (none for a Q5_0 weight: -16 * scale)."""

    shape: tuple[int, int]
    kind: str  # "int5" or "int6"
    planes: dict[str, CLTensor]

    group_size = 32  # the int5 form's groups (int6's sub-scales are per 16 columns, fixed in the kernels)


@dataclass(eq=False)
class CLDenseWeight:
    shape: tuple[int, int]
    data: CLTensor  # float32 or float16 (m, k)
    kind: str = "dense"
