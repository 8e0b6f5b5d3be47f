"""The desktop app driven through pytest-qt on the real SmolLM2 model (offscreen, NumPy backend).

One window is shared by the tests of this module (loading the model is the slow part); each test leaves
it usable for the next. Plugins from entry points are switched off here so the run does not depend on
which optional backends this machine has; switching backends uses a test plugin that registers the NumPy
runtime under another name.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any Qt import

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

try:
    import perfx_gui  # noqa: F401
except ImportError:  # running from a checkout where the gui package is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gui"))

from perfx_gui.message_view import CODE_BACKGROUND
from perfx_gui.models import ConversationModel
from perfx_numpy import ops as numpy_ops
from perfx_numpy.runtime import NumpyBackend, NumpyRuntime
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont

from perfx_core.backend import DeviceInfo
from perfx_core.errors import BackendError
from perfx_core.hookspecs import hookimpl
from perfx_core.ops import PRIMITIVE_OPS
from perfx_core.plugins import get_registry, register_plugin, unregister_plugin

pytestmark = pytest.mark.slow
StatsRole = ConversationModel.StatsRole

LOAD_TIMEOUT_MS = 120_000
GEN_TIMEOUT_MS = 90_000


class TwinRuntime(NumpyRuntime):
    backend_name = "numpy-twin"


class TwinBackend(NumpyBackend):
    name = "numpy-twin"
    description = "the NumPy runtime under another name (GUI tests)"

    def open(self, device=None):
        return TwinRuntime(self.devices()[0])


class OutOfMemoryBackend(NumpyBackend):
    name = "oom-test"
    description = "a device that is always out of memory (GUI tests)"

    def devices(self):
        return [DeviceInfo(0, "Tiny GPU", "gpu", memory_bytes=1 << 20)]

    def open(self, device=None):
        raise BackendError("cannot allocate 200 MiB: the device is out of memory")


class TestBackendsPlugin:
    @staticmethod
    @hookimpl
    def perfx_register_backends(register):
        register(TwinBackend())
        register(OutOfMemoryBackend())

    @staticmethod
    @hookimpl
    def perfx_register_ops(register):
        for backend in ("numpy-twin", "oom-test"):
            for name in PRIMITIVE_OPS:
                register(backend, name, getattr(numpy_ops, name))


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory):
    from perfx_gui.main_window import MainWindow

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERFX_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))
        mp.setenv("PERFX_LOAD_PLUGINS", "")  # the built-in NumPy backend only
        get_registry(refresh=True)
        win = MainWindow(context_length=512)
        win.show()
        win.load_initial_model()
        yield win
        win.close()
    get_registry(refresh=True)


def wait_loaded(qtbot, win, backend="numpy"):
    qtbot.waitUntil(
        lambda: not win.loading and win.model is not None and win.model.backend == backend, timeout=LOAD_TIMEOUT_MS
    )


def chat(qtbot, win, text, **overrides):
    """Send ``text`` and wait for the reply; returns the number of times the reply grew while streaming."""
    updates = []

    def grew(_first, _last, roles):
        if Qt.ItemDataRole.DisplayRole in roles:  # the text, not the live stats line
            updates.append(win.generating)

    win.conversation.dataChanged.connect(grew)
    try:
        win.send_message(text, temperature=0.0, **overrides)
        assert win.generating
        qtbot.waitUntil(lambda: not win.generating, timeout=GEN_TIMEOUT_MS)
    finally:
        win.conversation.dataChanged.disconnect(grew)
    return sum(updates)


def test_runs_on_the_platform_asked_for(qapp):
    # offscreen here; tests/test_gui_xcb.py runs this module again on a real X display (xcb)
    assert qapp.platformName() == os.environ["QT_QPA_PLATFORM"]


def test_loads_default_model_with_facts(qtbot, window):
    wait_loaded(qtbot, window)
    from perfx_core.settings import recent_models

    assert window.statusBar().currentMessage().startswith(f"Loaded {Path(window.model.path).name} on numpy")
    assert window.size().width() == 1200 and window.size().height() == 720  # loading did not widen it
    assert window.facts_model.value("Quantization") == "Q4_1"
    assert window.facts_model.value("Parameters").startswith("134.5M")
    assert window.facts_model.value("Context length").startswith("512")
    assert window.model_combo.currentData() == str(window.model.path)
    assert recent_models() == [str(window.model.path)]
    assert window.chat.send_button.isEnabled()


def test_chat_streams_tokens_and_updates_dashboard(qtbot, window):
    wait_loaded(qtbot, window)
    window.on_clear_requested()
    assert not window.chat.profile.isChecked()  # profiling slows decoding: it is off until asked for
    window.chat.profile.setChecked(True)
    live = []  # (message stats, status bar) whenever the streaming reply's stats change

    def record(*_):
        if window.generating:
            live.append((window.conversation.data(window.conversation.index(1), StatsRole), status(window)))

    window.conversation.dataChanged.connect(record)
    try:
        streamed = chat(qtbot, window, "Name a colour.", max_tokens=12, ignore_eos=True)
    finally:
        window.conversation.dataChanged.disconnect(record)
    messages = window.conversation.messages()
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"].strip()
    assert streamed >= 3  # the reply grew token by token while the worker ran
    *running, final = [stats for stats, _ in live if stats]
    assert len(running) >= 2 and all(s["finish_reason"] == "" for s in running) and final["finish_reason"]
    assert running[-1]["elapsed_s"] > running[0]["elapsed_s"] and running[-1]["tokens"] > 0
    assert any("tok/s" in text and text.startswith("Generating… ") for _, text in live)
    kept = messages[1]["stats"]  # kept with the message once it is done
    assert kept["tokens"] == 12 and kept["finish_reason"] == "length"
    assert kept["tokens_per_s"] > 0 and 0 < kept["time_to_first_token_s"] < kept["elapsed_s"]
    footer = window.chat.view.itemDelegate().stats_text(window.conversation.index(1))
    assert footer.startswith("12 tokens · ") and "tok/s" in footer and footer.endswith("stop reason: max tokens")
    values = window.dashboard.values
    assert values["ttft"].text().endswith("ms") and values["decode"].text().endswith("tok/s")
    assert values["finish"].text() == "length"
    assert window.dashboard.speed_chart.series["prefill"].points
    ops = {row.op: row for row in window.op_profile.rows()}
    assert ops["gate_up_silu"].bytes_per_token > 0 and ops["gate_up_silu"].achieved_gbs > 0
    # NumPy's device reports no peak bandwidth: the app measures the CPU's and says so
    assert "estimated" in window.facts_model.value("Peak bandwidth") and window.facts.bandwidth_gbs > 0
    assert ops["gate_up_silu"].bandwidth_fraction > 0
    assert window.op_profile.data(window.op_profile.index(0, 6)).endswith("%")
    assert "estimated" in window.dashboard.bandwidth.text()


def test_throughput_chart_breaks_between_replies(qtbot, window):
    wait_loaded(qtbot, window)
    window.on_clear_requested()
    window.chat.profile.setChecked(True)  # for the op table
    chart = window.dashboard.speed_chart
    if not chart.series["decode"].points:  # run alone: the previous test's reply is not there
        chat(qtbot, window, "Hi", max_tokens=8, ignore_eos=True)
    qtbot.wait(1500)  # idle time between two replies
    sent = time.monotonic() - window.session_start
    window.send_message("Hi again", temperature=0.0, max_tokens=8, ignore_eos=True)
    # the new reply's legend does not show the previous reply's numbers
    assert chart.series["prefill"].current is None and chart.series["decode"].current is None
    qtbot.waitUntil(lambda: not window.generating, timeout=GEN_TIMEOUT_MS)
    *_, first, second = [segment for segment in chart.series["decode"].segments if segment]
    assert second[0][0] - first[-1][0] > 1.0
    prefill = chart.series["prefill"].points
    assert sent <= prefill[-1][0] <= second[0][0]  # at the reply's start, not its end
    assert chart.x_range() == window.dashboard.memory_chart.x_range()  # both charts cover the same time

    window.tabs.setCurrentWidget(window.dashboard)
    qtbot.waitExposed(chart)
    table = window.dashboard.op_table  # every op row fits in the default window, no scrolling
    assert window.op_profile.rowCount() >= 5 and table.verticalScrollBar().maximum() == 0
    image = chart.grab().toImage()

    plot, blue = chart.plot_area(), QColor(chart.series["decode"].color)

    def drawn_in_column(x: float) -> bool:
        column = round(chart.position(x, 0.0).x())
        return any(_close(QColor(image.pixel(column, y)), blue) for y in range(round(plot.top()), round(plot.bottom())))

    assert drawn_in_column((second[0][0] + second[-1][0]) / 2)  # the line is seen where there is one
    assert not drawn_in_column((first[-1][0] + second[0][0]) / 2)  # and not across the idle time
    window.tabs.setCurrentWidget(window.chat)


def _close(a, b) -> bool:
    return abs(a.red() - b.red()) + abs(a.green() - b.green()) + abs(a.blue() - b.blue()) < 60


def test_chart_axes_read_plain_numbers():
    from perfx_gui.charts import nice_max, plain_number

    assert [plain_number(v) for v in (1000, 1500.0, 62.5, 0.25, 0, 7)] == ["1000", "1500", "62.5", "0.25", "0", "7"]
    assert [nice_max(v) for v in (0.0, 7, 130, 1143)] == [1.0, 8, 200, 2000]
    assert all("e" not in plain_number(nice_max(v) * i / 4) for v in (3, 999, 12_345, 2e6) for i in range(5))


def test_markdown_replies_render_code_blocks(qtbot, window, tmp_path):
    from perfx_gui.message_view import code_blocks

    path = tmp_path / "markdown.json"
    reply = "Use **this**:\n\n```python\nprint('hi')\nx = 1\n```\n\nDone."
    stats = {
        "tokens": 20,
        "tokens_per_s": 31.5,
        "time_to_first_token_s": 0.2,
        "elapsed_s": 0.9,
        "finish_reason": "stop",
    }
    messages = [{"role": "user", "content": "Show **code**"}, {"role": "assistant", "content": reply, "stats": stats}]
    path.write_text(json.dumps({"format": "perfx-conversation", "version": 1, "messages": messages}))
    assert window.open_conversation(path)
    assert window.conversation.messages() == messages  # stats are kept through save and open
    delegate, conversation = window.chat.view.itemDelegate(), window.conversation
    doc = delegate.document(conversation.index(1))
    assert code_blocks(doc) == ["print('hi')\nx = 1"]
    assert "**" not in doc.toPlainText() and "```" not in doc.toPlainText()
    bold = doc.find("this")
    assert bold.charFormat().fontWeight() == QFont.Weight.Bold
    assert delegate.document(conversation.index(0)).toPlainText() == "Show **code**"  # what the user typed
    assert delegate.stats_text(conversation.index(1)) == (
        "20 tokens · 31.5 tok/s · first token 0.20 s · 0.9 s · stop reason: end of turn"
    )
    code_line = doc.findBlockByNumber(1)
    assert code_line.text() == "print('hi')" and code_line.blockFormat().background().color() == CODE_BACKGROUND
    index = conversation.index(1)  # the view gives the message the height its text needs
    qtbot.waitUntil(lambda: window.chat.view.visualRect(index).height() >= delegate.sizeHint(None, index).height())
    window.on_clear_requested()


def test_open_button_leaves_room_for_its_menu_arrow(window):
    from PySide6.QtWidgets import QStyle

    button = window.open_button
    style = button.style()
    needed = (
        button.fontMetrics().horizontalAdvance(button.text())
        + style.pixelMetric(QStyle.PixelMetric.PM_MenuButtonIndicator)
        + 2 * style.pixelMetric(QStyle.PixelMetric.PM_ButtonMargin)
    )
    assert button.menu() is not None and button.width() >= needed


def test_stop_mid_generation(qtbot, window):
    wait_loaded(qtbot, window)
    window.on_clear_requested()
    window.send_message("Count from one to one hundred.", max_tokens=300, ignore_eos=True)
    qtbot.waitUntil(lambda: len(window.conversation.messages()[-1]["content"]) > 5, timeout=GEN_TIMEOUT_MS)
    qtbot.mouseClick(window.chat.stop_button, qtbot_button())
    qtbot.waitUntil(lambda: not window.generating, timeout=10_000)
    assert window.dashboard.values["finish"].text() == "cancelled"
    assert window.conversation.messages()[-1]["stats"]["finish_reason"] == "cancelled"
    generated = int(window.dashboard.values["tokens"].text().split("/")[1])
    assert 0 < generated < 300
    assert window.chat.send_button.isEnabled()


def test_edit_regenerate_save_and_open(qtbot, window, tmp_path):
    wait_loaded(qtbot, window)
    window.chat.max_tokens.setValue(4)
    window.on_edit_last_requested()
    assert window.chat.input.toPlainText() == "Count from one to one hundred."
    assert window.conversation.rowCount() == 0
    window.chat.input.setPlainText("Say hi.")
    qtbot.mouseClick(window.chat.send_button, qtbot_button())
    qtbot.waitUntil(lambda: not window.generating, timeout=GEN_TIMEOUT_MS)
    first = window.conversation.messages()
    assert first[0] == {"role": "user", "content": "Say hi."} and first[1]["role"] == "assistant"
    window.on_regenerate_requested()
    qtbot.waitUntil(lambda: not window.generating, timeout=GEN_TIMEOUT_MS)
    assert [m["role"] for m in window.conversation.messages()] == ["user", "assistant"]
    qtbot.mouseClick(window.chat.copy_button, qtbot_button())
    from PySide6.QtWidgets import QApplication

    assert QApplication.clipboard().text().startswith("User: Say hi.\n\nAssistant: ")
    window.chat.system_prompt.setPlainText("Be brief.")
    path = tmp_path / "chat.json"
    window.save_conversation(path)
    saved = json.loads(path.read_text())
    assert saved["messages"] == window.conversation.messages() and saved["system_prompt"] == "Be brief."
    window.on_clear_requested()
    window.chat.system_prompt.clear()
    assert window.open_conversation(path)
    assert window.conversation.messages() == saved["messages"]
    assert window.chat.system_prompt.toPlainText() == "Be brief."
    window.chat.system_prompt.clear()
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert not window.open_conversation(tmp_path / "bad.json")
    assert window.banner.isVisible()


def test_corrupt_file_shows_reason_and_app_stays_usable(qtbot, window, tmp_path):
    wait_loaded(qtbot, window)
    before = window.model
    corrupt = tmp_path / "x.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    window.open_model(str(corrupt))
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert window.banner.isVisible()
    assert "x.gguf" in window.banner_label.text() and "corrupt" in window.banner_label.text()
    assert not window.fallback_button.isVisible()
    window.open_model(str(tmp_path))  # a folder: perfx_core.load reports the unsupported format
    qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
    assert f"Could not load {tmp_path.name}" in window.banner_label.text()  # the reason follows (format varies)
    assert window.model is before
    window.on_clear_requested()
    chat(qtbot, window, "Hello", max_tokens=3)
    assert window.conversation.messages()[-1]["content"]


def test_cancel_load_keeps_the_current_model(qtbot, window):
    wait_loaded(qtbot, window)
    before = window.model
    window.request_load()
    assert window.loading and window.cancel_load_button.isVisibleTo(window)
    qtbot.mouseClick(window.cancel_load_button, qtbot_button())
    assert not window.loading and window.model is before and window.chat.send_button.isEnabled()
    # the abandoned load runs to its end in the background; its model is closed, not used
    qtbot.waitUntil(lambda: not window._jobs, timeout=LOAD_TIMEOUT_MS)
    assert window.model is before


def test_switch_backend_and_fall_back_from_out_of_memory(qtbot, window):
    wait_loaded(qtbot, window)
    window.model_combo.setCurrentIndex(window.model_combo.findData(str(window.model.path)))
    register_plugin(TestBackendsPlugin, name="gui-test-backends")
    try:
        window.backends.refresh()
        twin = window.backends.row_of("numpy-twin")
        assert twin >= 0
        window.backend_combo.setCurrentIndex(twin)
        window.backend_combo.activated.emit(twin)  # as when the user picks it
        wait_loaded(qtbot, window, "numpy-twin")
        assert window.facts_model.value("Backend") == "numpy-twin"
        window.on_clear_requested()
        chat(qtbot, window, "Hi", max_tokens=3)
        assert window.conversation.messages()[-1]["content"]

        oom = window.backends.row_of("oom-test")
        window.backend_combo.setCurrentIndex(oom)
        window.backend_combo.activated.emit(oom)
        qtbot.waitUntil(lambda: not window.loading, timeout=LOAD_TIMEOUT_MS)
        assert "out of memory" in window.banner_label.text()
        assert window.fallback_button.isVisible()
        qtbot.mouseClick(window.fallback_button, qtbot_button())
        wait_loaded(qtbot, window, "numpy")
        assert window.selected_backend() == ("numpy", 0)
    finally:
        unregister_plugin("gui-test-backends")
        window.backends.refresh()


def test_unavailable_backend_is_listed_disabled_with_reason(qtbot, window):
    from perfx_core.errors import BackendUnavailableError

    class Missing(NumpyBackend):
        name = "missing-gpu"

        def devices(self):
            raise BackendUnavailableError("no GPU driver found; install one")

    class Plugin:
        @staticmethod
        @hookimpl
        def perfx_register_backends(register):
            register(Missing())

    register_plugin(Plugin, name="gui-test-missing")
    try:
        window.backends.refresh()
        row = window.backends.row_of("missing-gpu")
        assert row == -1  # never offered as a choice
        choice = next(c for c in window.backends.choices() if c.backend == "missing-gpu")
        assert not choice.available and "no GPU driver" in choice.reason
        index = window.backends.index(window.backends.choices().index(choice))
        assert not window.backends.flags(index)  # disabled in the combo box
        assert "no GPU driver" in window.backends.data(index, Qt.ItemDataRole.ToolTipRole)
    finally:
        unregister_plugin("gui-test-missing")
        window.backends.refresh()


def status(win) -> str:
    return win.statusBar().currentMessage()


def qtbot_button():
    return Qt.MouseButton.LeftButton
