"""Screenshots of the desktop app's main views, taken from the real app rendering offscreen.

Writes docs/screenshots/{chat,dashboard,benchmark,backend_picker,model}.png. Needs PySide6 and the bundled
model; takes a minute or two on a CPU.

    python benchmarks/screenshots.py [--plugins opencl] [--compare opencl]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gui"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_gui_stall import wait_until  # noqa: E402  (a real event loop until a condition holds)


def save(widget_pixmap, path: Path) -> None:
    widget_pixmap.save(str(path), "PNG", 0)  # 0: smallest file (PNG quality is its compression level)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"{shown}: {path.stat().st_size // 1024} KiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--plugins", default=None, help="PERFX_LOAD_PLUGINS for the run (default: all installed)")
    parser.add_argument("--compare", default=None, help="second backend for the benchmark view")
    args = parser.parse_args()
    if args.plugins is not None:
        os.environ["PERFX_LOAD_PLUGINS"] = args.plugins
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from perfx_gui.main_window import MainWindow
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QPainter
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    window = MainWindow(context_length=512)  # at its default size, as a user first sees it
    window.show()
    window.load_initial_model()
    if not wait_until(lambda: window.model is not None and not window.loading, 600):
        print("load failed:", window.banner_label.text())
        return 1

    window.chat.system_prompt.setPlainText("You are a concise assistant.")
    window.chat.profile.setChecked(True)  # the dashboard's op table
    window.send_message("What is the capital of France? Answer in one sentence.", max_tokens=40, temperature=0.2)
    wait_until(lambda: not window.generating, 600)
    wait_until(lambda: False, 2)  # idle time between two replies, as in a real session
    window.send_message("How do I reverse a list in Python? Give a short code example.", max_tokens=160, temperature=0)
    wait_until(lambda: not window.generating, 600)
    window.tabs.setCurrentWidget(window.chat)
    save(window.grab(), out / "chat.png")

    window.tabs.setCurrentWidget(window.dashboard)
    app.processEvents()
    save(window.grab(), out / "dashboard.png")

    window.tabs.setCurrentWidget(window.facts_view)
    app.processEvents()
    save(window.grab(), out / "model.png")

    bench = window.bench
    bench.prompt_tokens.setValue(32)
    bench.gen_tokens.setValue(8)
    bench.repeat.setValue(1)
    targets = [window.selected_backend()]
    if args.compare:
        row = window.backends.row_of(args.compare)
        if row >= 0:
            bench.compare.setChecked(True)
            bench.backend_b.setCurrentIndex(row)
            choice = window.backends.choice(row)
            targets.append((choice.backend, choice.device))
    settings = {"prompt_tokens": 32, "gen_tokens": 8, "repeat": 1, "profile": False}
    window.on_bench_run_requested(targets, settings)
    wait_until(lambda: window._bench_worker is None, 600)
    window.tabs.setCurrentWidget(bench)
    app.processEvents()
    save(window.grab(), out / "benchmark.png")

    window.tabs.setCurrentWidget(window.chat)
    combo = window.backend_combo
    combo.showPopup()
    wait_until(lambda: False, 0.3)
    shot = window.grab()
    popup = combo.view().window()
    painter = QPainter(shot)
    # Offscreen windows have no real screen position: put the list where it drops down, under the box.
    painter.drawPixmap(combo.mapTo(window, QPoint(0, combo.height())), popup.grab())
    painter.end()
    combo.hidePopup()
    save(shot, out / "backend_picker.png")
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
