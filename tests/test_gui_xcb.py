"""The desktop app on a real X display: Xvfb, Qt's xcb platform plugin and its X11 libraries.

Every other GUI test runs on Qt's offscreen platform, which needs none of the X11 libraries, so a missing one
would go unseen there. This module starts Xvfb itself, then runs ``perfx gui`` and the whole of
tests/test_gui.py on it, each in a subprocess (a process has one Qt platform). Without Xvfb on PATH it skips,
unless PERFX_REQUIRE_XVFB=1 (.ci/run sets it where it installs Xvfb): then, as when Xvfb cannot start, it fails.
A long module (tests/conftest.py: LONG_MODULES): it loads the model twice more.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

try:
    import perfx_gui  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gui"))

from perfx_gui.display import display_error, missing_xcb_libraries

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def x_display(tmp_path_factory):
    """DISPLAY of a fresh Xvfb server (it picks a free display number and writes it to a pipe when ready)."""
    xvfb = shutil.which("Xvfb")
    if xvfb is None:
        if os.environ.get("PERFX_REQUIRE_XVFB") == "1":
            pytest.fail("PERFX_REQUIRE_XVFB=1 but Xvfb is not on PATH (Debian: apt-get install xvfb)")
        pytest.skip("Xvfb is not installed (Debian: apt-get install xvfb)")
    log = tmp_path_factory.mktemp("xvfb") / "xvfb.log"
    ready_r, ready_w = os.pipe()
    with open(log, "wb") as log_file:
        server = subprocess.Popen(
            [xvfb, "-displayfd", str(ready_w), "-nolisten", "tcp", "-screen", "0", "1280x800x24"],
            pass_fds=(ready_w,),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    os.close(ready_w)
    number = b""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not number.endswith(b"\n") and time.monotonic() < deadline and server.poll() is None:
        if select.select([ready_r], [], [], 0.2)[0]:
            chunk = os.read(ready_r, 16)
            if not chunk:
                break
            number += chunk
    os.close(ready_r)
    if not number.strip().isdigit():
        server.kill()
        server.wait()
        pytest.fail(f"Xvfb did not start within {START_TIMEOUT_S} s:\n{log.read_text(errors='replace')}")
    try:
        yield f":{int(number)}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _env(display: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WAYLAND_DISPLAY", "XDG_SESSION_TYPE")}
    env.update(DISPLAY=display, QT_QPA_PLATFORM="xcb", PERFX_LOAD_PLUGINS="")  # NumPy only: a quicker load
    return env


def test_xcb_libraries_and_display_are_usable(x_display):
    assert missing_xcb_libraries() == []  # what .ci/run's apt-get line installs
    assert display_error(x_display) is None


def test_perfx_gui_runs_on_xcb(x_display, tmp_path):
    env = _env(x_display)
    settings = tmp_path / "config" / "settings.json"  # written when the window has the loaded model
    env["PERFX_CONFIG_DIR"] = str(settings.parent)
    app = subprocess.Popen(
        [sys.executable, "-m", "perfx_core", "gui", "--context-length", "256"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while app.poll() is None and not settings.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1)
        running = app.poll() is None  # it waits for the user, where a Qt abort would have ended it
    finally:
        app.terminate()
        _, stderr = app.communicate(timeout=30)
    assert running and settings.exists(), stderr
    assert "qt.qpa" not in stderr and "Could not load the Qt platform plugin" not in stderr, stderr


def test_gui_tests_pass_on_a_real_x_display(x_display):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gui.py"],
        cwd=ROOT,
        env=_env(x_display),
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout, tail
