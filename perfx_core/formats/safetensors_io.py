"""Safetensors files as memory-mapped NumPy views, and a writer that streams tensors into a preallocated file.

``safetensors.safe_open(..., framework="numpy")`` copies each tensor into a new array; perfx wants loading to
cost nothing, so the reader maps the file once and hands out views at the header's offsets. The files stay
ordinary safetensors files (``safe_open`` reads them; the tests check that).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
                    raise ModelFormatError(f"{self.path} is too short to be a safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > min(_MAX_HEADER, size - 8):
                    raise ModelFormatError(f"{self.path}: header length {n} is impossible; the file is not safetensors")
                header = json.loads(f.read(n))
        except OSError as e:
            raise ModelFormatError(f"cannot read {self.path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelFormatError(f"{self.path}: the header is not JSON; the file is not safetensors") from None
        if not isinstance(header, dict):
            raise ModelFormatError(f"{self.path}: the header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.entries: dict[str, TensorEntry] = {}
        data_size = size - self._data_start
        for name, info in header.items():
            try:
                entry = TensorEntry(
                    str(info["dtype"]), tuple(int(d) for d in info["shape"]), *map(int, info["data_offsets"])
                )
            except (KeyError, TypeError, ValueError):
                raise ModelFormatError(f"{self.path}: tensor {name!r} has a malformed header entry") from None
            if entry.dtype in DTYPES:
                expected = int(np.prod(entry.shape, dtype=np.int64)) * DTYPES[entry.dtype].itemsize
                if entry.end - entry.begin != expected:
                    raise ModelFormatError(
                        f"{self.path}: tensor {name!r} has {entry.end - entry.begin} bytes, expected {expected}"
                    )
            if not 0 <= entry.begin <= entry.end <= data_size:
                raise ModelFormatError(f"{self.path}: tensor {name!r} lies outside the file; it is truncated")
            self.entries[name] = entry
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)

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
