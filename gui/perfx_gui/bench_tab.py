"""The Benchmark tab: run_bench settings, one or two backends, a results table and a bar chart."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSpinBox,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from .charts import BarChart
from .models import BackendChoice, BackendDeviceModel, BenchResultsModel


class BenchTab(QWidget):
    run_requested = Signal(list, dict)  # ([(backend, device)], run_bench settings)
    cancel_requested = Signal()

    def __init__(self, backends: BackendDeviceModel, results: BenchResultsModel, parent=None):
        super().__init__(parent)
        self.backends, self.results = backends, results
        self.prompt_tokens = QSpinBox(minimum=1, maximum=4096, value=64)
        self.gen_tokens = QSpinBox(minimum=1, maximum=4096, value=16)
        self.repeat = QSpinBox(minimum=1, maximum=20, value=2)
        self.profile = QCheckBox("Per-op profile")
        self.backend_a = QComboBox()
        self.backend_a.setModel(backends)
        self.compare = QCheckBox("Compare with")
        self.backend_b = QComboBox()
        self.backend_b.setModel(backends)
        self.backend_b.setEnabled(False)
        self.compare.toggled.connect(self.backend_b.setEnabled)
        self.run_button = QPushButton("Run benchmark")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.status = QLabel("Benchmarks load their own copy of the model (seeded random prompt, greedy decode).")
        self.status.setWordWrap(True)
        self.run_button.clicked.connect(self._run)
        self.cancel_button.clicked.connect(self.cancel_requested)

        settings = QGroupBox("Settings")
        settings_layout = QVBoxLayout(settings)
        form = QFormLayout()
        settings_layout.addLayout(form)
        settings_layout.addStretch(1)
        form.addRow("Prompt tokens", self.prompt_tokens)
        form.addRow("Generated tokens", self.gen_tokens)
        form.addRow("Repeat", self.repeat)
        form.addRow(self.profile)
        form.addRow("Backend", self.backend_a)
        form.addRow(self.compare, self.backend_b)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        form.addRow(buttons)
        form.addRow(self.status)

        self.table = QTableView()
        self.table.setModel(results)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.chart = BarChart("Speed by backend (tokens/s)")
        right = QVBoxLayout()
        right.addWidget(self.chart, 1)
        right.addWidget(self.table, 1)
        layout = QHBoxLayout(self)
        layout.addWidget(settings, 1)
        layout.addLayout(right, 2)
        results.modelReset.connect(self._update_chart)
        results.columnsInserted.connect(self._update_chart)

    def select(self, row: int) -> None:
        if row >= 0:
            self.backend_a.setCurrentIndex(row)

    def _choice(self, combo: QComboBox) -> BackendChoice | None:
        choice = self.backends.choice(combo.currentIndex())
        return choice if choice is not None and choice.available else None

    def _run(self) -> None:
        targets = [self._choice(self.backend_a)]
        if self.compare.isChecked():
            targets.append(self._choice(self.backend_b))
        if any(t is None for t in targets):
            self.status.setText("Pick an available backend.")
            return
        settings = {
            "prompt_tokens": self.prompt_tokens.value(),
            "gen_tokens": self.gen_tokens.value(),
            "repeat": self.repeat.value(),
            "profile": self.profile.isChecked(),
        }
        self.run_requested.emit([(t.backend, t.device) for t in targets if t], settings)

    def set_running(self, running: bool) -> None:
        self.run_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)

    def _update_chart(self, *_) -> None:
        groups: list[tuple[str, dict[str, float]]] = []
        for key, title in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
            values = {}
            for i, r in enumerate(self.results.reports()):
                if r.get(key) is not None:
                    values[f"{r['backend']}#{i + 1}" if _duplicate(self.results.reports(), r) else r["backend"]] = r[
                        key
                    ]
            groups.append((title, values))
        self.chart.set_groups(groups)


def _duplicate(reports: list[dict], report: dict) -> bool:
    return sum(r["backend"] == report["backend"] for r in reports) > 1
