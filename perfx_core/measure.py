"""Host-side measurements shared by generation stats and benchmarks."""

from __future__ import annotations

import sys

import psutil

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]


def peak_host_bytes() -> int:
    """Peak resident set size of this process since it started, in bytes (current RSS where no peak is kept)."""
    if resource is None:
        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes
