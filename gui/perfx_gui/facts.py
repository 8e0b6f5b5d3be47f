"""Plain-Python facts for the app's views (no Qt): model facts, per-op weight bytes, number formatting."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Matmul ops the model calls once per layer (or once per pass), and the GGUF tensors whose bytes each reads.
MATMUL_TENSORS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "linear_add_rmsnorm": ("attn_output", "ffn_down"),
    "gate_up_silu": ("ffn_gate", "ffn_up"),
}
_BLOCK_TENSOR = re.compile(r"^blk\.\d+\.([a-z_]+)\.weight$")


@dataclass
class ModelFacts:
    name: str
    path: str
    architecture: str
    parameters: int
    quantization: str
    tensor_types: dict[str, int]  # ggml type name -> tensor count
    file_bytes: int
    context_length: int  # the KV cache length it was loaded with
    trained_context_length: int
    backend: str
    device: str
    bandwidth_gbs: float | None
    op_weight_bytes: dict[str, int] = field(default_factory=dict)  # op -> weight bytes read per forward pass
    bandwidth_note: str = ""  # where bandwidth_gbs comes from, or why there is none

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for the facts table."""
        types = ", ".join(
            f"{name} x{count}" for name, count in sorted(self.tensor_types.items(), key=lambda kv: -kv[1])
        )
        return [
            ("Name", self.name),
            ("File", self.path),
            ("Architecture", self.architecture),
            ("Parameters", format_count(self.parameters)),
            ("Quantization", self.quantization),
            ("Tensor types", types or "n/a"),
            ("File size", format_bytes(self.file_bytes)),
            ("Context length", f"{self.context_length} (trained: {self.trained_context_length})"),
            ("Backend", self.backend),
            ("Device", self.device),
            ("Peak bandwidth", self.bandwidth_text()),
        ]

    def bandwidth_text(self) -> str:
        value = f"{self.bandwidth_gbs:.0f} GB/s" if self.bandwidth_gbs else "n/a"
        return f"{value} ({self.bandwidth_note})" if self.bandwidth_note else value


def parameter_count(config: Any) -> int:
    """Weights of a Llama model, counted from its config (embeddings, blocks, norms, untied output)."""
    c = config
    per_layer = c.dim * (c.q_dim + 2 * c.n_kv_heads * c.head_dim) + c.q_dim * c.dim + 3 * c.dim * c.ffn_dim + 2 * c.dim
    output = 0 if c.tied_embeddings else c.vocab_size * c.dim
    return c.vocab_size * c.dim + c.n_layers * per_layer + c.dim + output


def file_type_name(file_type: Any) -> str:
    """GGUF ``general.file_type`` as a name like Q4_1 (the number itself when the gguf package lacks it)."""
    if file_type is None:
        return "n/a"
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError):
        return f"file type {file_type}"


def gguf_tensor_facts(path: str | os.PathLike[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(tensor type counts, weight bytes per forward pass of each matmul op) from a GGUF's tensor table."""
    from perfx_core.gguf_file import read_gguf

    gf = read_gguf(path)
    types: dict[str, int] = {}
    op_bytes = {op: 0 for op in MATMUL_TENSORS}
    for name, info in gf.tensors.items():
        types[info.ggml_type.name] = types.get(info.ggml_type.name, 0) + 1
        match = _BLOCK_TENSOR.match(name)
        if match:
            for op, parts in MATMUL_TENSORS.items():
                if match.group(1) in parts:
                    op_bytes[op] += info.nbytes
    output = gf.tensors.get("output.weight") or gf.tensors.get("token_embd.weight")
    op_bytes["logits"] = output.nbytes if output is not None else 0
    return types, op_bytes


def model_facts(model: Any) -> ModelFacts:
    """Facts about a loaded perfx_core Model (reads the GGUF tensor table again: about a second)."""
    meta = model.metadata
    try:
        types, op_bytes = gguf_tensor_facts(model.path)
    except Exception:  # facts are informative only: never fail a load over them
        types, op_bytes = {}, {}
    device = model.runtime.device
    bandwidth, note = device.bandwidth_gbs, "reported by the backend"
    if bandwidth is None and device.kind == "cpu":
        bandwidth, threads = estimate_cpu_bandwidth_gbs()
        note = f"estimated: a {COPY_BYTES >> 20} MiB memory copy on {threads} threads, read + write"
    elif bandwidth is None:
        note = "the backend reports no peak bandwidth for this device"
    return ModelFacts(
        name=str(meta.get("general.name") or Path(model.path).stem),
        path=str(model.path),
        architecture=str(meta.get("general.architecture", "llama")),
        parameters=parameter_count(model.config),
        quantization=file_type_name(meta.get("general.file_type")),
        tensor_types=types,
        file_bytes=Path(model.path).stat().st_size,
        context_length=model.context_length,
        trained_context_length=model.config.context_length,
        backend=model.backend,
        device=device.name,
        bandwidth_gbs=bandwidth,
        op_weight_bytes=op_bytes,
        bandwidth_note=note,
    )


COPY_BYTES = 128 << 20  # larger than most CPUs' last-level cache, so the copy runs from memory


@functools.cache
def estimate_cpu_bandwidth_gbs(nbytes: int = COPY_BYTES, repeats: int = 3) -> tuple[float, int]:
    """(GB/s, threads) of the fastest of ``repeats`` NumPy copies of ``nbytes``, split over this process's cores.

    CPU backends report no peak bandwidth; a copy that reads and writes memory on every core is a floor for it
    (about a quarter of a second, once per process). NumPy releases the GIL while it copies.
    """
    import numpy as np

    threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)
    best = float("inf")
    for _ in range(repeats):  # the first also faults dst's pages in
        workers = [
            threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b]))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9, threads


@dataclass(frozen=True)
class OpRow:
    op: str
    calls_per_token: float
    ms_per_token: float
    share: float  # of the profiled time
    bytes_per_token: int | None  # weight bytes the op reads per token (matmul ops only)
    achieved_gbs: float | None
    bandwidth_fraction: float | None  # achieved / device peak; None when the peak is unknown


def op_rows(
    profile: dict[str, dict[str, float]], steps: int, op_weight_bytes: dict[str, int], bandwidth_gbs: float | None
) -> list[OpRow]:
    """Per-op rows from an OpProfile dict ({op: {seconds, calls}}) covering ``steps`` decode steps."""
    steps = max(1, steps)
    total = sum(v["seconds"] for v in profile.values()) or 1.0
    rows = []
    for op, v in sorted(profile.items(), key=lambda kv: -kv[1]["seconds"]):
        seconds = v["seconds"]
        per_token_s = seconds / steps
        nbytes = op_weight_bytes.get(op) or None
        gbs = nbytes / per_token_s / 1e9 if nbytes and per_token_s > 0 else None
        fraction = gbs / bandwidth_gbs if gbs is not None and bandwidth_gbs else None
        rows.append(OpRow(op, v["calls"] / steps, 1e3 * per_token_s, seconds / total, nbytes, gbs, fraction))
    return rows


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit} ({n:,})"
    return str(n)


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or a backend error whose message talks about memory (device allocation failures)."""
    from perfx_core.errors import BackendError

    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, BackendError) and ("memory" in text or "out of resources" in text)
