#!/usr/bin/env python
"""The bytes each backend holds for a GGUF's matrices, per tensor type, against the file's tensor data: the
figure `perfx bench` reports (weight_bytes), which tests/test_opencl_int8.py bounds at 1.1x per type and backend.

    python benchmarks/weight_memory_by_type.py                    # numpy (with installed plugins) and opencl
    python benchmarks/weight_memory_by_type.py --backends numpy --types Q4_K,Q6_K

Each file is the tests' tiny Llama (tests/tiny_gguf.py) with every matrix of one type, measured as the test does
(perfx_core.bench.held_weight_bytes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' file writer, so both measure the same files

from tiny_gguf import sizes_for, write_tiny_llama_gguf  # noqa: E402

from perfx_core.bench import held_weight_bytes  # noqa: E402
from perfx_core.gguf_file import read_gguf  # noqa: E402

TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q4_K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="numpy,opencl")
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    backends = args.backends.split(",")
    print("| type | file bytes per weight | " + " | ".join(f"{b}: bytes per weight (x file)" for b in backends) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in backends) + " |")
    with tempfile.TemporaryDirectory() as tmp:
        for tensor_type in args.types.split(","):
            path = write_tiny_llama_gguf(
                Path(tmp) / f"{tensor_type}.gguf", tensor_type=tensor_type, seed=5, **sizes_for(tensor_type)
            ).path
            tensors = {name: t for name, t in read_gguf(path).tensors.items() if not name.endswith("norm.weight")}
            file_bytes = sum(t.nbytes for t in tensors.values())
            weights = sum(t.n_elements for t in tensors.values())
            cells = []
            for backend in backends:
                held = sum(kind["bytes"] for kind in held_weight_bytes(str(path), backend).values())
                cells.append(f"{held / weights:.4f} ({held / file_bytes:.2f}x)")
            print(f"| {tensor_type} | {file_bytes / weights:.4f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
