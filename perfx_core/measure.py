"""Host-side measurements shared by generation stats and benchmarks."""

from __future__ import annotations

import resource
import sys


def peak_host_bytes() -> int:
    """Peak resident set size of this process since it started, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes
