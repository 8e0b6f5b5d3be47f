"""Clone a real GGUF's architecture and quantization layout with random weights, in two steps.

    python benchmarks/make_shape_clone_gguf.py skeleton REAL.gguf SKELETON.gguf
    python benchmarks/make_shape_clone_gguf.py fill SKELETON.gguf OUT.gguf [--seed 0]

Speed does not depend on weight values, so a benchmark machine that cannot receive a model's weights gets a
small skeleton instead and fills it there. `skeleton` keeps every metadata key of REAL with its value and GGUF
value type (tokenizer, chat template, architecture keys), and no tensor data: the tensor table (name, GGUF dims
ne0 first, ggml type, in file order) goes into the string key `perfx.skeleton.tensors` as JSON. `fill` writes a
complete GGUF with that metadata (less that key) and every tensor of the table, with random but valid data:
  - block-quantized types: random codes and sub-block scales, with float16 block scales drawn so a typical
    weight is a few hundredths (the same magnitude as a real model's), never inf or NaN;
  - F32 / F16 / BF16: values near 1.0 for norm weights and rope frequency factors (tensors whose name contains
    "norm" or "rope_freqs"), small random values elsewhere.
Tensors are drawn and written one at a time, so peak memory is a little over the largest tensor's size.
Metadata arrays that are empty are left out (the gguf library cannot write one; llama.cpp reads a missing key
as an empty one), with a warning. Bad input (a missing or malformed file, `fill` of a file that is not a
skeleton, a tensor type without a generator here) stops with an error before any output is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from perfx_core.errors import InvalidArgumentError, ModelFormatError, PerfxError
from perfx_core.gguf_file import read_gguf

SKELETON_KEY = "perfx.skeleton.tensors"
T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# Float16 fields of each block type: (byte offset in the block, base value). A block's field is base * U(0.5, 1.5);
# every other byte of the block is random. Bases give typical |weight| ~0.03 from the type's formula:
# Q4_0 d*(q-8); Q4_1 d*q + m; Q5_0 d*(q-16); Q5_1 d*q + m; Q8_0 d*q; Q2_K/Q4_K/Q5_K d*sc*q - dmin*m (6- or 4-bit
# sc and m); Q3_K d*(sc-32)*q; Q6_K d*sc*(q-32) with int8 sc; IQ4_NL/IQ4_XS d*(sc)*grid[q], grid within +-127.
# The negative mins of Q4_1/Q5_1 and the K-quants' dmin roughly center the weights on zero.
HALF_FIELDS: dict[T, tuple[tuple[int, float], ...]] = {
    T.Q4_0: ((0, 0.01),),
    T.Q4_1: ((0, 0.01), (2, -0.08)),
    T.Q5_0: ((0, 0.005),),
    T.Q5_1: ((0, 0.005), (2, -0.08)),
    T.Q8_0: ((0, 0.0005),),
    T.Q2_K: ((80, 0.003), (82, 0.0045)),
    T.Q3_K: ((108, 0.001),),
    T.Q4_K: ((0, 1.8e-4), (2, 1.4e-3)),
    T.Q5_K: ((0, 1e-4), (2, 1.5e-3)),
    T.Q6_K: ((208, 3e-5),),
    T.IQ4_NL: ((0, 5e-4),),
    T.IQ4_XS: ((0, 3e-5),),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
FLOAT_CHUNK = 1 << 24  # elements per draw, so the float32 temporaries stay small next to the tensor


@dataclass(frozen=True)
class Field:
    key: str
    value: Any  # strings as raw bytes; arrays as lists
    vtype: V
    sub_type: V | None = None


# -- metadata ---------------------------------------------------------------------------------------------------


def read_fields(reader: gguf.GGUFReader) -> list[Field]:
    """Every metadata key/value of a file, in file order, with its GGUF value type (strings kept as raw bytes)."""
    fields = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the header (version, counts)
            continue
        vtype = f.types[0]
        if vtype == V.STRING:
            fields.append(Field(key, bytes(f.parts[f.data[0]]), vtype))
        elif vtype != V.ARRAY:
            fields.append(Field(key, f.parts[f.data[0]][0].item(), vtype))
        else:
            sub = V(int(f.parts[3][0]))  # parts: key length, key, value type, element type, count, elements...
            if sub == V.ARRAY:
                raise ModelFormatError(f"{key}: arrays of arrays are not supported by this tool")
            if not f.data:
                # GGUFWriter cannot write an empty array; llama.cpp treats a missing key like an empty one
                print(f"warning: {key} is an empty array, left out", file=sys.stderr)
                continue
            if sub == V.STRING:
                value = [bytes(f.parts[i]) for i in f.data]
            else:
                value = [f.parts[i][0].item() for i in f.data]
            fields.append(Field(key, value, vtype, sub))
    return fields


def new_writer(path: str, fields: list[Field]) -> gguf.GGUFWriter:
    """A writer holding exactly ``fields``, in their order: the key GGUFWriter adds itself (general.architecture)
    is dropped first, so the copy neither duplicates nor reorders it."""
    arch = next((f.value for f in fields if f.key == gguf.Keys.General.ARCHITECTURE), None)
    if arch is None:
        raise ModelFormatError(f"the source has no {gguf.Keys.General.ARCHITECTURE} key; it is not a model file")
    writer = gguf.GGUFWriter(path, arch.decode())
    writer.kv_data[0].clear()
    for f in fields:
        # add_key_value, not add_string/add_array: those skip empty strings
        writer.add_key_value(f.key, f.value, f.vtype, f.sub_type)
        if f.key == gguf.Keys.General.ALIGNMENT:
            writer.data_alignment = int(f.value)
    return writer


# -- skeleton ---------------------------------------------------------------------------------------------------


def tensor_table(reader: gguf.GGUFReader) -> list[dict[str, Any]]:
    return [{"name": t.name, "shape": [int(d) for d in t.shape], "type": t.tensor_type.name} for t in reader.tensors]


def check_paths(source: str, out: str) -> None:
    # the reader maps the source while the writer truncates the output: the same file would be destroyed
    if Path(out).resolve() == Path(source).resolve():
        raise InvalidArgumentError(f"the output {out} is the input file; give another path")


def make_skeleton(real: str, out: str) -> None:
    check_paths(real, out)
    if SKELETON_KEY in read_gguf(real).metadata:  # validates the whole file first, with a typed error
        raise InvalidArgumentError(f"{real} is already a skeleton; `fill` it")
    reader = gguf.GGUFReader(real)
    fields = read_fields(reader)
    table = json.dumps(tensor_table(reader), separators=(",", ":"))
    writer = new_writer(out, fields)
    writer.add_key_value(SKELETON_KEY, table, V.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()  # no tensors: only the (empty) table and alignment padding
    writer.close()


# -- fill -------------------------------------------------------------------------------------------------------


def random_float(name: str, n: int, ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """``n`` values of a float tensor: near 1.0 for norms and rope frequency factors, else in +-0.02."""
    near_one = "norm" in name or "rope_freqs" in name
    dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[ggml_type]
    out = np.empty(n, dtype=dtype)
    for start in range(0, n, FLOAT_CHUNK):
        x = rng.random(min(FLOAT_CHUNK, n - start), dtype=np.float32) - np.float32(0.5)
        x = x * np.float32(0.2) + np.float32(1.0) if near_one else x * np.float32(0.04)
        if ggml_type == T.BF16:
            out[start : start + len(x)] = x.view(np.uint32) >> 16  # truncated to bfloat16's bits
        else:
            out[start : start + len(x)] = x
    return out


def random_blocks(n_blocks: int, ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` blocks of a quantized type: random codes and sub-scales, sensible float16 block scales."""
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset, base in HALF_FIELDS[ggml_type]:
        half = (base * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = half.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_tensor(name: str, shape: list[int], ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape))
    if ggml_type in FLOAT_TYPES:
        return random_float(name, n, ggml_type, rng)
    return random_blocks(n // gguf.GGML_QUANT_SIZES[ggml_type][0], ggml_type, rng)


@dataclass(frozen=True)
class TableEntry:
    name: str
    shape: list[int]  # GGUF order, ne0 first
    ggml_type: T

    @property
    def nbytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block_size * type_size


def read_table(skeleton: str) -> list[TableEntry]:
    """The skeleton's tensor table, checked so that every entry can be generated (before any output exists)."""
    metadata = read_gguf(skeleton, tensors=False).metadata
    raw = metadata.get(SKELETON_KEY)
    if not isinstance(raw, str):
        raise ModelFormatError(f"{skeleton} has no {SKELETON_KEY} key; make a skeleton with `skeleton REAL OUT`")
    supported = ", ".join(t.name for t in (*FLOAT_TYPES, *HALF_FIELDS))
    entries = []
    try:
        for t in json.loads(raw):
            entries.append(TableEntry(str(t["name"]), [int(d) for d in t["shape"]], T[t["type"]]))
    except (ValueError, KeyError, TypeError) as err:
        msg = f"{skeleton}: the {SKELETON_KEY} table is malformed ({err!r}); remake the skeleton"
        raise ModelFormatError(msg) from err
    for e in entries:
        if e.ggml_type not in FLOAT_TYPES and e.ggml_type not in HALF_FIELDS:
            raise ModelFormatError(f"{e.name}: tensor type {e.ggml_type.name} is not supported ({supported} are)")
        block_size = gguf.GGML_QUANT_SIZES[e.ggml_type][0]
        if not e.shape or min(e.shape) < 1 or e.shape[0] % block_size:
            raise ModelFormatError(f"{e.name}: shape {e.shape} does not fit {e.ggml_type.name}'s {block_size}-blocks")
    return entries


def fill(skeleton: str, out: str, seed: int = 0) -> None:
    check_paths(skeleton, out)
    table = read_table(skeleton)
    fields = [f for f in read_fields(gguf.GGUFReader(skeleton)) if f.key != SKELETON_KEY]
    writer = new_writer(out, fields)
    for e in table:
        # a non-uint8 dtype with raw_dtype keeps the shape as given (in elements, NumPy order: GGUF dims reversed)
        writer.add_tensor_info(e.name, e.shape[::-1], np.dtype(np.float32), e.nbytes, raw_dtype=e.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for e in table:
        writer.write_tensor_data(random_tensor(e.name, e.shape, e.ggml_type, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sk = sub.add_parser("skeleton", help="metadata and tensor table of a GGUF, without tensor data")
    sk.add_argument("real")
    sk.add_argument("out")
    fl = sub.add_parser("fill", help="a full GGUF from a skeleton, with random valid tensor data")
    fl.add_argument("skeleton")
    fl.add_argument("out")
    fl.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        if args.command == "skeleton":
            make_skeleton(args.real, args.out)
        else:
            fill(args.skeleton, args.out, args.seed)
    except PerfxError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
