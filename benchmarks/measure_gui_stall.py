"""Measure how long the desktop app's event loop stalls while it loads a model and generates.

A QTimer ticks every 5 ms and records the gap between ticks; the longest gap during a 128-token generation
(end of sequence ignored, so every run does the same work) is the longest time the UI could not respond.
Target: under 50 ms. Prints JSON.

    python benchmarks/measure_gui_stall.py [--tokens 128] [--backend numpy] [--numpy-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gui"))


class StallMeter:
    """Records the gaps between ticks of a fast timer; ``phase`` names the bucket they go to."""

    def __init__(self, interval_ms: int):
        from PySide6.QtCore import QTimer

        self.interval_ms = interval_ms
        self.gaps: dict[str, list[float]] = {}
        self.phase = "idle"
        self._last = time.perf_counter()
        self.timer = QTimer()
        self.timer.setTimerType(self.timer.timerType().PreciseTimer)
        self.timer.timeout.connect(self.on_tick)
        self.timer.start(interval_ms)

    def on_tick(self) -> None:
        now = time.perf_counter()
        self.gaps.setdefault(self.phase, []).append(1e3 * (now - self._last))
        self._last = now

    def summary(self, phase: str) -> dict:
        return self.summary_of((phase,))

    def summary_of(self, phases: tuple[str, ...]) -> dict:
        gaps = [gap for phase in phases for gap in self.gaps.get(phase, [])] or [0.0]
        ordered = sorted(gaps)
        return {
            "ticks": len(gaps),
            "max_gap_ms": round(ordered[-1], 1),
            "p99_gap_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 1),
            "median_gap_ms": round(statistics.median(ordered), 1),
        }


def wait_until(condition, timeout_s: float) -> bool:
    """Run a real event loop until ``condition()`` holds (QEventLoop: app.quit() would close the window)."""
    from PySide6.QtCore import QEventLoop, QTimer

    deadline = time.monotonic() + timeout_s
    loop = QEventLoop()
    poll = QTimer()
    poll.timeout.connect(lambda: (condition() or time.monotonic() > deadline) and loop.quit())
    poll.start(20)
    loop.exec()
    poll.stop()
    return condition()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--interval-ms", type=int, default=5)
    parser.add_argument(
        "--numpy-only", action="store_true", help="load no plugins from entry points (PERFX_LOAD_PLUGINS='')"
    )
    parser.add_argument("--no-profile", action="store_true", help="generate without the per-op profiler")
    args = parser.parse_args()
    if args.numpy_only:
        os.environ["PERFX_LOAD_PLUGINS"] = ""

    from perfx_gui.main_window import MainWindow
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])  # noqa: F841 (must stay referenced while the window lives)
    window = MainWindow(model_path=args.model, backend=args.backend, device=args.device, context_length=512)
    window.show()
    meter = StallMeter(args.interval_ms)
    meter.phase = "load"
    load_start = time.perf_counter()
    window.load_initial_model()
    if not wait_until(lambda: window.model is not None and not window.loading, 600):
        print(
            json.dumps(
                {
                    "error": window.banner_label.text() or "load timed out",
                    "phase": window.phase_label.text(),
                    "loading": window.loading,
                }
            )
        )
        return 1
    load_s = time.perf_counter() - load_start
    window.chat.profile.setChecked(not args.no_profile)
    meter.phase = "prefill"  # until the first token shows, then "decode"

    def on_reply_grew(*_):
        if meter.phase == "prefill":
            meter.phase = "decode"

    window.conversation.dataChanged.connect(on_reply_grew)
    gen_start = time.perf_counter()
    window.send_message("Write a short story about a lighthouse keeper.", max_tokens=args.tokens, ignore_eos=True)
    wait_until(lambda: not window.generating, 900)
    gen_s = time.perf_counter() - gen_start
    meter.phase = "done"
    values = window.dashboard.values
    report = {
        "backend": window.model.backend,
        "ops": sorted(set(window.model.runtime.ops.sources.values()))[:3],
        "tokens": args.tokens,
        "generated_tokens": int(values["tokens"].text().split("/")[1]),
        "profile": not args.no_profile,
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "decode": values["decode"].text(),
        "time_to_first_token": values["ttft"].text(),
        "interval_ms": args.interval_ms,
        "stall_during_load": meter.summary("load"),
        "stall_during_generation": meter.summary_of(("prefill", "decode")),
        "stall_during_prefill": meter.summary("prefill"),
        "stall_during_decode": meter.summary("decode"),
        "cpu_load_average": os.getloadavg(),
    }
    window.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
