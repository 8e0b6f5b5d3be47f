"""Check, before a QApplication exists, that Qt can open its X11 platform (xcb).

When a library of Qt's xcb plugin is missing, or no X server can be reached, Qt prints a hint that names only
``libxcb-cursor0`` and aborts the whole process, so ``perfx gui`` could not say what is wrong. These checks
load the same libraries the plugin links against and connect to ``$DISPLAY`` first, and raise
GuiUnavailableError naming the Debian packages to install.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from . import GuiUnavailableError

# The X11 libraries Qt 6's xcb plugin (libqxcb.so and libQt6XcbQpa) links against, and their Debian/Ubuntu
# packages (as `ldd libqxcb.so` lists them for PySide6 6.11).
XCB_LIBRARIES = {
    "libxcb.so.1": "libxcb1",
    "libX11.so.6": "libx11-6",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
}


def first_platform(env: Mapping[str, str] = os.environ) -> str:
    """The platform plugin Qt tries first: $QT_QPA_PLATFORM's first entry, else wayland or xcb on Linux."""
    requested = env.get("QT_QPA_PLATFORM", "").strip()
    if requested:
        return requested.split(";")[0].split(":")[0].strip()
    if not sys.platform.startswith("linux"):
        return ""
    return "wayland" if env.get("XDG_SESSION_TYPE") == "wayland" else "xcb"


def xcb_plugin_path() -> Path:
    from PySide6.QtCore import QLibraryInfo

    return Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath)) / "platforms" / "libqxcb.so"


def _loads(library: str) -> str | None:
    """None when the dynamic loader can load ``library`` (a name or a path), else the loader's message."""
    try:
        ctypes.CDLL(library)
    except OSError as exc:
        return str(exc)
    return None


def missing_xcb_libraries(plugin: Path | None = None, libraries: Mapping[str, str] = XCB_LIBRARIES) -> list[str]:
    """Libraries Qt's xcb plugin needs that cannot be loaded here: sonames, or the loader's message for one
    outside ``libraries``. Empty when the plugin loads (or is not installed: then Qt itself says so)."""
    plugin = plugin or xcb_plugin_path()
    if not plugin.is_file():
        return []
    error = _loads(str(plugin))
    if error is None:
        return []
    missing = [name for name in libraries if _loads(name)]  # the loader names only the first missing library
    return missing or [error]


def install_hint(missing: list[str], libraries: Mapping[str, str] = XCB_LIBRARIES) -> str:
    packages = [libraries[name] for name in missing if name in libraries]
    others = [name for name in missing if name not in libraries]
    text = f"Qt's X11 platform plugin (xcb) cannot load: missing {', '.join(missing)}."
    if packages:
        text += f" On Debian or Ubuntu: sudo apt-get install {' '.join(packages)}"
    if others:
        text += " Install the package that provides it"
    return text + " (docs/gui.md lists the X11 libraries the app needs)."


def display_error(display: str) -> str | None:
    """None when an X server answers at ``display``, else why not (connecting as Qt would, through libxcb)."""
    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError as exc:
        return str(exc)
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(display.encode(), None)
    code = xcb.xcb_connection_has_error(connection)
    xcb.xcb_disconnect(connection)  # also frees a connection in the error state
    return None if code == 0 else f"cannot connect to the X server at DISPLAY={display} (libxcb error {code})"


def require_display(env: Mapping[str, str] = os.environ) -> None:
    """Raise GuiUnavailableError when Qt would abort opening its xcb platform; other platforms pass."""
    if first_platform(env) != "xcb":
        return
    missing = missing_xcb_libraries()
    if missing:
        raise GuiUnavailableError(install_hint(missing))
    display = env.get("DISPLAY", "")
    if not display:
        raise GuiUnavailableError(
            "no X display: DISPLAY is not set. Run the app in a desktop session, through `ssh -X`, or under a "
            "virtual X server (`xvfb-run perfx gui`)"
        )
    error = display_error(display)
    if error:
        raise GuiUnavailableError(f"{error}: is the X server running, and may this user connect to it?")
