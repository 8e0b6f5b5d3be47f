"""What a backend provides: devices, a runtime per opened device (memory, weights, KV cache) and ops.

A backend's tensors are opaque to the engine: the model only moves them between ops. The few things
that cross to the host (token ids, slots, positions) are NumPy int32 arrays, and logits come back
through ``Runtime.to_numpy``.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

# The layer shapes ops take, part of this contract (defined apart so the NumPy reference needs no backend).
from .specs import AttentionSpec as AttentionSpec
from .specs import KVCacheSpec
from .weights import Weight

if TYPE_CHECKING:
    from .ops import OpTable


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    kind: str  # "cpu" or "gpu"
    memory_bytes: int | None = None
    bandwidth_gbs: float | None = None  # peak memory bandwidth, when known (for achieved-GB/s views)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class RopeTable:
    """cos and sin (max_seq_len, head_dim // 2) float32 tensors on the device.

    Convention (Hugging Face "rotate half"): for i < head_dim/2, the pair (x[i], x[i + head_dim/2]) at
    position p becomes (x[i]*cos[p,i] - x[i+h]*sin[p,i], x[i+h]*cos[p,i] + x[i]*sin[p,i]).
    """

    cos: Any
    sin: Any


class Runtime(ABC):
    """One opened device of a backend. ``ops`` is filled in by the engine after ``Backend.open``."""

    backend_name: str
    device: DeviceInfo
    ops: OpTable
    # The KV-cache dtype a model gets when its caller names none ("float32" or "float16", KVCacheSpec.dtype).
    default_kv_dtype: str = "float32"
    # Prompt tokens per forward pass when the caller names none (LlamaModel's prefill_chunk).
    default_prefill_chunk: int = 256
    # File block formats (BlockWeight.block_format) that prepare_weight converts itself, on the device;
    # weights in any other block format reach it converted to Int4Weight by the host.
    block_formats: frozenset[str] = frozenset()
    # Host weight formats beyond int4 and dense that prepare_weight takes and whose ops (ops.FORMAT_OPS) the
    # runtime has: "int8" (Int8Weight), "int5" (Int5Weight), "int6" (Int6Weight). The engine converts weights in
    # any other format to one it takes or widens them (weights.for_runtime), and drops a format here whose ops no
    # plugin provides for the backend (plugins.Registry.open_runtime).
    weight_formats: frozenset[str] = frozenset()
    # Whether ``replay`` takes a device int32 tensor (the previous step's picks) for an index input: the next
    # step's ids then never cross to the host and back.
    device_index_inputs: bool = False

    # -- memory ----------------------------------------------------------------------------------------
    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A new uninitialised contiguous tensor; counted in allocated_bytes until freed."""

    @abstractmethod
    def from_numpy(self, array: np.ndarray) -> Any:
        """A new tensor holding a copy of ``array`` (same shape and dtype)."""

    @abstractmethod
    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A host copy of ``tensor``; waits for pending work on it."""

    def read_later(self, tensor: Any) -> Callable[[], np.ndarray]:
        """Queue a host copy of ``tensor`` in order with the device work queued so far (later work may then
        overwrite it) and return what waits for that copy. Synchronous runtimes copy now."""
        values = self.to_numpy(tensor)
        return lambda: values

    def write(self, tensor: Any, array: np.ndarray) -> None:
        """Overwrite ``tensor`` with ``array`` (same number of elements). Optional: used by the generic
        ``argmax`` op, which the model avoids on runtimes that lack it."""
        raise NotImplementedError(f"{type(self).__name__} cannot write into a tensor")

    @abstractmethod
    def view(self, tensor: Any, offset: int, shape: tuple[int, ...]) -> Any:
        """A tensor sharing ``tensor``'s storage, starting ``offset`` elements in, of ``shape`` (contiguous)."""

    @abstractmethod
    def prepare_weight(self, weight: Weight) -> Any:
        """Upload a weight once, in the layout this backend's matmul ops want; returns a handle."""

    def prepare_weights(self, weights: Sequence[Weight]) -> list[Any]:
        """prepare_weight of several weights that live as long as each other (a layer's matrices), which a
        runtime may place together (OpenCL: in shared buffers); this default prepares them one by one."""
        return [self.prepare_weight(w) for w in weights]

    def weight_bytes(self, handle: Any) -> int | None:
        """Bytes this runtime holds for a prepared weight now, every copy and layout of it included (``perfx
        bench`` reports them per weight); None where it cannot tell."""
        return None

    @abstractmethod
    def new_kv_cache(self, spec: KVCacheSpec) -> Any:
        """A zero-filled KV cache for ``spec``."""

    @abstractmethod
    def kv_cache_to_numpy(self, cache: Any) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) host copies in the canonical layout KVCacheSpec.shape."""

    @abstractmethod
    def kv_cache_from_numpy(self, cache: Any, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite the whole cache from host arrays in the canonical layout."""

    def copy_kv_prefix(self, cache: Any, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy k and v of positions 0..length-1, every layer and head, from one slot of ``cache`` to another,
        in order with the work queued before. This default goes through the host with the whole cache; the
        built-in runtimes copy on the device."""
        k, v = self.kv_cache_to_numpy(cache)
        for array in (k, v):
            array[:, dst_slot, :, :length] = array[:, src_slot, :, :length]
        self.kv_cache_from_numpy(cache, k, v)

    # -- memory accounting (shared by every runtime) ------------------------------------------------------
    _allocated = 0
    _peak = 0

    def count_allocation(self, owner: Any, nbytes: int) -> None:
        """Count ``nbytes`` in allocated_bytes until ``owner`` (the object holding the memory) is collected."""
        self._allocated += nbytes
        self._peak = max(self._peak, self._allocated)
        weakref.finalize(owner, self._release_allocation, nbytes)

    def _release_allocation(self, nbytes: int) -> None:
        self._allocated -= nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes this runtime holds now (weights, caches, buffers)."""
        return self._allocated

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest allocated_bytes seen since the runtime opened."""
        return self._peak

    def scratch(self, key: str, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A reusable work buffer for composite ops: grows on demand, never freed while the runtime lives."""
        buffers = self.__dict__.setdefault("_scratch_buffers", {})
        size = math.prod(shape)
        held = buffers.get((key, np.dtype(dtype).str))
        if held is None or held[1] < size:
            held = (self.empty((size,), dtype), size)
            buffers[(key, np.dtype(dtype).str)] = held
        return self.view(held[0], 0, shape)

    def tune(
        self, config: Any, quick: bool = False, progress: Any = None, group_size: int = 128, symmetric: bool = False
    ) -> dict[str, Any]:
        """Search kernel parameters for a model of ``config`` whose int4 weights have ``group_size``-column
        groups (``symmetric``: no zero point, GGUF Q4_0) on this device and cache the best (`perfx tune`);
        returns a summary. Backends without tunable kernels keep this default."""
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"backend {self.backend_name!r} has nothing to tune")

    # -- launch graphs (optional: asynchronous backends whose per-op host work matters) -----------------
    def graph_signature(self, positions: np.ndarray) -> Hashable | None:
        """What, besides the number of rows, decides the kernels a step (decode, or a prefill chunk whose last
        position is max(positions)) queues; None when this runtime does not capture graphs (then every step
        runs its ops, the default)."""
        return None

    def begin_capture(self, inputs: tuple[str, ...]) -> None:
        """Start recording what the ops queue; ``inputs`` name the index uploads a replay will supply."""
        raise NotImplementedError

    def end_capture(self) -> Any:
        """Stop recording; the graph, or None when what was recorded cannot be replayed."""
        raise NotImplementedError

    def replay(self, graph: Any, inputs: dict[str, np.ndarray]) -> None:
        """Queue a captured graph again with new index inputs (same sizes as when it was captured)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for all queued device work (a no-op for synchronous backends)."""

    def close(self) -> None:
        """Release device resources."""


class Backend(ABC):
    """A registered backend: a name, a description, its devices, and how to open one."""

    name: str
    description: str = ""

    @abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Devices this backend can use; raise BackendUnavailableError with the reason when there are none."""

    @abstractmethod
    def open(self, device: int | str | None = None) -> Runtime:
        """Open a device by index or (sub)name; None picks the best one."""
