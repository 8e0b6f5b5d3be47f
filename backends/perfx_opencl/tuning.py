"""The int4 GEMV's shapes as data the ops read: the defaults, and the per-device results of `perfx tune`.

The search that produces the results is tuner.py. They are kept in one JSON file per (device, driver, backend
variant) under the user cache directory (perfx_core.settings.cache_dir()/opencl-tuning/). Entries carry a hash of
kernels/int4.cl and ops.py, so editing the kernel or its launch geometry makes old results stale instead of wrong.
Devices measured here ship their results in tuned/ (the same entries, chosen by the device's name and backend
variant), so a first run there is tuned without `perfx tune`; a user's own results take precedence. Untuned
shapes use GEMV_TUNING, which is good untuned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from perfx_core.settings import cache_dir

from . import kernel_source

FORMAT = 3  # 2: shapes carry QX; 3: keys carry the weight form
SMALL_NS = (1, 2, 4, 8, 16)  # the GEMV kernel's token counts per pass (NT)
# The GEMV's shape (docs/opencl.md): RW row lanes x KS k-splits, CR columns per thread, UC chunks in flight,
# XS shared chunk sums, QX quantized activations with integer dot products (on by default where native).
GEMV_TUNING = {"RW": 32, "KS": 16, "CR": 1, "UC": 2, "XS": 0, "QX": 0}  # what `perfx tune` picks most on an H200
ADRENO_GEMV_TUNING = {"RW": 64, "KS": 4, "CR": 1, "UC": 1, "XS": 0, "QX": 0}  # Adreno waves are 64+ wide
FLAGS = ("XS", "QX")  # the 0/1 entries of a shape


DEFAULT_FORM = "g128"  # the form a shape's entry falls back to: what AWQ checkpoints and `perfx quantize` make


def weight_form(group_size: int, symmetric: bool) -> str:
    """How a weight's scales are laid out, which moves the best shape: "g32s" is GGUF Q4_0 (one float16 scale
    per 32 columns and no bias array), "g32" Q4_1 (a float bias per 32 too), "g128" AWQ's 128-column groups."""
    return f"g{group_size}{'s' if symmetric else ''}"


def shape_key(silu: bool, rows: int, k: int, nt: int, form: str = DEFAULT_FORM) -> str:
    return f"{'silu' if silu else 'gemv'}:{rows}x{k}:{form}:nt{nt}"


def kernel_hash() -> str:
    """Of the GEMV kernel (with the shared pieces prepended to it) and of ops.py, which turns a tuned shape into
    launch sizes: changing any makes saved shapes stale."""
    digest = hashlib.sha256()
    for path in (*kernel_source.paths("int4"), Path(__file__).parent / "ops.py"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:80]


def cache_path(rt) -> Path:
    details = rt.device.details
    name = f"{_slug(rt.device.name)}-{_slug(details.get('driver', ''))}-{rt.variant}.json"
    return cache_dir() / "opencl-tuning" / name


SHIPPED_DIR = Path(__file__).parent / "tuned"


def shipped(rt) -> dict[str, dict[str, int]]:
    """The tuned shapes perfx ships for ``rt``'s device and variant, or {}. Not stamped with the kernel hash: an
    entry that no longer is the fastest still runs correctly, and the next measurement replaces the file."""
    path = SHIPPED_DIR / f"{_slug(rt.device.name)}-{rt.variant}.json"
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["gemv"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {key: config for key, config in entries.items() if _valid(config)} if isinstance(entries, dict) else {}


def load(rt) -> dict[str, dict[str, int]]:
    """The tuned GEMV shapes of ``rt``'s device, or {} when none were saved, they are stale or unreadable."""
    try:
        data = json.loads(cache_path(rt).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kernel_hash") != kernel_hash():
        return {}
    entries = data.get("gemv")
    if not isinstance(entries, dict):
        return {}
    return {key: config for key, config in entries.items() if _valid(config)}


def _valid(config: Any) -> bool:
    """A shape the kernels can run (a hand-edited or corrupt file must not hang or crash a launch)."""
    if not isinstance(config, dict) or set(config) != set(GEMV_TUNING):
        return False
    if not all(type(v) is int for v in config.values()):
        return False
    return (
        1 <= config["RW"] <= 1024
        and 1 <= config["KS"] <= 1024
        and 1 <= config["CR"] <= 8
        and 1 <= config["UC"] <= 8
        and config["XS"] in (0, 1)
        and config["QX"] in (0, 1)
    )


def save(rt, entries: dict[str, dict[str, int]]) -> Path:
    """Merge ``entries`` into the device's cache file, written atomically (temporary file + rename)."""
    path = cache_path(rt)
    merged = {**load(rt), **entries}
    data = {
        "format": FORMAT,
        "device": rt.device.name,
        "driver": rt.device.details.get("driver", ""),
        "kernel_hash": kernel_hash(),
        "gemv": merged,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
