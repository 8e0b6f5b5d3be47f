"""The Dashboard tab: speed and memory charts over the session, time to first token, per-op profile."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from .charts import LineChart
from .facts import format_bytes
from .models import OpProfileModel

STAT_LABELS = (
    ("ttft", "Time to first token"),
    ("prefill", "Prefill"),
    ("decode", "Decode"),
    ("tokens", "Tokens (prompt / generated)"),
    ("host", "Host memory (RSS)"),
    ("device", "Device memory (peak)"),
    ("finish", "Finish"),
)


PROFILE_OFF = (
    "Per-op decode profile: off. Turn on “Profile ops” in the Chat tab's settings to time each op "
    "(decoding runs slower while it is on)."
)


class DashboardTab(QWidget):
    def __init__(self, op_profile: OpProfileModel, parent=None):
        super().__init__(parent)
        self.values: dict[str, QLabel] = {}
        grid = QGridLayout()
        for i, (key, text) in enumerate(STAT_LABELS):
            title = QLabel(text)
            title.setStyleSheet("color: #5f6368")
            value = QLabel("—")
            value.setObjectName(f"stat_{key}")
            value.setStyleSheet("font-size: 15px; font-weight: 600")
            grid.addWidget(title, 0, i)
            grid.addWidget(value, 1, i)
            self.values[key] = value
        self.speed_chart = LineChart("Throughput", "tokens/s")
        self.speed_chart.add_series("decode")
        self.speed_chart.add_series("prefill", markers=True)
        self.memory_chart = LineChart("Memory", "MiB")
        self.memory_chart.add_series("host RSS")
        self.memory_chart.add_series("device")
        charts = QHBoxLayout()
        charts.addWidget(self.speed_chart)
        charts.addWidget(self.memory_chart)
        self.op_table = QTableView()
        self.op_table.setModel(op_profile)
        self.op_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.op_table.verticalHeader().hide()
        self.op_table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        # The table is as tall as its rows (the charts give way), so no op hides below a scroll bar.
        self.op_table.setSizeAdjustPolicy(QAbstractScrollArea.SizeAdjustPolicy.AdjustToContents)
        self.bandwidth = QLabel(PROFILE_OFF)
        self.bandwidth.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(grid)
        layout.addLayout(charts, 1)
        layout.addWidget(self.bandwidth)
        layout.addWidget(self.op_table)

    def show_stats(self, stats: dict) -> None:
        v = self.values
        v["ttft"].setText(f"{1e3 * stats['time_to_first_token_s']:.0f} ms" if stats["time_to_first_token_s"] else "—")
        v["prefill"].setText(f"{stats['prefill_tokens_per_s']:.1f} tok/s" if stats["prefill_tokens_per_s"] else "—")
        v["decode"].setText(f"{stats['decode_tokens_per_s']:.2f} tok/s" if stats["decode_tokens_per_s"] else "—")
        v["tokens"].setText(f"{stats['prompt_tokens']} / {stats['generated_tokens']}")
        v["device"].setText(f"{format_bytes(stats['device_bytes'])} ({format_bytes(stats['device_peak_bytes'])})")
        v["finish"].setText(stats.get("finish_reason") or "running…")

    def show_bandwidth(self, bandwidth: str, profiling: bool) -> None:
        """The line above the op table: whether ops are profiled, and the peak bandwidth "Of peak BW" uses."""
        if profiling:
            text = f"Per-op decode profile (decoding runs slower while it is on). Peak bandwidth: {bandwidth}"
        else:
            text = f"{PROFILE_OFF} Peak bandwidth: {bandwidth}"
        self.bandwidth.setText(text)

    def show_host_memory(self, rss: int) -> None:
        self.values["host"].setText(format_bytes(rss))
