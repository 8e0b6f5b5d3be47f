"""A validating reader for GGUF files (versions 2 and 3, little-endian): metadata, tensor table, tensor bytes.

We parse the format ourselves rather than with ``gguf.GGUFReader``: that reader walks arrays one element at a
time without bounds checks (a corrupt array length of 2**40 hangs it) and needs ~2 s for a 49k-token vocabulary.
Here every count and length is checked against the bytes left in the file *before* anything is allocated or
looped over, so a malformed file fails fast, with bounded memory, as a ``ModelFormatError`` that says where.
The ``gguf`` package is used only for its constants (magic, value types, tensor types, block sizes).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys

from .errors import ModelFormatError, ModelNotFoundError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # real files nest at most once; the cap keeps a crafted file from exhausting the stack

_CORRUPT = "the file is corrupt or truncated; re-download it"
_HEADER_SIZE = 24  # magic, version (u32 each), tensor count, kv count (u64 each)
# Smallest possible encodings, used to reject absurd counts before looping over them.
_MIN_KV_SIZE = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_ARRAY_HEADER_SIZE = 4 + 8  # element type, count

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Scalar value types: struct format and size. BOOL is read as a byte so values other than 0/1 can be rejected.
_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<B"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype(np.uint8),
    GGUFValueType.INT8: np.dtype(np.int8),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype(np.uint8),  # checked, then viewed as bool
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types whose bytes are plain numbers; BF16 is returned as its raw uint16 bits (NumPy has no bfloat16).
_PLAIN_TENSOR_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # NumPy order (GGUF dims reversed): a weight is (out_rows, in_cols)
    offset: int  # absolute byte offset in the file (GGUF stores it relative to data_offset)
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """A parsed GGUF file. Tensor bytes stay on disk until ``tensor_data`` maps them."""

    def __init__(
        self,
        path: Path,
        version: int,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        data_offset: int | None,
        alignment: int,
        file_size: int,
    ):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.data_offset = data_offset  # None when read with tensors=False
        self.alignment = alignment
        self.file_size = file_size
        self._memmap: np.memmap | None = None

    def __repr__(self) -> str:
        counts = f"{len(self.metadata)} keys, {len(self.tensors)} tensors"
        return f"GGUFFile({str(self.path)!r}, version={self.version}, {counts})"

    def tensor_data(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor.

        F32/F16 (and the integer types) come typed with the tensor's shape; BF16 comes as its raw uint16 bits;
        block-quantized types come as uint8 of shape ``(*shape[:-1], row_bytes)``, what ``gguf.quants.dequantize``
        takes.
        """
        info = self.tensors.get(name)
        if info is None:
            if self.data_offset is None:
                raise ModelFormatError(f"{self.path} was read with tensors=False; read it with read_gguf(path)")
            raise ModelFormatError(f"{self.path} has no tensor {name!r}; check that the file is a complete model")
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._memmap[info.offset : info.offset + info.nbytes]
        dtype = _PLAIN_TENSOR_DTYPES.get(info.ggml_type)
        if dtype is not None:
            return raw.view(dtype).reshape(info.shape)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)


def read_gguf(path: str | os.PathLike[str], *, tensors: bool = True) -> GGUFFile:
    """Parse and validate a GGUF file's header, metadata and (unless ``tensors=False``) its tensor table."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model file {path} does not exist; check the path")
    if path.is_dir():
        raise ModelNotFoundError(f"{path} is a directory; give the path of the .gguf file inside it")
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < _HEADER_SIZE:
            raise ModelFormatError(
                f"{path} is {file_size} bytes, too small for a GGUF header ({_HEADER_SIZE} bytes); {_CORRUPT}"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _Parser(path, view, file_size).parse(tensors)
            finally:
                view.release()  # every value was copied out, so the mapping can close


class _Parser:
    """One pass over the header bytes; ``pos`` only moves forward and every read is bounds-checked."""

    def __init__(self, path: Path, buf: memoryview, size: int):
        self.path = path
        self.buf = buf
        self.size = size
        self.pos = 0

    # -- errors ---------------------------------------------------------------------------------------------

    def corrupt(self, what: str, at: int | None = None) -> ModelFormatError:
        where = self.pos if at is None else at
        return ModelFormatError(f"{self.path}: {what} (at byte {where}); {_CORRUPT}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.corrupt(f"{what} needs {n} bytes but only {self.size - self.pos} remain")

    # -- primitives -----------------------------------------------------------------------------------------

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise self.corrupt(f"{what} claims {n} bytes but only {self.size - self.pos} remain", start)
        try:
            s = str(self.buf[self.pos : self.pos + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.corrupt(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start} of it)", start) from None
        self.pos += n
        return s

    def value_type(self, what: str) -> GGUFValueType:
        start = self.pos
        code = self.u32(f"value type of {what}")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.corrupt(f"{what} has unknown value type {code}", start) from None

    # -- values ---------------------------------------------------------------------------------------------

    def value(self, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"string value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key, depth)
        fmt = _SCALARS[vtype]
        self.need(fmt.size, f"{vtype.name} value of {key!r}")
        (v,) = fmt.unpack_from(self.buf, self.pos)
        if vtype == GGUFValueType.BOOL:
            if v > 1:
                raise self.corrupt(f"BOOL value of {key!r} is {v}, not 0 or 1")
            v = bool(v)
        self.pos += fmt.size
        return v

    def array(self, key: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise self.corrupt(f"array {key!r} is nested more than {MAX_ARRAY_NESTING} levels deep")
        etype = self.value_type(f"elements of array {key!r}")
        start = self.pos
        count = self.u64(f"length of array {key!r}")
        if etype == GGUFValueType.STRING:
            min_size = 8
        elif etype == GGUFValueType.ARRAY:
            min_size = _ARRAY_HEADER_SIZE
        else:
            min_size = _ARRAY_DTYPES[etype].itemsize
        # Reject impossible lengths before allocating or looping (the GGUFReader hang).
        if count * min_size > self.size - self.pos:
            raise self.corrupt(
                f"array {key!r} claims {count} {etype.name} elements, at least {count * min_size} bytes, "
                f"but only {self.size - self.pos} remain",
                start,
            )
        if etype == GGUFValueType.STRING:
            return self.string_array(count, key)
        if etype == GGUFValueType.ARRAY:
            return [self.array(f"{key}[{i}]", depth + 1) for i in range(count)]
        dtype = _ARRAY_DTYPES[etype]
        # Copy out of the mapping (so it can close), converting to native byte order for callers.
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).astype(dtype.newbyteorder("="))
        self.pos += count * dtype.itemsize
        if etype == GGUFValueType.BOOL:
            if count and int(arr.max()) > 1:
                raise self.corrupt(f"BOOL array {key!r} holds values other than 0 and 1", start)
            arr = arr.view(np.bool_)
        return arr

    def string_array(self, count: int, key: str) -> list[str]:
        # The hot loop of the reader (vocabularies and merges): locals only, one bounds check per string.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        i = 0
        try:
            for i in range(count):
                if size - pos < 8:
                    raise self.corrupt(f"string {i} of array {key!r} is truncated", pos)
                (n,) = unpack(buf, pos)
                pos += 8
                if n > size - pos:
                    raise self.corrupt(
                        f"string {i} of array {key!r} claims {n} bytes but only {size - pos} remain", pos - 8
                    )
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise self.corrupt(f"string {i} of array {key!r} is not valid UTF-8 ({e.reason})", pos) from None
        self.pos = pos
        return out

    # -- sections -------------------------------------------------------------------------------------------

    def parse(self, with_tensors: bool) -> GGUFFile:
        version, n_tensors, n_kv = self.header()
        metadata = self.metadata(n_kv)
        alignment = self.alignment(metadata)
        if not with_tensors:
            return GGUFFile(self.path, version, metadata, {}, None, alignment, self.size)
        raw_tensors = self.tensor_infos(n_tensors)
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.place_tensors(raw_tensors, data_offset, alignment)
        return GGUFFile(self.path, version, metadata, tensors, data_offset, alignment, self.size)

    def header(self) -> tuple[int, int, int]:
        (magic,) = _U32.unpack_from(self.buf, 0)
        if magic != GGUF_MAGIC:
            raise ModelFormatError(
                f"{self.path} is not a GGUF file: it starts with {bytes(self.buf[:4])!r}, not b'GGUF'; "
                "give the path of a .gguf model (or re-download it if it should be one)"
            )
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if struct.unpack(">I", struct.pack("<I", version))[0] in SUPPORTED_VERSIONS:
                raise ModelFormatError(
                    f"{self.path} is a big-endian GGUF; perfx reads little-endian files only: "
                    "use the little-endian build of the model"
                )
            if version == 1:
                raise ModelFormatError(
                    f"{self.path} is GGUF version 1 (2023), which perfx does not read (it reads versions 2 and 3); "
                    "re-convert the model with a current llama.cpp or download a newer GGUF"
                )
            raise ModelFormatError(
                f"{self.path} has GGUF version {version}; perfx reads versions 2 and 3. "
                f"If the file is genuine, upgrade perfx; otherwise {_CORRUPT}"
            )
        n_tensors = self.u64("tensor count")
        n_kv = self.u64("metadata key count")
        remaining = self.size - self.pos
        if n_kv * _MIN_KV_SIZE > remaining:
            raise self.corrupt(
                f"metadata key count {n_kv} is impossible: that many entries need at least "
                f"{n_kv * _MIN_KV_SIZE} bytes but the file has {remaining} after the header",
                16,
            )
        if n_tensors * _MIN_TENSOR_INFO_SIZE > remaining - n_kv * _MIN_KV_SIZE:
            raise self.corrupt(
                f"tensor count {n_tensors} is impossible: that many tensor entries need at least "
                f"{n_tensors * _MIN_TENSOR_INFO_SIZE} bytes but the file has {remaining} after the header",
                8,
            )
        return version, n_tensors, n_kv

    def metadata(self, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            start = self.pos
            key = self.string(f"key of metadata entry {i}")
            if not key:
                raise self.corrupt(f"metadata entry {i} has an empty key", start)
            if key in metadata:
                raise self.corrupt(f"metadata key {key!r} appears twice", start)
            metadata[key] = self.value(self.value_type(f"metadata key {key!r}"), key)
        return metadata

    def alignment(self, metadata: dict[str, Any]) -> int:
        key = Keys.General.ALIGNMENT
        if key not in metadata:
            return GGUF_DEFAULT_ALIGNMENT
        a = metadata[key]
        if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
            raise ModelFormatError(
                f"{self.path}: metadata {key!r} is {a!r} but must be a positive power of two; {_CORRUPT}"
            )
        return a

    def tensor_infos(self, n_tensors: int) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int, int]]:
        infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            start = self.pos
            name = self.string(f"name of tensor {i}")
            if name in seen:
                raise self.corrupt(f"tensor name {name!r} appears twice", start)
            seen.add(name)
            n_dims = self.u32(f"n_dims of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.corrupt(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
            self.need(8 * n_dims, f"dimensions of tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
            self.pos += 8 * n_dims
            type_code = self.u32(f"type of tensor {name!r}")
            ggml_type = _tensor_type(type_code)
            if ggml_type is None:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has unknown ggml type {type_code} (at byte {self.pos - 4}); "
                    "the file is corrupt or uses a type newer than this gguf package; "
                    "re-download it or upgrade the gguf package"
                )
            rel_offset = self.u64(f"data offset of tensor {name!r}")
            nbytes = self.tensor_nbytes(name, dims, ggml_type, start)
            # GGUF lists dims fastest-first (ne0 = row length); NumPy shape is the reverse.
            infos.append((name, ggml_type, tuple(reversed(dims)), rel_offset, nbytes, start))
        return infos

    def tensor_nbytes(self, name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType, at: int) -> int:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = 1
        for d in dims:
            if d == 0 or d >= 1 << 63:
                raise self.corrupt(f"tensor {name!r} has dimension {d} in {list(dims)}", at)
            n_elements *= d  # Python ints: a product past 2**64 is caught below, not wrapped
        if dims[0] % block_size:
            raise self.corrupt(
                f"tensor {name!r} ({ggml_type.name}) has rows of {dims[0]} elements, "
                f"not a multiple of its block size {block_size}",
                at,
            )
        nbytes = n_elements // block_size * type_size
        if nbytes > self.size:
            raise self.corrupt(
                f"tensor {name!r} with dimensions {list(dims)} ({ggml_type.name}) needs {nbytes} bytes, "
                f"more than the whole file ({self.size} bytes)",
                at,
            )
        return nbytes

    def place_tensors(self, raw: list, data_offset: int, alignment: int) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        if raw and data_offset > self.size:
            raise self.corrupt(f"tensor data should start at byte {data_offset}, past the end of the file", data_offset)
        for name, ggml_type, shape, rel_offset, nbytes, at in raw:
            if rel_offset % alignment:
                raise self.corrupt(
                    f"tensor {name!r} has data offset {rel_offset}, not a multiple of the alignment {alignment}", at
                )
            if rel_offset > self.size - data_offset - nbytes:
                raise self.corrupt(
                    f"tensor {name!r} occupies bytes {data_offset + rel_offset}..{data_offset + rel_offset + nbytes} "
                    f"but the file ends at {self.size}",
                    at,
                )
            tensors[name] = TensorInfo(name, ggml_type, shape, data_offset + rel_offset, nbytes)
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for prev, cur in zip(ordered, ordered[1:], strict=False):
            if cur.offset < prev.offset + prev.nbytes:
                raise ModelFormatError(
                    f"{self.path}: tensors {prev.name!r} and {cur.name!r} overlap "
                    f"(bytes {prev.offset}..{prev.offset + prev.nbytes} and {cur.offset}..); {_CORRUPT}"
                )
        return tensors


def _tensor_type(code: int) -> GGMLQuantizationType | None:
    try:
        t = GGMLQuantizationType(code)
    except ValueError:
        return None
    return t if t in GGML_QUANT_SIZES else None
