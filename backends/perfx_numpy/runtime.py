"""NumPy runtime: tensors are NumPy arrays; int4 weights are kept packed and dequantized lazily on first use, int8
int5 and int6 weights stay as they are (their matmul dequantizes a block of rows at a time)."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from perfx_core.backend import Backend, DeviceInfo, KVCacheSpec, Runtime
from perfx_core.errors import BackendError
from perfx_core.weights import DenseWeight, Int4Weight, Int5Weight, Int6Weight, Int8Weight, Weight, dequantize


@dataclass(eq=False)
class NumpyWeight:
    """A weight as the NumPy ops see it: the host-format ``weight`` plus a float32 copy made on first use.

    Keeping the packed form lets a plugin op (e.g. a low-memory int4 GEMV) work without the float copy. An op that
    keeps a complete layout of its own (perfx-numba-cpu's blocked int4 codes) lets the host format's arrays go with
    ``hand_over``, so the weight is held once; ``weight`` is then rebuilt from that layout whenever an op asks for
    it, which only ops the plugin does not replace do.
    """

    _weight: Weight | None
    runtime: NumpyRuntime
    _float32: np.ndarray | None = field(default=None, repr=False)
    _rebuild: Callable[[], Weight] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        weight = self._weight
        self.shape: tuple[int, int] = weight.shape
        kinds = ((Int4Weight, "int4"), (Int8Weight, "int8"), (Int5Weight, "int5"), (Int6Weight, "int6"))
        self.kind = next((kind for cls, kind in kinds if isinstance(weight, cls)), "dense")

    @property
    def weight(self) -> Weight:
        return self._weight if self._weight is not None else self._rebuild()

    def hand_over(self, rebuild: Callable[[], Weight]) -> None:
        """Drop the host format's arrays; ``rebuild()`` makes the same weight again from the caller's layout."""
        self._weight, self._rebuild = None, rebuild

    def float32(self) -> np.ndarray:
        """(rows, cols) float32 values, computed once (counted in the runtime's allocated bytes)."""
        if self._float32 is None:
            weight = self.weight
            if isinstance(weight, DenseWeight) and weight.data.dtype == np.float32:
                self._float32 = weight.data
            else:
                self._float32 = self.runtime.track(dequantize(weight))
        return self._float32


@dataclass(eq=False)
class NumpyKVCache:
    spec: KVCacheSpec
    k: np.ndarray  # (layer, slot, kv_head, position, head_dim)
    v: np.ndarray


class NumpyRuntime(Runtime):
    backend_name = "numpy"
    weight_formats = frozenset({"int8", "int5", "int6"})

    def __init__(self, device: DeviceInfo):
        self.device = device

    def track(self, array: np.ndarray) -> np.ndarray:
        """Count ``array`` in allocated_bytes until it is garbage collected."""
        self.count_allocation(array, int(array.nbytes))
        return array

    def empty(self, shape, dtype=np.float32):
        return self.track(np.empty(shape, dtype=dtype))

    def from_numpy(self, array):
        return self.track(np.array(array, copy=True, order="C"))

    def to_numpy(self, tensor):
        return np.array(tensor, copy=True)

    def write(self, tensor, array) -> None:
        values = np.asarray(array, dtype=tensor.dtype)
        if values.size != tensor.size:
            raise BackendError(f"writing {values.size} elements into a tensor of {tensor.size}")
        tensor[...] = values.reshape(tensor.shape)

    def view(self, tensor, offset, shape):
        size = math.prod(shape)  # not np.prod: ~1 us instead of ~5 (a decode step takes ~10 views)
        flat = tensor.reshape(-1)
        if offset < 0 or offset + size > flat.size:
            raise BackendError(f"view [{offset}, {offset + size}) is outside a tensor of {flat.size} elements")
        return flat[offset : offset + size].reshape(shape)

    def prepare_weight(self, weight: Weight) -> NumpyWeight:
        # Counted while the host arrays live: for the model's lifetime, or until an op's layout takes their place
        self.count_allocation(weight, weight.nbytes)
        return NumpyWeight(weight, self)

    def weight_bytes(self, handle: NumpyWeight) -> int:
        """The host format's arrays, the float copy once made, and the layouts ops keep on the handle (a
        plugin's attribute holding arrays), each buffer counted once."""
        found: dict[int, int] = {}

        def add(value: Any) -> None:
            if isinstance(value, np.ndarray):
                base = value
                while isinstance(base.base, np.ndarray):
                    base = base.base
                found[id(base)] = base.nbytes

        weight = handle._weight  # None once handed over: the layout below holds the weight
        if weight is None:
            arrays: tuple[np.ndarray, ...] = ()
        elif isinstance(weight, DenseWeight):
            arrays = (weight.data,)
        elif isinstance(weight, Int8Weight):
            arrays = (weight.codes, weight.scale)
        elif isinstance(weight, Int5Weight | Int6Weight):
            arrays = weight.arrays
        else:
            arrays = (weight.packed, weight.scale, weight.bias)
        for array in arrays:
            add(array)
        add(handle._float32)
        for name, value in vars(handle).items():
            if name not in ("_weight", "runtime", "_float32", "_rebuild", "shape", "kind"):
                slots = getattr(type(value), "__slots__", ())
                for inner in (*getattr(value, "__dict__", {}).values(), *(getattr(value, s, None) for s in slots)):
                    add(inner)
        return sum(found.values())

    def new_kv_cache(self, spec: KVCacheSpec) -> NumpyKVCache:
        # The most sequences a cache here holds: ops that trade memory for batched-decode speed look at it.
        self.kv_slots = max(getattr(self, "kv_slots", 0), spec.n_slots)
        return NumpyKVCache(
            spec, self.track(np.zeros(spec.shape, dtype=spec.dtype)), self.track(np.zeros(spec.shape, dtype=spec.dtype))
        )

    def kv_cache_to_numpy(self, cache: NumpyKVCache):
        return cache.k.copy(), cache.v.copy()

    def kv_cache_from_numpy(self, cache: NumpyKVCache, k, v):
        cache.k[...] = k
        cache.v[...] = v

    def copy_kv_prefix(self, cache: NumpyKVCache, src_slot: int, dst_slot: int, length: int) -> None:
        for array in (cache.k, cache.v):
            array[:, dst_slot, :, :length] = array[:, src_slot, :, :length]


class NumpyBackend(Backend):
    name = "numpy"
    description = "NumPy on the CPU: the float32 reference every other backend is checked against"

    def devices(self) -> list[DeviceInfo]:
        name = platform.processor() or platform.machine() or "cpu"
        return [
            DeviceInfo(
                index=0,
                name=f"CPU ({name}, {os.cpu_count()} threads)",
                kind="cpu",
                memory_bytes=psutil.virtual_memory().total,
            )
        ]

    def open(self, device: int | str | None = None) -> NumpyRuntime:
        devices = self.devices()
        if device not in (None, 0, "0", "cpu", devices[0].name):
            raise BackendError(f"the numpy backend has one device, 0 ({devices[0].name}); got {device!r}")
        return NumpyRuntime(devices[0])
