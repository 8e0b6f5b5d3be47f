"""The pyopencl runtime shared by the ``opencl`` and ``opencl-adreno`` backends: one opened device's buffers,
programs, launches and recorded steps (backend.py finds the devices and opens runtimes; ops.py queues kernels).

Tensors are ``CLTensor``s: a buffer plus an element offset, so ``view`` is free and kernels take
(pointer, offset) pairs (sub-buffers would bring alignment rules). Kernels live in ``kernels/*.cl``; each
program is built once per context and options, and a build failure raises ``KernelBuildError`` with the log.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfx_core.backend import DeviceInfo, KVCacheSpec, Runtime
from perfx_core.errors import BackendError, BackendUnavailableError, InvalidArgumentError
from perfx_core.split_weights import Int5Weight, Int6Weight
from perfx_core.weights import BlockWeight, DenseWeight, Int4KScales, Int4Weight, Int8Weight, Weight

from . import kernel_source, native_replay, ops, program_cache, tuner
from .device_handles import Allocation, CLDenseWeight, CLInt4Weight, CLInt8Weight, CLSplitWeight, CLTensor
from .flush_policy import FLUSH_EVERY, REPLAY_EARLY_FLUSHES
from .kernel_source import program_source

log = logging.getLogger("perfx.opencl")


class KernelBuildError(BackendError):
    """An OpenCL program failed to build; ``log`` holds the compiler's build log."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def load_pyopencl() -> Any:
    try:
        import pyopencl
    except ImportError as exc:
        raise BackendUnavailableError(
            f"pyopencl is not installed ({exc}); run `pip install 'perfx[opencl]'` (and pocl-binary-distribution "
            "for OpenCL on the CPU)"
        ) from None
    return pyopencl


def _native_replayer() -> Any:
    """The native replayer (native_replay.py) for graphs recorded now, or None (off, or not buildable here)."""
    return native_replay.replayer() if native_replay.enabled() else None


@contextmanager
def check(what: str) -> Iterator[None]:
    """Turn a pyopencl/driver error raised while doing ``what`` into a BackendError that says so."""
    cl = load_pyopencl()
    try:
        yield
    except cl.Error as exc:
        raise BackendError(f"OpenCL: {what} failed: {exc}") from exc


MAX_CACHED_LAUNCHES = 16384  # a 7B decode step makes ~160 distinct launches per batch size; prefill adds a few per size

# -- devices ---------------------------------------------------------------------------------------------


@dataclass
class _DeviceState:
    """One context and in-order queue per device, shared by every runtime opened on it in this process,
    with the programs built for it (keyed by kernel file and build options)."""

    context: Any
    queue: Any
    programs: dict[tuple[str, str, tuple[str, ...]], Any]
    kernels: dict[tuple[int, str], Any]
    # A native replay whose thread may still be queueing on `queue` (OpenCLRuntime.queue joins it first), with
    # the lock that lets only one caller join it.
    replaying: Any = None
    replay_lock: threading.Lock = field(default_factory=threading.Lock)


_device_states: dict[tuple[str, str, int], _DeviceState] = {}


def device_state(index: int, platform: Any, device: Any) -> _DeviceState:
    key = (platform.name, device.name, index)
    if key not in _device_states:
        cl = load_pyopencl()
        with check(f"creating a context on {device.name.strip()}"):
            context = cl.Context([device])
            # PERFX_OPENCL_PROFILE=1 records every kernel's device time (benchmarks); it costs a little per launch.
            properties = cl.command_queue_properties.PROFILING_ENABLE if os.environ.get("PERFX_OPENCL_PROFILE") else 0
            queue = cl.CommandQueue(context, device, properties=properties)
        _device_states[key] = _DeviceState(context, queue, {}, {})
    return _device_states[key]


# -- the KV cache ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class CLKVCache:
    spec: KVCacheSpec
    k: CLTensor  # (layer, slot, kv_head, position, head_dim), spec.dtype
    v: CLTensor


# -- graphs ----------------------------------------------------------------------------------------------


class _Capture:
    """What the ops queue while a graph is recorded: index uploads by key, then the launches in order."""

    def __init__(self, inputs: frozenset[str]):
        self.inputs = inputs
        self.uploads: dict[str, tuple[Allocation, int]] = {}
        self.values: dict[str, np.ndarray] = {}
        self.launches: list[tuple[Any, tuple[int, ...], tuple[int, ...] | None, str]] = []
        self.keep: list[tuple[Any, ...]] = []  # every launch's arguments (buffers), alive as long as the graph
        self.broken = ""  # why the recording cannot be replayed

    def upload(self, key: str, alloc: Allocation, host: np.ndarray) -> None:
        if key in self.values and not np.array_equal(self.values[key], host):
            self.broken = f"two different uploads of {key} in one step"
        self.uploads.setdefault(key, (alloc, host.size))
        self.values.setdefault(key, host)


@dataclass(frozen=True)
class _Graph:
    uploads: tuple[tuple[str, tuple[Allocation, int]], ...]  # key, (buffer, number of values)
    launches: tuple[tuple[Any, tuple[int, ...], tuple[int, ...] | None, str], ...]  # kernel, sizes, name
    # The launches' arguments: pyopencl's set_args does not keep buffers alive, and a scratch buffer that has
    # since grown (or a launch evicted from the cache) must not be freed while the graph can replay it.
    keep: tuple[tuple[Any, ...], ...]
    native: Any = None  # the launches laid out for a native replay (native_replay.ReplayPlan), where there is one


# -- the runtime -----------------------------------------------------------------------------------------


# GGML (bytes, weights) per block of the file formats prepare_weight re-packs itself
_BLOCKS = {"q4_0": (18, 32), "q4_1": (20, 32), "q4_k": (144, 256)}
_ELEM_BYTES = {"uchar": 1, "ushort": 2, "uint": 4, "uint2": 8, "uint4": 16}  # kernels/layout.cl's ELEMs
_CHUNK = 16  # columns per chunk of the byte-decoded forms (kernels/int8_weight.cl)
# Weights' shared buffers (prepare_weights): rounded up to the 2 MiB that NVIDIA's driver rounds a buffer over
# 1 MiB to (measured: 16 buffers of 1 MiB + 4 KiB took 32 MiB, of 2.6875 MiB 64), at most 1 GiB each.
_ARENA_ROUNDING = 2 << 20
_ARENA_MAX = 1 << 30


def _placed_layout(weight: Weight) -> list[tuple[tuple[int, ...], np.dtype]] | None:
    """The (shape, dtype)s of the device arrays of a weight placed in shared buffers (an int4 one's packed, scale,
    bias, a Q4_0 file's without bias; an int5 or int6 one's planes, _split_layout), or None for one with buffers of
    its own."""
    if isinstance(weight, (Int5Weight, Int6Weight)):
        return list(_split_layout(weight).values())
    if isinstance(weight, Int4Weight):
        m, k = weight.shape
        if weight.k_scales is not None:
            return _q4_k_layout(m, k)
        flip = lambda a: ((a.shape[1], a.shape[0]), a.dtype)  # noqa: E731  [group][row]
        return [((k // 32, m, 16), np.dtype(np.uint8)), flip(weight.scale), flip(weight.bias)]
    if isinstance(weight, BlockWeight) and weight.block_format in _BLOCKS:
        m, k = weight.shape
        if weight.block_format == "q4_k":
            return _q4_k_layout(m, k)
        parts = [((k // 32, m, 16), np.dtype(np.uint8)), ((k // 32, m), np.dtype(np.float16))]
        return parts if weight.block_format == "q4_0" else parts + [((k // 32, m), np.dtype(np.float32))]
    return None


def _split_layout(weight: Int5Weight | Int6Weight) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """An int6 or int5 weight's planes on the device (kernels/int8_weight.cl), by name: lo and hi (split_blocks.cl
    makes them), then sub and d, or scale and bias (none for Q5_0, _is_q5_0), [group][row] as the host's transposed."""
    m, k = weight.shape
    planes = {"lo": ((k // _CHUNK, m, 2), np.dtype(np.uint32))}
    if isinstance(weight, Int6Weight):
        planes["hi"] = ((k // _CHUNK, m), np.dtype(np.uint32))
        names: tuple[str, ...] = ("sub", "d")
    else:
        planes["hi"] = ((k // 32, m), np.dtype(np.uint32))
        names = ("scale",) if _is_q5_0(weight) else ("scale", "bias")
    for name in names:
        host = getattr(weight, name)
        planes[name] = ((host.shape[1], m), host.dtype)
    return planes


def _is_q5_0(weight: Int5Weight) -> bool:
    """Whether every bias is -16 times its scale (GGUF Q5_0): such a weight is stored and read without them."""
    return bool(np.array_equal(weight.bias.astype(np.float32), -16.0 * weight.scale.astype(np.float32)))


def _q4_k_layout(m: int, k: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """A Q4_K weight's arrays: its codes, sc | m << 8 per group and d | -dmin << 16 per 256 columns (int4_group.cl)."""
    return [
        ((k // 32, m, 16), np.dtype(np.uint8)),
        ((k // 32, m), np.dtype(np.uint16)),
        ((k // 256, m), np.dtype(np.uint32)),
    ]


def _q4_k_factor_words(factors: Int4KScales) -> tuple[np.ndarray, np.ndarray]:
    """(sc | m << 8 as uint16, the float16 bits d | -dmin << 16 as uint32), each (rows, ...) as the host holds them."""
    group_words = factors.sc.astype(np.uint16) | (factors.m.astype(np.uint16) << 8)
    minus_dmin = (-factors.dmin).view(np.uint16).astype(np.uint32)
    super_words = factors.d.view(np.uint16).astype(np.uint32) | (minus_dmin << 16)
    return group_words, super_words


class OpenCLRuntime(Runtime):
    """One opened OpenCL device. ``variant`` is "generic" or "adreno" (kernels built with -DADRENO)."""

    block_formats = frozenset(_BLOCKS)
    # Int8Weight, Int5Weight and Int6Weight stay as they are on the device (ops.int8_gemm, int5_gemm, int6_gemm)
    weight_formats = frozenset({"int8", "int5", "int6"})
    device_index_inputs = True

    def __init__(self, backend_name: str, info: DeviceInfo, device: Any, state: _DeviceState, variant: str):
        self.backend_name = backend_name
        self.device = info
        self.cl = load_pyopencl()
        self.cl_device = device
        self.context = state.context
        self._queue = state.queue
        self._state = state
        self.variant = variant
        # The Adreno GEMV reads activations through the texture cache when the device has images.
        self.use_images = variant == "adreno" and bool(device.image_support)
        self._image_max_texels = int(device.image_max_buffer_size) if self.use_images else 0
        self._index_buffers: dict[str, tuple[Allocation, np.ndarray | None]] = {}  # device buffer, last values sent
        self._zeroed: dict[str, CLTensor] = {}  # see zeroed_ints
        self._arenas: list[list[Any]] = []  # weights' shared buffers: [weak reference, bytes used, capacity]
        self._capture: _Capture | None = None  # see begin_capture
        self.tuning_generation = 0  # bumped by tune(): part of the graph signature
        self._closed = False
        self._kernels: dict[tuple, Any] = {}
        self._launches: dict[tuple, tuple[Any, tuple[Any, ...]]] = {}  # see launch()
        self.launch_count = 0  # kernels queued since open: benchmarks report launches per token
        # Where opening and loading spent their time (perfx bench reports it): programs built or read from the
        # program cache, weights uploaded and re-packed (seconds of host time, queued device work included).
        self.load_stats = {"programs_built": 0, "programs_from_cache": 0, "program_s": 0.0, "weights_s": 0.0}
        self.kernel_events: list[tuple[str, Any]] | None = [] if os.environ.get("PERFX_OPENCL_PROFILE") else None

    @property
    def default_kv_dtype(self) -> str:
        """float16 on GPUs: decode attention streams half the bytes per position (storage only, vload_half and
        vstore_half: no cl_khr_fp16 needed); float32 on CPUs (PoCL), where the bytes matter less."""
        return "float16" if self.device.kind == "gpu" else "float32"

    @property
    def default_prefill_chunk(self) -> int:
        """512 prompt tokens per forward pass on desktop GPUs (llama.cpp's default micro-batch): a 256-token chunk
        of a 7B's attention is 128 work-groups on the H200's 132 compute units; 256 on CPUs and phones (the
        adreno variant), whose memory the larger activation buffers would take."""
        return 512 if self.device.kind == "gpu" and self.variant != "adreno" else 256

    @property
    def queue(self) -> Any:
        """The command queue, once a native replay still queueing on the device's queue (replay) has finished:
        every use of the queue, by this runtime or another on the same device, goes through here, so nothing is
        queued or read ahead of a replayed step's kernels."""
        if self._state.replaying is not None:
            self._finish_native_replay()
        return self._queue

    @queue.setter
    def queue(self, queue: Any) -> None:
        if self._state.replaying is not None:
            self._finish_native_replay()
        self._queue = queue

    def _finish_native_replay(self) -> None:
        state = self._state
        with state.replay_lock:
            replaying, state.replaying = state.replaying, None
            if replaying is not None:
                replaying.join()  # raises BackendError if the driver refused a launch

    # -- memory ----------------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, hostbuf: np.ndarray | None = None) -> Allocation:
        cl = self.cl
        flags = cl.mem_flags.READ_WRITE
        if hostbuf is not None and self._capture is not None:
            self._capture.broken = "an upload of a new buffer"  # its contents would be stale in a replay
        with check(f"allocating {nbytes} bytes"):
            if hostbuf is not None and nbytes > 0:
                buffer = cl.Buffer(self.context, flags | cl.mem_flags.COPY_HOST_PTR, hostbuf=hostbuf)
            else:
                buffer = cl.Buffer(self.context, flags, max(nbytes, 4))  # OpenCL has no empty buffers
        alloc = Allocation(buffer, nbytes)
        self.count_allocation(alloc, nbytes)
        return alloc

    def empty(self, shape, dtype=np.float32) -> CLTensor:
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        return CLTensor(self._allocate(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize), 0, shape, dtype)

    def from_numpy(self, array) -> CLTensor:
        array = np.ascontiguousarray(array)
        return CLTensor(self._allocate(array.nbytes, array), 0, array.shape, array.dtype)

    def to_numpy(self, tensor: CLTensor) -> np.ndarray:
        if self._capture is not None:
            self._capture.broken = "a read back to the host"  # host work between kernels is not replayed
        host = np.empty(tensor.shape, dtype=tensor.dtype)
        if host.size:
            with check("reading a tensor back"):
                self.cl.enqueue_copy(
                    self.queue, host, tensor.buffer, src_offset=tensor.offset * tensor.dtype.itemsize, is_blocking=True
                )
        return host

    def read_later(self, tensor: CLTensor) -> Callable[[], np.ndarray]:
        if self._capture is not None:
            self._capture.broken = "a read back to the host"
        host = np.empty(tensor.shape, dtype=tensor.dtype)
        if not host.size:
            return lambda: host
        with check("reading a tensor back"):
            event = self.cl.enqueue_copy(
                self.queue, host, tensor.buffer, src_offset=tensor.offset * tensor.dtype.itemsize, is_blocking=False
            )

        def wait() -> np.ndarray:
            with check("reading a tensor back"):
                event.wait()
            return host

        return wait

    def write(self, tensor: CLTensor, array: np.ndarray) -> None:
        """Overwrite ``tensor`` with ``array`` (same number of elements, converted to the tensor's dtype)."""
        if self._capture is not None:
            self._capture.broken = "a blocking write"
        host = np.ascontiguousarray(array, dtype=tensor.dtype).reshape(-1)
        if host.size != tensor.size:
            raise InvalidArgumentError(f"writing {host.size} elements into a tensor of {tensor.size}")
        if host.size:
            with check("writing a tensor"):
                self.cl.enqueue_copy(
                    self.queue, tensor.buffer, host, dst_offset=tensor.offset * tensor.dtype.itemsize, is_blocking=True
                )

    def view(self, tensor: CLTensor, offset: int, shape) -> CLTensor:
        shape = tuple(int(s) for s in shape)
        size = math.prod(shape)
        if offset < 0 or offset + size > tensor.size:
            raise BackendError(f"view [{offset}, {offset + size}) is outside a tensor of {tensor.size} elements")
        return CLTensor(tensor.alloc, tensor.offset + offset, shape, tensor.dtype)

    def upload_ints(self, key: str, values: np.ndarray) -> Any:
        """A device int32 buffer holding ``values`` (ids, slots, positions), reused per ``key`` and grown as needed.

        The copy is queued without waiting (pyopencl keeps the host copy alive); the in-order queue puts it
        after the kernels that read the previous contents. Values equal to the last upload under ``key`` are
        not sent again: every layer of a decode step passes the same slots and positions.
        """
        host = np.array(values, dtype=np.int32, copy=True).reshape(-1)
        held = self._index_buffers.get(key)
        if held is not None and held[1] is not None and held[1].size == host.size and np.array_equal(held[1], host):
            if self._capture is not None:
                self._capture.upload(key, held[0], host)
            return held[0].buffer
        capacity = held[0].nbytes // 4 if held is not None else 0
        alloc = (
            held[0]
            if held is not None and capacity >= host.size
            else self._allocate(max(64, 1 << int(host.size - 1).bit_length()) * 4)
        )
        self._index_buffers[key] = (alloc, host)
        if self._capture is not None:
            self._capture.upload(key, alloc, host)
        if host.size:
            with check(f"uploading {key}"):
                self.cl.enqueue_copy(self.queue, alloc.buffer, host, is_blocking=False)
        return alloc.buffer

    def zeroed_ints(self, key: str, size: int) -> CLTensor:
        """An int32 device buffer of at least ``size`` zeros, kept per ``key``; kernels that count in it (the
        last-work-group-merges pattern) set their counters back to zero when done, so it is filled only once."""
        held = self._zeroed.get(key)
        if held is None or held.size < size:
            held = self._zeroed[key] = self.empty((max(size, 256),), np.int32)
            with check(f"zero-filling {key}"):
                self.cl.enqueue_fill_buffer(self.queue, held.buffer, np.int32(0), 0, held.alloc.nbytes)
        return held

    def image_of(self, tensor: CLTensor) -> Any | None:
        """An image1d_buffer (one float per texel) over the whole buffer of a float32 tensor, or None if unusable."""
        alloc = tensor.alloc
        texels = alloc.nbytes // 4
        if not self.use_images or tensor.dtype != np.float32 or not 0 < texels <= self._image_max_texels:
            return None
        if alloc.image is None:
            cl = self.cl
            fmt = cl.ImageFormat(cl.channel_order.R, cl.channel_type.FLOAT)
            try:
                alloc.image = cl.create_image(
                    self.context, cl.mem_flags.READ_ONLY, fmt, shape=(texels,), buffer=alloc.buffer
                )
            except cl.Error:
                self.use_images = False  # the driver refuses buffer images: use the plain buffer path from now on
                return None
        return alloc.image

    # -- weights and cache -----------------------------------------------------------------------------
    def prepare_weight(self, weight: Weight):
        return self.prepare_weights([weight])[0]

    def prepare_weights(self, weights: list[Weight]) -> list:
        """Device handles of ``weights`` (a layer's matrices). Their int4 arrays share buffers (_place_parts):
        NVIDIA's driver rounds each buffer over 1 MiB up to 2 MiB, which cost a 7B Q4_0 145 MiB with one buffer
        per array, and 15 MiB placed a layer to a buffer (H200); so do their int5 and int6 planes. Other weights
        get buffers of their own."""
        start = time.perf_counter()
        try:
            layouts = [_placed_layout(w) for w in weights]
            placed = iter(self._place_parts([part for layout in layouts if layout for part in layout]))
            return [
                self._prepare(w, [next(placed) for _ in layout] if layout else None)
                for w, layout in zip(weights, layouts, strict=True)
            ]
        finally:
            self.load_stats["weights_s"] += time.perf_counter() - start

    def _place_parts(self, parts: list[tuple[tuple[int, ...], np.dtype]]) -> list[CLTensor]:
        """Tensors of these (shape, dtype)s, each where it fits in what earlier calls' buffers have left at their
        ends (they were rounded up: the driver would round them anyway), the others together in new buffers of
        at most _ARENA_MAX bytes (kernels take int32 byte offsets). Buffers are held by their tensors only."""
        self._arenas = [a for a in self._arenas if a[0]() is not None]
        align = max(256, int(self.cl_device.mem_base_addr_align) // 8)
        cap = min(_ARENA_MAX, int(self.cl_device.max_mem_alloc_size))
        sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in parts]
        where: list[tuple[Allocation, int] | None] = [None] * len(parts)
        for i, nbytes in enumerate(sizes):
            for arena in self._arenas:
                alloc = arena[0]()
                if alloc is not None and arena[2] - arena[1] >= nbytes:
                    where[i], arena[1] = (alloc, arena[1]), arena[1] + -(-nbytes // align) * align
                    break
        groups: list[list[int]] = []
        for i in (i for i, w in enumerate(where) if w is None):
            if not groups or sum(-(-sizes[j] // align) * align for j in groups[-1]) + sizes[i] > cap:
                groups.append([])
            groups[-1].append(i)
        for group in groups:
            total = sum(-(-sizes[j] // align) * align for j in group)
            capacity = -(-total // _ARENA_ROUNDING) * _ARENA_ROUNDING if total > _ARENA_ROUNDING // 2 else total
            alloc = self._allocate(min(capacity, max(total, cap)))
            used = 0
            for j in group:
                where[j], used = (alloc, used), used + -(-sizes[j] // align) * align
            self._arenas.append([weakref.ref(alloc), used, alloc.nbytes])
        return [
            CLTensor(alloc, offset // np.dtype(dtype).itemsize, shape, np.dtype(dtype))
            for (alloc, offset), (shape, dtype) in zip(where, parts, strict=True)
        ]

    def _prepare(self, weight: Weight, parts: list[CLTensor] | None):
        """One weight's device handle; an int4, int5 or int6 one's arrays go into ``parts`` (its _placed_layout)."""
        if isinstance(weight, Int4Weight):
            m, k = weight.shape
            # Chunk-major layout (kernels/int4.cl): 16-byte chunks of 32 codes, [chunk][row]; scale (float16
            # bits, read with vload_half) and bias [group][row], or a Q4_K's own factors in their place.
            factors = weight.k_scales
            scale, bias = (weight.scale, weight.bias) if factors is None else _q4_k_factor_words(factors)
            return CLInt4Weight(
                weight.shape,
                weight.group_size,
                self._transposed(weight.packed.reshape(m, k // 32, 16), "uint4", parts[0]),
                self._transposed(scale, "ushort", parts[1]),
                self._transposed(bias, "uint", parts[2]),
                k_factors=factors is not None,
            )
        if isinstance(weight, Int8Weight):
            m, k = weight.shape
            # Chunk-major too (kernels/int8_weight.cl): 16-byte chunks of 16 codes [chunk][row], scale
            # [group][row] in its own dtype (float16 bits or float32).
            return CLInt8Weight(
                weight.shape,
                weight.group_size,
                self._transposed(weight.codes.reshape(m, k // 16, 16), "uint4"),
                self._transposed(weight.scale, "ushort" if weight.scale.dtype == np.float16 else "uint"),
            )
        if isinstance(weight, (Int5Weight, Int6Weight)):
            return self._split(weight, parts)
        if isinstance(weight, DenseWeight):
            return CLDenseWeight(weight.shape, self.from_numpy(weight.data))
        if isinstance(weight, BlockWeight) and weight.block_format in _BLOCKS:
            return self._from_blocks(weight, parts)
        raise InvalidArgumentError(f"the OpenCL backend cannot prepare a {type(weight).__name__}")

    def weight_bytes(self, handle: CLInt4Weight | CLInt8Weight | CLSplitWeight | CLDenseWeight) -> int:
        if handle.kind == "int4":
            tensors = (handle.packed, handle.scale, handle.bias)
        elif handle.kind in ("int5", "int6"):
            tensors = tuple(handle.planes.values())
        else:
            tensors = (handle.codes, handle.scale) if handle.kind == "int8" else (handle.data,)
        return sum(t.size * t.dtype.itemsize for t in tensors if t is not None)

    def _from_blocks(self, weight: BlockWeight, parts: list[CLTensor]) -> CLInt4Weight:
        """A GGUF Q4_0/Q4_1/Q4_K weight from the file's own bytes: the parts are copied into one device buffer as
        they are, and re-packed into the int4 layout there (kernels/q4_blocks.cl), so the host converts nothing."""
        m, k = weight.shape
        block_bytes, per_block = _BLOCKS[weight.block_format]
        blocks = k // per_block
        staged = self.empty((m * blocks * block_bytes,), np.uint8)
        row = 0
        with check(f"uploading a {weight.block_format} weight ({m}x{k})"):
            for part in weight.parts:
                if part.shape != (part.shape[0], blocks * block_bytes):
                    raise InvalidArgumentError(f"a {weight.block_format} part of shape {part.shape} does not fit k={k}")
                self.cl.enqueue_copy(
                    self.queue, staged.buffer, np.ascontiguousarray(part), dst_offset=row * blocks * block_bytes
                )
                row += part.shape[0]
        has_min = weight.block_format != "q4_0"
        # Q4_0 has no bias part (_int4_layout): it is -8 * scale; Q4_K's is its d and dmin (int4_group.cl)
        k_factors = weight.block_format == "q4_k"
        out = CLInt4Weight(weight.shape, 32, parts[0], parts[1], parts[2] if has_min else None, k_factors)
        if m and blocks:
            if weight.block_format == "q4_k":
                kernel = self.kernel("q4_blocks", "q4_k_blocks_to_chunks")
            else:
                kernel = self.kernel("q4_blocks", "q4_blocks_to_chunks", BLOCK_BYTES=block_bytes, HAS_MIN=int(has_min))
            with check(f"re-packing a {weight.block_format} weight ({m}x{k})"):
                private = self.cl.Kernel(kernel.program, kernel.function_name)  # holds the staged buffer until run
                bias = out.scale if out.bias is None else out.bias  # (Q4_0: not written)
                private.set_args(
                    staged.buffer,
                    *(a for t in (out.packed, out.scale) for a in (t.buffer, np.int32(t.offset))),
                    bias.buffer,
                    np.int32(0 if out.bias is None else bias.offset),
                    np.int32(m),
                    np.int32(k // 32),
                )
                self.cl.enqueue_nd_range_kernel(self.queue, private, (m, k // 32), None)
        return out

    def _split(self, weight: Int5Weight | Int6Weight, parts: list[CLTensor]) -> CLSplitWeight:
        """An int6 or int5 weight in int8_weight.cl's planes: the host's nibbles and high bits uploaded as they are
        and re-packed on the device (kernels/split_blocks.cl), its scales transposed (layout.cl)."""
        m, k = weight.shape
        planes = dict(zip(_split_layout(weight), parts, strict=True))
        int6 = isinstance(weight, Int6Weight)
        for name, part in planes.items():
            if name not in ("lo", "hi"):
                self._transposed(getattr(weight, name), "uchar" if name == "sub" else "ushort", part)
        if m and k:
            nibbles, high = (weight.ql, weight.qh) if int6 else (weight.low, weight.high)
            staged = [self.from_numpy(nibbles), self.from_numpy(high)]
            kernel = self.kernel("split_blocks", "int6_to_chunks" if int6 else "int5_to_chunks")
            with check(f"re-packing an {'int6' if int6 else 'int5'} weight ({m}x{k})"):
                private = self.cl.Kernel(kernel.program, kernel.function_name)  # holds the staged buffers until run
                lo, hi = planes["lo"], planes["hi"]
                private.set_args(
                    *(t.buffer for t in staged), lo.buffer, np.int32(lo.offset), hi.buffer, np.int32(hi.offset),
                    np.int32(m), np.int32(k // _CHUNK),
                )  # fmt: skip
                self.cl.enqueue_nd_range_kernel(self.queue, private, (m, k // _CHUNK), None)
        return CLSplitWeight(weight.shape, "int6" if int6 else "int5", planes)

    def _transposed(self, array: np.ndarray, elem: str, out: CLTensor | None = None) -> CLTensor:
        """A device copy of ``array`` (rows, cols, ...) with its first two axes swapped, into ``out`` if given;
        the trailing axes (a 16-byte chunk) are one ``elem`` of kernels/layout.cl. The host array is uploaded as
        it is and transposed on the device, so placing a weight costs the host one copy instead of a strided
        NumPy transpose too."""
        rows, cols = array.shape[:2]
        staged = self.from_numpy(array)
        if out is None:
            out = self.empty((cols, rows, *array.shape[2:]), array.dtype)
        if staged.size:
            kernel = self.kernel("layout", "transpose_rows", ELEM=elem)
            at = out.offset * out.dtype.itemsize // _ELEM_BYTES[elem]  # dst's offset in elements of ELEM
            with check(f"re-packing a weight ({rows}x{cols} of {elem})"):
                private = self.cl.Kernel(kernel.program, kernel.function_name)  # not a cached launch: the staged
                private.set_args(staged.buffer, out.buffer, np.int32(at), np.int32(rows), np.int32(cols))  # copy goes
                self.cl.enqueue_nd_range_kernel(self.queue, private, (rows, cols), None)
        return out

    def new_kv_cache(self, spec: KVCacheSpec) -> CLKVCache:
        if spec.dtype not in ("float32", "float16"):
            raise InvalidArgumentError(f"KV cache dtype must be float32 or float16; got {spec.dtype!r}")
        k, v = self.empty(spec.shape, spec.dtype), self.empty(spec.shape, spec.dtype)
        with check("zero-filling the KV cache"):
            for t in (k, v):
                if t.alloc.nbytes:
                    self.cl.enqueue_fill_buffer(self.queue, t.buffer, np.uint8(0), 0, t.alloc.nbytes)
        return CLKVCache(spec, k, v)

    def kv_cache_to_numpy(self, cache: CLKVCache):
        return self.to_numpy(cache.k), self.to_numpy(cache.v)

    def kv_cache_from_numpy(self, cache: CLKVCache, k, v):
        self.write(cache.k, k)
        self.write(cache.v, v)

    def copy_kv_prefix(self, cache: CLKVCache, src_slot: int, dst_slot: int, length: int) -> None:
        """One rectangular device copy per tensor: rows are (slot, kv_head) pairs of a layer, slices the layers."""
        layers, slots, heads, positions, head_dim = cache.spec.shape
        item = np.dtype(cache.spec.dtype).itemsize
        row = positions * head_dim * item
        pitches = (row, slots * heads * row)
        with check("copying a KV-cache prefix between slots"):
            for t in (cache.k, cache.v):
                base = t.offset * item
                self.cl.enqueue_copy(
                    self.queue,
                    t.buffer,
                    t.buffer,
                    src_origin=(base, src_slot * heads, 0),
                    dst_origin=(base, dst_slot * heads, 0),
                    region=(length * head_dim * item, heads, layers),
                    src_pitches=pitches,
                    dst_pitches=pitches,
                )

    # -- programs --------------------------------------------------------------------------------------
    def kernel(self, file: str, name: str, **defines: Any) -> Any:
        """Kernel ``name`` of ``kernels/<file>.cl`` built with ``-DKEY=VALUE`` per define (True: ``-DKEY``).

        Called for every launch, so a hit is one dict lookup (no file read, no source hashing).
        """
        fast_key = (file, name, tuple(sorted(defines.items())))
        kernel = self._kernels.get(fast_key)
        if kernel is None:
            kernel = self._kernels[fast_key] = self._make_kernel(file, name, defines)
        return kernel

    def _make_kernel(self, file: str, name: str, defines: dict[str, Any]) -> Any:
        options = [f"-D{k}" if v is True else f"-D{k}={v}" for k, v in sorted(defines.items()) if v is not False]
        if self.variant == "adreno" and kernel_source.mentions(file, "ADRENO"):
            # only where a file reads it: the Adreno variant then shares every other program with the generic one
            options.append("-DADRENO")
        if self._nv_membar:
            options.append(f"-DNV_MEMBAR_GL={self._nv_membar}")
        if self.native_int_dot:
            options.append("-DNV_DP4A")
        if self.native_mma:
            options.append("-DNV_MMA")
        program = self.program(file, tuple(options))
        key = (id(program), name)
        kernel = self._state.kernels.get(key)
        if kernel is None:
            with check(f"creating kernel {name} of {file}.cl"):
                kernel = self._state.kernels[key] = getattr(program, name)
        return kernel

    @functools.cached_property
    def _nv_membar(self) -> int:
        """NVIDIA's compiler takes inline PTX: a device-scope fence (membar.gl) for the kernels where the last
        work-group reads what the others wrote (kernels/int4.cl, attention.cl). Probed once per runtime: the
        form that builds (1: with a memory clobber, 2: without), or 0."""
        for form, statement in ((1, 'asm volatile("membar.gl;" ::: "memory");'), (2, 'asm volatile("membar.gl;");')):
            if self._nvidia_compiles("membar_probe", f"x[0] = 1; {statement}"):
                return form
        return 0

    @functools.cached_property
    def native_int_dot(self) -> bool:
        """Whether the device has a 4 x 8-bit integer dot product the kernels can use: NVIDIA's dp4a through
        inline PTX (the int4 GEMV's quantized-activation path, kernels/int4.cl QX). Probed once per runtime."""
        dp4a = 'uint r; asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(x[0]), "r"(x[1]), "r"(x[2])); x[3] = r;'
        return self._nvidia_compiles("dp4a_probe", dp4a)

    @functools.cached_property
    def native_mma(self) -> bool:
        """Whether the device has matrix units the kernels can drive: NVIDIA's mma.sync m16n8k16 on halves
        (sm_80 and later) through inline PTX (kernels/int4_mma.cl). Probed once per runtime."""
        mma = (
            "float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}; uint a = x[0];"
            'asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, '
            '{%8,%9}, {%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) '
            ': "r"(a), "r"(a), "r"(a), "r"(a), "r"(a), "r"(a));'
            'uint h; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(c[0]), "f"(c[1])); x[1] = h;'
        )
        return self._nvidia_compiles("mma_probe", mma)

    @functools.cached_property
    def use_mma(self) -> bool:
        """Whether int4 matmuls of several tokens run on the matrix-unit kernel: where it is native, or forced
        with PERFX_OPENCL_MMA=1 (its portable emulation: how the tests check it on PoCL) or off with 0."""
        forced = os.environ.get("PERFX_OPENCL_MMA")
        if forced in ("0", "1"):
            return forced == "1"
        return self.native_mma

    def _nvidia_compiles(self, name: str, body: str) -> bool:
        """Whether this is an NVIDIA device whose compiler builds a kernel ``name`` with ``body`` (inline PTX)
        over ``__global uint* x``."""
        if "nvidia" not in self.cl_device.vendor.lower():
            return False
        try:
            self.build(f"__kernel void {name}(__global uint* x) {{ {body} }}\n", label=f"{name}.cl")
        except KernelBuildError:
            return False
        return True

    @functools.cached_property
    def fused_tails(self) -> bool:
        """Whether the kernels whose last work-group finishes the job (linear_add_rmsnorm's add + RMSNorm, the
        one-launch decode attention's merge) may run here. They need the other work-groups' writes visible
        device-wide, which OpenCL 1.2 does not promise: allowed on NVIDIA (membar.gl) and PoCL on a CPU
        (coherent threads); elsewhere the ops use separate launches. PERFX_OPENCL_FUSED_TAILS=0/1 overrides."""
        if self._forced_tails is not None:
            return self._forced_tails
        return bool(self._nv_membar) or self._pocl_cpu

    @functools.cached_property
    def norm_tails(self) -> bool:
        """Whether the matmul kernels finish linear_add_rmsnorm themselves (add_norm_tail.cl), where fused tails
        may run. Not by default on PoCL: it generates each such kernel's code at its first launch in 12-63 s on
        a 2-core x86 machine (a GEMV with the tail, per token count and weight form), against ~1 s without,
        to save a launch that costs a CPU microseconds. PERFX_OPENCL_FUSED_TAILS=1 turns them on there too."""
        if self._forced_tails is not None:
            return self._forced_tails
        return self.fused_tails and not self._pocl_cpu

    @functools.cached_property
    def _forced_tails(self) -> bool | None:
        """PERFX_OPENCL_FUSED_TAILS=0/1: every tail off / on; None where unset (the device decides)."""
        forced = os.environ.get("PERFX_OPENCL_FUSED_TAILS")
        return forced == "1" if forced in ("0", "1") else None

    @functools.cached_property
    def _pocl_cpu(self) -> bool:
        return "portable computing language" in self.cl_device.platform.name.lower() and self.device.kind == "cpu"

    @functools.cached_property
    def concurrent_groups(self) -> bool:
        """Whether a launch's work-groups run side by side up to the device's capacity, so that a few of them may
        wait for the rest (the add + RMSNorm tail's finishers, kernels/add_norm_tail.cl). OpenCL does not promise
        it; NVIDIA GPUs do it. Not PoCL: its CPU threads run work-groups a few at a time, and a waiting one could
        hold the thread that the one it waits for needs."""
        return bool(self._nv_membar) and self.device.kind == "gpu"

    def program(self, file: str, options: tuple[str, ...]) -> Any:
        """Kernel file ``file`` behind the shared pieces (text, not #includes: no include path to set)."""
        return self.build(program_source(file), options, label=f"{file}.cl")

    def build(self, source: str, options: tuple[str, ...] = (), label: str = "program") -> Any:
        """Build ``source`` once per device and options; KernelBuildError carries the build log on failure."""
        key = (label, source, options)
        program = self._state.programs.get(key)
        if program is None:
            start = time.perf_counter()
            cached = program_cache.entry_path(self, source, options) if program_cache.enabled() else None
            program = program_cache.load(self, cached, options) if cached is not None else None
            self.load_stats["programs_from_cache" if program is not None else "programs_built"] += 1
            if program is None:
                # Seconds to minutes per program on some drivers: say once what the wait is, then per program in debug.
                if not getattr(self, "_told_building", False):
                    self._told_building = True
                    log.info("building OpenCL kernels for %s (later runs read them from a cache)", self.device.name)
                log.debug("building OpenCL program %s with %s", label, " ".join(options) or "no options")
                program = self._build_from_source(source, options, label)
                if cached is not None:
                    program_cache.store(self, cached, program)
            self.load_stats["program_s"] += time.perf_counter() - start
            self._state.programs[key] = program
        return program

    def _build_from_source(self, source: str, options: tuple[str, ...], label: str) -> Any:
        cl = self.cl
        with check(f"creating the program {label}"):
            program = cl.Program(self.context, source)
        try:
            program.build(options=list(options), devices=[self.cl_device])
        except cl.Error as exc:
            try:
                log = program.get_build_info(self.cl_device, cl.program_build_info.LOG)
            except cl.Error:
                log = ""
            log = (log or str(exc)).strip()
            raise KernelBuildError(
                f"OpenCL: building {label} with options {' '.join(options) or '(none)'} failed on "
                f"{self.device.name}:\n{log}",
                log,
            ) from exc
        return program

    def launch(self, kernel: Any, global_size: tuple[int, ...], local_size: tuple[int, ...] | None, *args: Any) -> None:
        """Queue ``kernel``; a CLTensor argument becomes (buffer, element offset), ints int32, floats float32.

        Setting arguments costs pyopencl a few microseconds each, more than queueing the kernel, and a decode
        step repeats the same launches with the same buffers. So each distinct (kernel, arguments) gets its own
        kernel object with its arguments set once; a repeat is one dict lookup and one enqueue.
        """
        # One pass builds the cache key (this runs for every launch, so it is kept lean). NumPy scalars become
        # Python numbers: keyed by value, never by the id of a short-lived object.
        key: list[Any] = [id(kernel), global_size, local_size]
        for i, a in enumerate(args):
            kind = type(a)
            if kind is CLTensor:
                key.append((id(a.alloc), a.offset))
            elif kind is int or kind is float:
                key.append(a)
            elif isinstance(a, np.generic):
                args = args[:i] + (a.item(),) + args[i + 1 :]
                key.append(args[i])
            else:
                key.append(id(a))
        signature = tuple(key)
        entry = self._launches.get(signature)
        if entry is None:
            entry = self._new_launch(kernel, args)
            if len(self._launches) >= MAX_CACHED_LAUNCHES:
                self._launches.pop(next(iter(self._launches)))  # oldest first: dicts keep insertion order
            self._launches[signature] = entry
        if self._capture is not None:
            self._capture.launches.append((entry[0], global_size, local_size, kernel.function_name))
            self._capture.keep.append(entry[1])  # set_args holds no reference: the graph keeps the buffers alive
        try:
            event = self.cl.enqueue_nd_range_kernel(self.queue, entry[0], global_size, local_size)
        except self.cl.Error as exc:
            raise BackendError(f"OpenCL: running kernel {kernel.function_name} failed: {exc}") from exc
        self.launch_count += 1
        if self.launch_count % FLUSH_EVERY == 0:
            self.queue.flush()  # some drivers (NVIDIA's) hold queued kernels until a flush: keep the device busy
        if self.kernel_events is not None:
            self.kernel_events.append((kernel.function_name, event))

    def _new_launch(self, kernel: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """A private kernel object with ``args`` set, kept with the arguments (so their ids stay unique)."""
        values: list[Any] = []
        for arg in args:
            if isinstance(arg, CLTensor):
                values.extend((arg.buffer, np.int32(arg.offset)))
            elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
                values.append(arg)
            elif isinstance(arg, int):
                values.append(np.int32(arg))
            else:
                values.append(np.float32(arg))
        with check(f"setting the arguments of kernel {kernel.function_name}"):
            private = self.cl.Kernel(kernel.program, kernel.function_name)  # never shared: args stay put
            private.set_args(*values)
        return private, args

    def tune(
        self, config: Any, quick: bool = False, progress: Any = None, group_size: int = 128, symmetric: bool = False
    ) -> dict[str, Any]:
        """Tune the int4 GEMV for ``config``'s matmul shapes and weight form (perfx_opencl.tuner) and cache it."""
        result = tuner.tune(self, config, quick, progress, group_size, symmetric)
        self._launches.clear()  # the candidates' launches (holding the tuner's weight copies) go
        self.tuning_generation += 1  # graphs recorded before now replay the old shapes: make them stale
        return result

    # -- graphs: a decode step's launches recorded once, then queued again without running the ops ------
    def graph_signature(self, positions: np.ndarray) -> Any:
        """Decode steps with equal batch size and signature queue the same kernels with the same arguments
        (only the uploaded ids, slots and positions differ), so one can be recorded and replayed: ~160
        launches then cost an enqueue each instead of the ops' Python work. PERFX_OPENCL_GRAPHS=0 turns it off."""
        if os.environ.get("PERFX_OPENCL_GRAPHS", "1") == "0":
            return None
        return (*ops.decode_signature(positions), self.tuning_generation)

    def begin_capture(self, inputs: tuple[str, ...]) -> None:
        if self._capture is not None:
            raise BackendError("begin_capture: a recording is already in progress (end_capture was not called)")
        self._capture = _Capture(frozenset(inputs))

    def end_capture(self) -> _Graph | None:
        capture, self._capture = self._capture, None
        if capture is None or capture.broken:
            return None
        if not set(capture.uploads) <= capture.inputs:
            return None  # an upload a replay could not supply
        launches = tuple(capture.launches)
        native = _native_replayer()
        return _Graph(
            tuple(capture.uploads.items()),
            launches,
            tuple(capture.keep),
            native and native.plan(launches),
        )

    def replay(self, graph: _Graph, inputs: dict[str, np.ndarray]) -> None:
        cl, queue = self.cl, self.queue
        fed = {key for key, value in inputs.items() if isinstance(value, CLTensor)}
        if not fed <= {key for key, _ in graph.uploads}:
            raise InvalidArgumentError(f"replay: the recorded step does not read {sorted(fed)} from the host")
        with check("replaying a recorded step"):
            for key, (alloc, size) in graph.uploads:
                if isinstance(inputs[key], CLTensor):  # the previous step's picks: copied on the device
                    self._copy_index_input(key, alloc, size, inputs[key])
                    continue
                host = np.array(inputs[key], dtype=np.int32, copy=True).reshape(-1)
                if host.size != size:
                    raise InvalidArgumentError(f"replay: {key} has {host.size} values; the graph was made with {size}")
                self._index_buffers[key] = (alloc, host)  # what upload_ints compares against next time
                cl.enqueue_copy(queue, alloc.buffer, host, is_blocking=False)
            enqueue, events = cl.enqueue_nd_range_kernel, self.kernel_events
            if graph.native is not None and events is None:
                # Queued from a thread of its own: the caller goes on (e.g. with the previous step's text) and
                # the next use of self.queue waits for it.
                self._state.replaying = graph.native.start(queue, graph)
                self.launch_count += len(graph.launches)
                return
            for i, (kernel, global_size, local_size, name) in enumerate(graph.launches, 1):
                event = enqueue(queue, kernel, global_size, local_size)
                self.launch_count += 1
                if self.launch_count % FLUSH_EVERY == 0 or i in REPLAY_EARLY_FLUSHES:
                    queue.flush()
                if events is not None:
                    events.append((name, event))
            queue.flush()  # the last launches (logits, picks) too: the host may do other work before reading

    def _copy_index_input(self, key: str, alloc: Allocation, size: int, source: CLTensor) -> None:
        if source.size != size or source.dtype != np.int32:
            raise InvalidArgumentError(f"replay: {key} is {source.size} {source.dtype}; the graph has {size} int32")
        self._index_buffers[key] = (alloc, None)  # unknown on the host: upload_ints sends its next values
        self.cl.enqueue_copy(self.queue, alloc.buffer, source.buffer, src_offset=source.offset * 4, byte_count=size * 4)

    @contextmanager
    def profiling(self) -> Iterator[None]:
        """Inside the block kernels go to a profiling queue and kernel_seconds() reports their device time
        (the tuner: small kernels finish faster than the host can queue them, so wall time hides them)."""
        if self.kernel_events is not None:  # PERFX_OPENCL_PROFILE=1: already profiling
            yield
            return
        self.synchronize()
        saved = self.queue
        with check("creating a profiling queue"):
            self.queue = self.cl.CommandQueue(
                self.context, self.cl_device, properties=self.cl.command_queue_properties.PROFILING_ENABLE
            )
        self.kernel_events = []
        try:
            yield
        finally:
            try:
                with check("finishing the profiling queue"):
                    self.queue.finish()
            finally:  # even when a kernel failed: the runtime must not stay on the profiling queue
                self.queue, self.kernel_events = saved, None

    def kernel_seconds(self) -> dict[str, float]:
        """Device seconds per kernel name since the last call (needs PERFX_OPENCL_PROFILE=1); clears the record."""
        self.synchronize()
        totals: dict[str, float] = {}
        for name, event in self.kernel_events or []:
            totals[name] = totals.get(name, 0.0) + (event.profile.end - event.profile.start) * 1e-9
        if self.kernel_events is not None:
            self.kernel_events.clear()
        return totals

    def copy_bandwidth_gbs(self, nbytes: int = 1 << 30, repeats: int = 10) -> float:
        """Device-to-device copy bandwidth, counting bytes read plus written (the roofline for GEMV)."""
        src, dst = self._allocate(nbytes), self._allocate(nbytes)
        with check("measuring copy bandwidth"):
            self.cl.enqueue_copy(self.queue, dst.buffer, src.buffer, byte_count=nbytes)
            self.queue.finish()
            start = time.perf_counter()
            for _ in range(repeats):
                self.cl.enqueue_copy(self.queue, dst.buffer, src.buffer, byte_count=nbytes)
            self.queue.finish()
        return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9

    def synchronize(self) -> None:
        with check("waiting for the queue"):
            self.queue.finish()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.synchronize()  # raises if a native replay's launch failed: the runtime closes anyway
        finally:
            self._index_buffers.clear()
            self._zeroed.clear()
            self._arenas.clear()
            self._launches.clear()  # their kernel objects hold every buffer they were launched with
            self._kernels.clear()
            self.__dict__.pop("_scratch_buffers", None)
            self._closed = True
