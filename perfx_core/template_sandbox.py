"""Rendering a model file's Jinja template within a budget of time, output size and memory.

Chat templates are code from model files. Jinja's sandbox stops attribute escapes but not a template that loops
for minutes or builds gigabytes. Here a render is watched while it runs:
- time and cancellation: a trace function on the rendering thread, called on each line of the compiled template
  (and only there: other frames are not traced), raises once the deadline passes or the caller cancels;
- memory: the same check stops the render once the process's anonymous resident memory has grown by more than
  ``max_memory_bytes`` since it began (the current figure from /proc/self/statm, one ~2 us read per template line;
  elsewhere the peak from getrusage, which misses growth below an earlier peak). The figure is the process's:
  another thread allocating hundreds of MiB during a render (a model loading) counts against it too, a price
  for a check cheap enough to run on every line (tracemalloc would see only the render's own allocations, at
  several times a render's cost);
- output: the rendered text is taken in pieces and stops at ``max_chars``;
- single operations that would allocate a lot at once (``'x' * 10**9``, ``2 ** 10**9``, widths like ``'%999999999d'``
  or ``center(10**9)``) are refused before they run.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import wraps
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_INT_ARGUMENT = 100_000  # the largest integer a filter takes (as jinja's range() has MAX_RANGE items)
MAX_POWER_BITS = 4096
_LARGE_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{6,})|\{[^{}]*:[^{}]*\d{6,}[^{}]*\}")
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RenderBudgetExceeded(Exception):
    """The render ran out of time, output size or memory, or the caller cancelled it."""


@dataclass(frozen=True)
class RenderBudget:
    seconds: float = 2.0
    max_chars: int = 1 << 20
    max_memory_bytes: int = 256 << 20
    cancelled: Callable[[], bool] | None = None


def _check_size(value: Any, limit: int) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > limit:
        raise SecurityError(f"a value of {len(value)} items exceeds the template's limit of {limit}")
    return value


def _bounded_arguments(function: Callable) -> Callable:
    @wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARGUMENT:
                raise SecurityError(f"the integer argument {value} exceeds the template's limit of {MAX_INT_ARGUMENT}")
        return function(*args, **kwargs)

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the operators and filters that can allocate at once held to limits."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, max_chars: int, **options: Any):
        super().__init__(**options)
        self.max_chars = max_chars
        self.filters = {name: _bounded_arguments(f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} exceeds the template's limit of {MAX_POWER_BITS} bits")
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > self.max_chars:
                    raise SecurityError(f"repeating {len(seq)} items {count} times exceeds the template's limit")
        elif operator == "%" and isinstance(left, str) and _LARGE_WIDTH.search(left):
            raise SecurityError("a format width beyond the template's limit")
        return _check_size(super().call_binop(context, operator, left, right), self.max_chars)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:  # str.format / format_map
        f_self = getattr(value, "__self__", None)
        if isinstance(f_self, str) and _LARGE_WIDTH.search(f_self):
            raise SecurityError("a format width beyond the template's limit")
        return super().wrap_str_format(value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        return _bounded_arguments(super().call)(__context, __obj, *args, **kwargs)


def _resident_reader() -> tuple[Callable[[], int], Callable[[], None]]:
    """A function returning the process's anonymous resident bytes now (resident minus file-backed pages, so a
    memory-mapped model file being read does not count), and one that releases what it holds."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:  # not Linux: the peak is what there is
        return (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT), (lambda: None)

    def anonymous() -> int:
        fields = os.pread(fd, 128, 0).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE

    return anonymous, (lambda: os.close(fd))


def render_within(template: jinja2.Template, variables: Mapping[str, Any], budget: RenderBudget) -> str:
    """``template.render(**variables)``, stopped with RenderBudgetExceeded once it exceeds ``budget``."""
    deadline = time.monotonic() + budget.seconds
    resident, release = _resident_reader()
    try:
        resident_start = resident()
    except BaseException:
        release()
        raise
    cancelled = budget.cancelled

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderBudgetExceeded(f"rendering took longer than {budget.seconds:g} s")
        if cancelled is not None and cancelled():
            raise RenderBudgetExceeded("the request was cancelled")
        grown = resident() - resident_start
        if grown > budget.max_memory_bytes:
            raise RenderBudgetExceeded(f"rendering grew the process by more than {budget.max_memory_bytes >> 20} MiB")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        # Compiled templates (and their macros and blocks) carry the file name "<template>".
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        pieces: list[str] = []
        size = 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > budget.max_chars:
                raise RenderBudgetExceeded(f"the rendered prompt exceeds {budget.max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        sys.settrace(previous)
        release()
