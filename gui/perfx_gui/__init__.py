"""perfx desktop app (PySide6): chat, backend picker, live profiler and benchmarks.

Importing this package does not import Qt, so ``perfx gui`` can report a missing PySide6 cleanly.
"""

from __future__ import annotations

import importlib.util

from perfx_core.errors import PerfxError

__all__ = ["GuiUnavailableError", "require_qt"]


class GuiUnavailableError(PerfxError):
    """The desktop app cannot start (PySide6 is not installed, or no display can be opened)."""


def require_qt() -> None:
    """Raise GuiUnavailableError, saying how to install it, when PySide6 cannot be imported."""
    if importlib.util.find_spec("PySide6") is None:
        raise GuiUnavailableError(
            "the desktop app needs PySide6, which is not installed: run `pip install 'perfx[gui]'` "
            "(or `pip install PySide6-Essentials`)"
        )
