"""Calibration text for AWQ: the default set shipped in perfx_core/data, or a user's file, cut into token samples."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError
from ..tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_CALIBRATION = DATA_DIR / "calibration.txt"
HELDOUT_TEXT = DATA_DIR / "heldout.txt"  # for perplexity checks; never used for calibration
MIN_TOKENS = 16


@dataclass(frozen=True)
class Calibration:
    tokens: np.ndarray  # int32 (samples, seqlen)
    source: str  # "perfx default calibration set" or the file's path
    sha256: str  # of the text


def read_text(path: str | os.PathLike[str]) -> str:
    """A UTF-8 text file; InvalidArgumentError (a PerfxError) when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgumentError(f"calibration/text file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(
            f"cannot read text file {str(path)!r}: {e}; pass a readable UTF-8 text file"
        ) from None


def strip_header(text: str) -> str:
    """Drop the leading '#' comment lines of perfx's own data files (source and licence notes)."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith("#"):
        i += 1
    return "".join(lines[i:])


def load_calibration(
    tokenizer: Tokenizer, path: str | os.PathLike[str] | None = None, n_samples: int = 32, seqlen: int = 256
) -> Calibration:
    """Up to ``n_samples`` consecutive, non-overlapping windows of ``seqlen`` tokens of the calibration text."""
    if n_samples < 1 or seqlen < 2:
        raise InvalidArgumentError(f"calibration needs n_samples >= 1 and seqlen >= 2; got {n_samples} and {seqlen}")
    text = read_text(path) if path is not None else strip_header(read_text(DEFAULT_CALIBRATION))
    ids = np.asarray(tokenizer.encode(text, add_special=False), dtype=np.int32)
    if len(ids) < MIN_TOKENS:
        raise InvalidArgumentError(
            f"the calibration text has {len(ids)} tokens; AWQ needs at least {MIN_TOKENS} (a few KB of text is typical)"
        )
    seqlen = min(seqlen, len(ids))
    n = min(n_samples, len(ids) // seqlen)
    source = "perfx default calibration set (perfx_core/data/calibration.txt)" if path is None else str(path)
    return Calibration(ids[: n * seqlen].reshape(n, seqlen), source, hashlib.sha256(text.encode("utf-8")).hexdigest())
