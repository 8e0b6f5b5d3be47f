"""Safetensors files as memory-mapped NumPy views, and a writer that streams tensors into a preallocated file.

``safetensors.safe_open(..., framework="numpy")`` copies each tensor into a new array; perfx wants loading to
cost nothing, so the reader maps the file once and hands out views at the header's offsets. The files stay
ordinary safetensors files (``safe_open`` reads them; the tests check that).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import show
from ..errors import ModelFormatError

# safetensors dtype names -> NumPy dtypes. BF16 has no NumPy dtype: it is read as raw uint16 bits.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items() if k != "BF16"}
_MAX_HEADER = 100 << 20
_MAX_DIMS = 32  # NumPy 1.x's limit; real tensors have at most a few


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # safetensors name, e.g. "F16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file, mapped read-only; ``get(name)`` returns a view, never a copy."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._bad("too short to be a safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > min(_MAX_HEADER, size - 8):
                    raise self._bad(f"header length {n} is impossible; the file is not safetensors")
                header = json.loads(f.read(n))
        except OSError as e:
            raise ModelFormatError(f"cannot read {self.path}: {e.strerror or e}; check the path") from None
        except RecursionError:
            raise self._bad("the header is nested too deeply; the file is not safetensors") from None
        except (UnicodeDecodeError, ValueError):
            raise self._bad("the header is not JSON; the file is not safetensors") from None
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("'__metadata__' must map strings to strings")
        self.metadata: dict[str, str] = metadata
        self._data_start = 8 + n
        data_size = size - self._data_start
        self.entries = {name: self._entry(name, info, data_size) for name, info in header.items()}
        self._check_overlaps()
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)

    def _bad(self, problem: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {problem}; re-download or re-create the file")

    def _entry(self, name: str, info: Any, data_size: int) -> TensorEntry:
        """One header entry, checked as the safetensors library does, before anything is sized by it."""
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise self._bad(f"tensor {name!r} has a malformed header entry")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise self._bad(f"tensor {name!r} has dtype {show(dtype)}, not a dtype name")
        dims_ok = isinstance(shape, list) and len(shape) <= _MAX_DIMS
        if not dims_ok or not all(_is_int(d) and 0 <= d < 1 << 63 for d in shape):
            raise self._bad(f"tensor {name!r} has shape {show(shape)}, not a list of dimensions")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise self._bad(f"tensor {name!r} has data_offsets {show(offsets)}, not [begin, end] byte offsets")
        begin, end = offsets
        if dtype in DTYPES:
            expected = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
            if end - begin != expected:
                raise self._bad(
                    f"tensor {name!r} has {end - begin} bytes but dtype {dtype} and shape {show(shape)} need {expected}"
                )
        if end > data_size:
            raise self._bad(f"tensor {name!r} lies outside the file (bytes {begin}..{end} of {data_size}): truncated")
        return TensorEntry(dtype, tuple(shape), begin, end)

    def _check_overlaps(self) -> None:
        spans = sorted((e.begin, e.end, name) for name, e in self.entries.items() if e.end > e.begin)
        # Sorted by start, a tensor overlapping any earlier one overlaps the one just before it.
        for (prev_begin, prev_end, prev), (begin, end, name) in zip(spans, spans[1:], strict=False):
            if begin < prev_end:
                raise self._bad(
                    f"tensors {prev!r} and {name!r} overlap (bytes {prev_begin}..{prev_end} and {begin}..{end})"
                )

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file (BF16 as uint16 bits)."""
        entry = self.entries[name]
        if entry.dtype not in DTYPES:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has dtype {entry.dtype}, which perfx cannot read")
        raw = self._map[self._data_start + entry.begin : self._data_start + entry.end]
        return raw.view(DTYPES[entry.dtype]).reshape(entry.shape)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32; exact (bfloat16 is the top half of a float32)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


class StreamingWriter:
    """Writes a safetensors file whose tensor list is known up front, one tensor at a time, in any order.

    The header is written first, with offsets laid out by alignment (8-byte dtypes first, bytes last) so every
    view of the finished file is aligned; ``write`` then fills each tensor's bytes in place. ``close`` checks
    every tensor was written, so a half-written file is never mistaken for a whole one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: dict[str, tuple[np.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        order = sorted(specs, key=lambda name: -np.dtype(specs[name][0]).itemsize)  # stable: keeps given order
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        self._layout: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name in order:
            dtype, shape = np.dtype(specs[name][0]), tuple(int(d) for d in specs[name][1])
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {
                "dtype": _NAMES[dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._layout[name] = (dtype, shape, offset)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % 8)  # pad so the data section starts 8-byte aligned
        self._data_start = 8 + len(blob)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._file.truncate(self._data_start + offset)
        self._pending = set(self._layout)

    def write(self, name: str, array: np.ndarray) -> None:
        dtype, shape, offset = self._layout[name]
        array = np.ascontiguousarray(array)
        if array.dtype != dtype or array.shape != shape:
            raise ValueError(f"tensor {name!r} is {array.dtype}{array.shape}, the header says {dtype}{shape}")
        self._file.seek(self._data_start + offset)
        self._file.write(memoryview(array.astype(dtype.newbyteorder("<"), copy=False)).cast("B"))
        self._pending.discard(name)

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")

    def abort(self) -> None:
        self._file.close()
