"""``perfx gui`` says what is missing instead of letting Qt abort: X11 libraries of Qt's xcb plugin, no display.

The checks run before any QApplication exists, so these tests run them directly and through ``perfx gui`` in a
subprocess (where Qt would otherwise abort the process with SIGABRT). tests/test_gui_xcb.py covers the working
case on a real X server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("PySide6")

try:
    import perfx_gui  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gui"))

from perfx_gui.display import XCB_LIBRARIES, first_platform, install_hint, missing_xcb_libraries, xcb_plugin_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Qt's xcb platform is Linux's")


def test_the_platform_qt_tries_first():
    assert first_platform({"QT_QPA_PLATFORM": "offscreen"}) == "offscreen"
    assert first_platform({"QT_QPA_PLATFORM": "xcb;wayland"}) == "xcb"
    assert first_platform({"QT_QPA_PLATFORM": "xcb:nomitshm"}) == "xcb"
    assert first_platform({}) == "xcb"
    assert first_platform({"XDG_SESSION_TYPE": "wayland"}) == "wayland"


def test_the_table_names_every_x11_library_the_plugin_links():
    # libqxcb.so links Qt's own libQt6XcbQpa, which links the X11 libraries: each must be in the table
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils) to list the plugin's libraries")
    plugin = xcb_plugin_path()
    needed = set()
    for library in (plugin, plugin.parents[2] / "lib" / "libQt6XcbQpa.so.6"):
        if not library.is_file():
            pytest.skip(f"this PySide6 has no {library.name}")
        dynamic = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True, check=True).stdout
        needed |= {line.split("[")[-1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line}
    x11 = {name for name in needed if name.startswith(("libxcb", "libX11", "libxkbcommon"))}
    assert "libxcb.so.1" in x11 and x11 <= set(XCB_LIBRARIES)


def test_missing_libraries_are_named_with_their_packages(tmp_path):
    broken_plugin = tmp_path / "libqxcb.so"
    broken_plugin.write_bytes(b"not a shared library")  # the loader refuses it, as it does a plugin missing a library
    table = {"libc.so.6": "libc6", "libperfx-no-such-lib.so.4": "libperfx-no-such-lib4"}
    missing = missing_xcb_libraries(broken_plugin, table)
    assert missing == ["libperfx-no-such-lib.so.4"]
    hint = install_hint(missing, table)
    assert "missing libperfx-no-such-lib.so.4" in hint and "sudo apt-get install libperfx-no-such-lib4" in hint
    # a failure outside the table is passed on as the loader's own message
    (reason,) = missing_xcb_libraries(broken_plugin, {"libc.so.6": "libc6"})
    assert "libqxcb.so" in reason
    assert missing_xcb_libraries(tmp_path / "absent.so", table) == []  # no xcb plugin: Qt itself says so


def _perfx_gui(env_changes: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_changes}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-m", "perfx_core", "gui"], env=env, capture_output=True, text=True, timeout=120
    )


def _free_display() -> str:
    n = 90
    while Path(f"/tmp/.X11-unix/X{n}").exists() or Path(f"/tmp/.X{n}-lock").exists():
        n += 1
    return f":{n}"


def test_perfx_gui_without_a_display_says_so():
    result = _perfx_gui({"QT_QPA_PLATFORM": "xcb", "DISPLAY": None, "WAYLAND_DISPLAY": None})
    assert result.returncode == 2, result.stderr  # an error message, not Qt's abort (-6)
    if missing_xcb_libraries():
        assert "sudo apt-get install" in result.stderr
    else:
        assert "perfx: error: no X display: DISPLAY is not set" in result.stderr


def test_perfx_gui_with_no_x_server_at_display_says_so():
    if missing_xcb_libraries():
        pytest.skip("the xcb libraries are missing here (the test above covers that message)")
    display = _free_display()
    result = _perfx_gui({"QT_QPA_PLATFORM": "xcb", "DISPLAY": display})
    assert result.returncode == 2, result.stderr
    assert f"cannot connect to the X server at DISPLAY={display}" in result.stderr
