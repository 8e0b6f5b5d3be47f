"""The main window: model and backend pickers, loading with progress, and the Chat, Dashboard, Benchmark
and Model tabs. Long work runs in workers (see workers.py); this class only reacts to their signals."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
from PySide6.QtCore import QThread, QTimer
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QTableView,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from perfx_core import settings as user_settings
from perfx_core.errors import PerfxError

from .bench_tab import BenchTab
from .chat_tab import ChatTab
from .dashboard_tab import DashboardTab
from .facts import ModelFacts, op_rows
from .models import (
    BackendDeviceModel,
    BenchResultsModel,
    ConversationModel,
    FactsModel,
    OpProfileModel,
    format_message_stats,
    message_stats,
)
from .workers import BenchWorker, GenerationWorker, LoadWorker, Worker, thread_for

CONVERSATION_FORMAT = "perfx-conversation"
MEMORY_SAMPLE_MS = 500
LIVE_STATS_MS = 200  # how often the streaming reply's elapsed time and speed are redrawn
CHART_WINDOW_S = 300.0  # both charts show the same, latest five minutes of the session


class MainWindow(QMainWindow):
    def __init__(
        self,
        model_path: str | None = None,
        backend: str = "numpy",
        device: Any = None,
        context_length: int = 2048,
        warm_up: bool = True,
    ):
        super().__init__()
        self.setWindowTitle("perfx")
        self.resize(1200, 720)
        self.context_length, self.warm_up = context_length, warm_up
        self.model: Any = None  # the loaded perfx_core Model
        self.facts: ModelFacts | None = None
        self.session_start = time.monotonic()
        self._jobs: list[tuple[QThread, Worker]] = []
        self._load_worker: LoadWorker | None = None
        self._load_target: tuple[str | None, str, Any] | None = None
        self._load_started = 0.0
        self._gen_worker: GenerationWorker | None = None
        self._bench_worker: BenchWorker | None = None
        self._retired: list[Any] = []  # models replaced while a generation still used them
        self._device_bytes = 0
        self._process = psutil.Process()
        self._gen_started = 0.0  # time.monotonic() when the current reply was asked for
        self._gen_stats: dict | None = None  # the current reply's latest stats snapshot
        self._prefill_plotted = False

        self.conversation = ConversationModel(self)
        self.backends = BackendDeviceModel(self)
        self.backends.refresh()
        self.facts_model = FactsModel(self)
        self.op_profile = OpProfileModel(self)
        self.bench_results = BenchResultsModel(self)
        self._build_top_bar(model_path, backend, device)
        self._build_banner()
        self.chat = ChatTab(self.conversation)
        self.dashboard = DashboardTab(self.op_profile)
        self.bench = BenchTab(self.backends, self.bench_results)
        self.bench.select(self.backend_combo.currentIndex())
        facts_view = QTableView()
        facts_view.setModel(self.facts_model)
        facts_view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        facts_view.horizontalHeader().setStretchLastSection(True)
        facts_view.verticalHeader().hide()
        self.facts_view = facts_view
        self.tabs = QTabWidget()
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.dashboard, "Dashboard")
        self.tabs.addTab(self.bench, "Benchmark")
        self.tabs.addTab(facts_view, "Model")

        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addLayout(self.top_bar)
        layout.addWidget(self.banner)
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self.statusBar().showMessage("No model loaded")

        self._connect_tabs()
        self.memory_timer = QTimer(self)
        self.memory_timer.timeout.connect(self.on_memory_tick)
        self.memory_timer.start(MEMORY_SAMPLE_MS)
        self.live_timer = QTimer(self)
        self.live_timer.timeout.connect(self.on_live_tick)
        self._update_state()

    # -- construction --------------------------------------------------------------------------------
    def _build_top_bar(self, model_path: str | None, backend: str, device: Any) -> None:
        self.model_combo = QComboBox()
        self.model_combo.setMinimumWidth(260)
        self._fill_model_combo(model_path)
        self.model_combo.activated.connect(self.on_model_chosen)
        # A QPushButton with a menu makes room for its arrow; a QToolButton's instant popup draws it over the label.
        self.open_button = QPushButton("Open…")
        menu = QMenu(self.open_button)
        menu.addAction("GGUF file…", self.on_open_file)
        menu.addAction("Model folder…", self.on_open_folder)
        self.open_button.setMenu(menu)
        self.backend_combo = QComboBox()
        self.backend_combo.setModel(self.backends)
        self.backend_combo.setMinimumWidth(280)
        row = self.backends.row_of(backend, device)
        self.backend_combo.setCurrentIndex(row if row >= 0 else self.backends.row_of("numpy"))
        self._requested_device = device
        self.backend_combo.activated.connect(self.on_backend_chosen)
        self.load_button = QPushButton("Load")
        self.load_button.clicked.connect(lambda: self.request_load())
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # indeterminate: perfx_core.load reports no fractions, only our phases
        self.progress.setMaximumWidth(120)
        self.progress.hide()
        self.phase_label = QLabel("")
        # Ignored: a long phase text is cut rather than widening the window, which would not shrink back.
        self.phase_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.cancel_load_button = QPushButton("Cancel")
        self.cancel_load_button.clicked.connect(self.on_cancel_load)
        self.cancel_load_button.hide()
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Model"))
        bar.addWidget(self.model_combo, 2)
        bar.addWidget(self.open_button)
        bar.addWidget(QLabel("Backend"))
        bar.addWidget(self.backend_combo, 2)
        bar.addWidget(self.load_button)
        bar.addWidget(self.progress)
        bar.addWidget(self.phase_label, 1)
        bar.addWidget(self.cancel_load_button)
        self.top_bar = bar

    def _build_banner(self) -> None:
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        self.banner.setStyleSheet("#banner { background: #fce8e6; border: 1px solid #d93025; border-radius: 4px; }")
        self.banner_label = QLabel()
        self.banner_label.setWordWrap(True)
        self.fallback_button = QPushButton("Load on NumPy (CPU) instead")
        self.fallback_button.clicked.connect(self.on_fallback_clicked)
        dismiss = QPushButton("Dismiss")
        dismiss.clicked.connect(self.banner.hide)
        layout = QHBoxLayout(self.banner)
        layout.addWidget(self.banner_label, 1)
        layout.addWidget(self.fallback_button)
        layout.addWidget(dismiss)
        self.banner.hide()

    def _fill_model_combo(self, first: str | None) -> None:
        from perfx_core.default_model import bundled_model_path

        paths: list[tuple[str, str]] = []
        if first:
            paths.append((str(Path(first).expanduser()), Path(first).name))
        try:
            bundled = str(bundled_model_path())
            paths.append((bundled, f"{Path(bundled).name} (bundled default)"))
        except PerfxError:
            pass
        for recent in user_settings.recent_models():
            paths.append((recent, Path(recent).name))
        seen: set[str] = set()
        for path, label in paths:
            if path not in seen:
                seen.add(path)
                self.model_combo.addItem(label, path)
                self.model_combo.setItemData(self.model_combo.count() - 1, path, 3)  # ToolTipRole: full path

    def _connect_tabs(self) -> None:
        c = self.chat
        c.send_requested.connect(self.on_send_requested)
        c.stop_requested.connect(self.on_stop_requested)
        c.regenerate_requested.connect(self.on_regenerate_requested)
        c.edit_last_requested.connect(self.on_edit_last_requested)
        c.copy_requested.connect(self.on_copy_requested)
        c.clear_requested.connect(self.on_clear_requested)
        c.save_requested.connect(self.on_save_requested)
        c.open_requested.connect(self.on_open_requested)
        c.profile.toggled.connect(self.on_profile_toggled)
        self.bench.run_requested.connect(self.on_bench_run_requested)
        self.bench.cancel_requested.connect(self.on_bench_cancel_requested)

    # -- jobs ----------------------------------------------------------------------------------------
    def _start(self, worker: Worker) -> None:
        thread = thread_for(worker)
        thread.finished.connect(self._reap_job)  # queued to this thread: the window lives here
        self._jobs.append((thread, worker))
        thread.start()

    def _reap_job(self) -> None:
        thread = self.sender()
        if not isinstance(thread, QThread):
            return  # the window has closed and dropped its jobs
        # QThread.finished is emitted just before the thread ends (isFinished() may still be False):
        # wait out that last instant, so the QThread is not dropped while its thread still runs.
        thread.wait()
        self._jobs = [(t, w) for t, w in self._jobs if t is not thread]

    @property
    def loading(self) -> bool:
        return self._load_worker is not None

    @property
    def generating(self) -> bool:
        return self._gen_worker is not None

    def _update_state(self) -> None:
        self.chat.set_state(model_ready=self.model is not None and not self.loading, generating=self.generating)
        self.progress.setVisible(self.loading)
        self.cancel_load_button.setVisible(self.loading)
        self.load_button.setEnabled(not self.loading)

    # -- loading -------------------------------------------------------------------------------------
    def load_initial_model(self) -> None:
        self.request_load()

    def selected_backend(self) -> tuple[str, Any]:
        choice = self.backends.choice(self.backend_combo.currentIndex())
        if choice is None or not choice.available:
            return "numpy", None
        return choice.backend, choice.device

    def request_load(self, path: str | None = None, backend: str | None = None, device: Any = None) -> None:
        """Load ``path`` (default: the selected model) on ``backend`` (default: the selected one), in a worker."""
        if self._load_worker is not None:
            self._load_worker.cancel()  # the old load finishes in the background and is discarded
        if path is None:
            path = self.model_combo.currentData()
        if backend is None:
            backend, device = self.selected_backend()
        self.banner.hide()
        worker = LoadWorker(path, backend, device, self.context_length, warm_up=self.warm_up)
        worker.phase_changed.connect(self.on_phase_changed)
        worker.model_loaded.connect(self.on_model_loaded)
        worker.load_failed.connect(self.on_load_failed)
        worker.load_cancelled.connect(self.on_load_cancelled)
        self._load_worker, self._load_target, self._load_started = worker, (path, backend, device), time.monotonic()
        self._start(worker)
        self._update_state()

    def on_phase_changed(self, worker: LoadWorker, phase: str) -> None:
        if worker is self._load_worker:
            self.phase_label.setText(f"{phase}…")

    def on_model_loaded(self, worker: LoadWorker, model: Any, facts: ModelFacts) -> None:
        if worker is not self._load_worker:
            model.close()  # a load that was cancelled or superseded
            return
        self._load_worker = None
        self._retire(self.model)
        self.model, self.facts = model, facts
        self._device_bytes = model.runtime.allocated_bytes
        self.facts_model.set_rows(facts.rows())
        try:
            user_settings.remember_model(model.path)
        except OSError:
            pass  # an unwritable config dir must not break loading
        self._select_model_path(str(model.path))
        elapsed = time.monotonic() - self._load_started
        self.phase_label.setText("")
        self.statusBar().showMessage(
            f"Loaded {Path(facts.path).name} on {facts.backend} ({facts.device}) in {elapsed:.1f} s"
        )
        self.dashboard.show_bandwidth(facts.bandwidth_text(), self.chat.profile.isChecked())
        self._update_state()

    def on_load_failed(self, worker: LoadWorker, reason: str, out_of_memory: bool) -> None:
        if worker is not self._load_worker:
            return
        path, backend, _ = self._load_target or (None, "?", None)
        self._load_worker = None
        self.phase_label.setText("")
        name = Path(path).name if path else "the default model"
        text = f"Could not load {name} on {backend}: {reason}"
        if self.model is not None:
            text += f"\nStill using {Path(self.model.path).name} on {self.model.backend}."
        self.fallback_button.setVisible(out_of_memory and backend != "numpy")
        if out_of_memory and backend != "numpy":
            text += "\nThe device ran out of memory: you can load the model on NumPy (CPU) instead."
        self.banner_label.setText(text)
        self.banner.show()
        self.statusBar().showMessage("Load failed")
        self._update_state()

    def on_load_cancelled(self, worker: LoadWorker) -> None:
        if worker is self._load_worker:
            self._load_worker = None
            self._update_state()

    def on_cancel_load(self) -> None:
        if self._load_worker is not None:
            self._load_worker.cancel()
            self._load_worker = None  # its result, if any, is discarded
            self.phase_label.setText("")
            self.statusBar().showMessage("Loading cancelled")
            self._update_state()

    def on_fallback_clicked(self) -> None:
        path = self._load_target[0] if self._load_target else None
        row = self.backends.row_of("numpy")
        if row >= 0:
            self.backend_combo.setCurrentIndex(row)
        self.request_load(path, "numpy", None)
        self.statusBar().showMessage("The device ran out of memory: falling back to NumPy on the CPU")

    def on_backend_chosen(self, row: int) -> None:
        choice = self.backends.choice(row)
        if choice is None or not choice.available:
            return
        if self.generating:
            self.on_stop_requested()
        self.request_load()

    def on_model_chosen(self, _row: int) -> None:
        self.request_load()

    def on_open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_model(path)

    def on_open_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open model folder")
        if path:
            self.open_model(path)

    def open_model(self, path: str) -> None:
        """Load a model file or folder (perfx_core.load says when the format is not supported)."""
        self._select_model_path(path)
        self.request_load(path)

    def _select_model_path(self, path: str) -> None:
        index = self.model_combo.findData(path)
        if index < 0:
            self.model_combo.insertItem(0, Path(path).name, path)
            index = 0
        self.model_combo.setCurrentIndex(index)

    def _retire(self, old: Any) -> None:
        if old is None:
            return
        if self._gen_worker is not None and self._gen_worker.model is old:
            self._retired.append(old)  # closed when its generation ends
        else:
            old.close()

    # -- chat ----------------------------------------------------------------------------------------
    def on_send_requested(self, text: str) -> None:
        self.send_message(text)

    def send_message(self, text: str, **overrides: Any) -> None:
        if self.model is None or self.generating:
            return
        self.conversation.append("user", text)
        self.chat.input.clear()
        self._start_generation(**overrides)

    def _start_generation(self, **overrides: Any) -> None:
        messages = self.conversation.chat_messages()
        system = self.chat.system_prompt.toPlainText().strip()
        if system:
            messages.insert(0, {"role": "system", "content": system})
        self.conversation.append("assistant", "")
        sampling = {**self.chat.sampling(), **overrides}
        worker = GenerationWorker(self.model, messages, sampling, profile=self.chat.profile.isChecked())
        worker.token_generated.connect(self.on_token_generated)
        worker.stats_updated.connect(self.on_stats_updated)
        worker.generation_finished.connect(self.on_generation_finished)
        worker.generation_failed.connect(self.on_generation_failed)
        self._gen_worker = worker
        self._gen_started, self._gen_stats, self._prefill_plotted = time.monotonic(), None, False
        for name in ("decode", "prefill"):  # this reply's line and legend start afresh
            self.dashboard.speed_chart.break_series(name)
        if self.facts is not None:
            self.dashboard.show_bandwidth(self.facts.bandwidth_text(), worker.profile)
        self._start(worker)
        self.live_timer.start(LIVE_STATS_MS)
        self.on_live_tick()
        self._update_state()

    def on_live_tick(self) -> None:
        """Redraw the streaming reply's stats (elapsed time runs on between the worker's snapshots)."""
        if self._gen_worker is None:
            return
        elapsed = time.monotonic() - self._gen_started
        if self._gen_stats is None:
            self.statusBar().showMessage(f"Generating… {elapsed:.1f} s (reading the prompt)")
            return
        stats = message_stats(self._gen_stats, elapsed)
        self.conversation.set_last_stats(stats)
        self.statusBar().showMessage(f"Generating… {format_message_stats(stats)}")

    def on_token_generated(self, worker: GenerationWorker, text: str) -> None:
        if worker is self._gen_worker:
            self.conversation.append_to_last(text)

    def on_stats_updated(self, worker: GenerationWorker, stats: dict) -> None:
        if worker is not self._gen_worker:
            return
        self._gen_stats = stats
        self.dashboard.show_stats(stats)
        now = time.monotonic() - self.session_start
        chart = self.dashboard.speed_chart
        if stats["prefill_tokens_per_s"] and not self._prefill_plotted:
            # at the moment prefill ended: where this reply's decode line begins
            prefilled = self._gen_started - self.session_start + (stats["time_to_first_token_s"] or 0.0)
            chart.add_point("prefill", min(prefilled, now), stats["prefill_tokens_per_s"])
            self._prefill_plotted = True
        if stats["decode_tokens_per_s"]:
            chart.add_point("decode", now, stats["decode_tokens_per_s"])
        self._device_bytes = stats["device_bytes"]
        if stats["op_profile"] and self.facts is not None:
            rows = op_rows(
                stats["op_profile"], stats["decode_steps"], self.facts.op_weight_bytes, self.facts.bandwidth_gbs
            )
            self.op_profile.set_rows(rows)

    def on_generation_finished(self, worker: GenerationWorker, stats: dict) -> None:
        if worker is not self._gen_worker:
            return
        self.on_stats_updated(worker, stats)
        if stats["generated_tokens"]:
            self.conversation.set_last_stats(message_stats(stats, time.monotonic() - self._gen_started))
        self._update_time_range()
        self._end_generation()
        self.statusBar().showMessage(
            f"{stats['generated_tokens']} tokens, {stats['decode_tokens_per_s']:.2f} tok/s decode, "
            f"first token after {stats['time_to_first_token_s']:.2f} s ({stats['finish_reason']})"
        )

    def on_generation_failed(self, worker: GenerationWorker, reason: str) -> None:
        if worker is not self._gen_worker:
            return
        if self._gen_stats is not None:  # what streamed before the failure keeps its stats, marked as failed
            failed = {**self._gen_stats, "finish_reason": "error"}
            self.conversation.set_last_stats(message_stats(failed, time.monotonic() - self._gen_started))
        self._end_generation()
        self.banner_label.setText(f"Generation failed: {reason}")
        self.fallback_button.hide()
        self.banner.show()

    def _end_generation(self) -> None:
        self._gen_worker = None
        self.live_timer.stop()
        last = self.conversation.rowCount() - 1
        if last >= 0 and self.conversation.chat_messages()[last] == {"role": "assistant", "content": ""}:
            self.conversation.truncate(last)  # nothing was generated: do not keep an empty reply
        for old in self._retired:
            old.close()
        self._retired.clear()
        self._update_state()

    def on_stop_requested(self) -> None:
        if self._gen_worker is not None:
            self._gen_worker.cancel()
            self.statusBar().showMessage("Stopping…")

    def on_regenerate_requested(self) -> None:
        last_user = self.conversation.last_index_of("user")
        if last_user < 0 or self.model is None or self.generating:
            return
        self.conversation.truncate(last_user + 1)
        self._start_generation()

    def on_edit_last_requested(self) -> None:
        last_user = self.conversation.last_index_of("user")
        if last_user < 0 or self.generating:
            return
        self.chat.input.setPlainText(self.conversation.messages()[last_user]["content"])
        self.conversation.truncate(last_user)
        self.chat.input.setFocus()
        self._update_state()

    def on_copy_requested(self) -> None:
        selected = self.chat.view.selectionModel().selectedIndexes()
        if selected:
            text = self.conversation.messages()[selected[0].row()]["content"]
        else:
            text = self.conversation.as_text()
        QApplication.clipboard().setText(text)
        self.statusBar().showMessage("Copied", 2000)

    def on_clear_requested(self) -> None:
        self.conversation.set_messages([])
        self._update_state()

    def on_save_requested(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save conversation", "conversation.json", "JSON (*.json)")
        if path:
            self.save_conversation(path)

    def on_open_requested(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open conversation", "", "JSON (*.json);;All files (*)")
        if path:
            self.open_conversation(path)

    def save_conversation(self, path: str | Path) -> None:
        data = {
            "format": CONVERSATION_FORMAT,
            "version": 1,
            "model": str(self.model.path) if self.model is not None else None,
            "system_prompt": self.chat.system_prompt.toPlainText(),
            "sampling": self.chat.sampling(),
            "messages": self.conversation.messages(),
        }
        Path(path).write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
        self.statusBar().showMessage(f"Saved {path}", 3000)

    def open_conversation(self, path: str | Path) -> bool:
        """Load a saved conversation; a file that is not one is reported in the banner, not raised."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            messages = data["messages"]
            if data.get("format") != CONVERSATION_FORMAT or not all(
                isinstance(m, dict)
                and m.get("role") in ("user", "assistant", "system")
                and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise ValueError("not a perfx conversation file")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.banner_label.setText(f"Could not open {path}: {exc}")
            self.fallback_button.hide()
            self.banner.show()
            return False
        self.conversation.set_messages(messages)
        self.chat.system_prompt.setPlainText(str(data.get("system_prompt") or ""))
        self.chat.set_sampling(data.get("sampling") or {})
        self._update_state()
        return True

    # -- dashboard -----------------------------------------------------------------------------------
    def on_profile_toggled(self, on: bool) -> None:
        """Takes effect from the next reply (a running one keeps its setting)."""
        self.dashboard.show_bandwidth(self.facts.bandwidth_text() if self.facts else "n/a", on)

    def on_memory_tick(self) -> None:
        try:
            rss = self._process.memory_info().rss
        except psutil.Error:
            return
        now = time.monotonic() - self.session_start
        self.dashboard.memory_chart.add_point("host RSS", now, rss / 2**20)
        self.dashboard.memory_chart.add_point("device", now, self._device_bytes / 2**20)
        self.dashboard.show_host_memory(rss)
        self._update_time_range()

    def _update_time_range(self) -> None:
        """Give both charts the same time axis: the latest CHART_WINDOW_S seconds of the session."""
        now = time.monotonic() - self.session_start
        start = max(0.0, now - CHART_WINDOW_S)
        for chart in (self.dashboard.speed_chart, self.dashboard.memory_chart):
            chart.set_time_range(start, now)

    # -- benchmark -----------------------------------------------------------------------------------
    def on_bench_run_requested(self, targets: list, settings: dict) -> None:
        if self._bench_worker is not None:
            return
        path = self.model.path if self.model is not None else self.model_combo.currentData()
        worker = BenchWorker(str(path) if path else None, targets, settings)
        worker.bench_progress.connect(self.on_bench_progress)
        worker.bench_result.connect(self.on_bench_result)
        worker.bench_failed.connect(self.on_bench_failed)
        worker.done.connect(self.on_bench_done)
        self._bench_worker = worker
        self.bench_results.set_reports([])
        self.bench.set_running(True)
        self._start(worker)

    def on_bench_progress(self, text: str) -> None:
        self.bench.status.setText(text)

    def on_bench_result(self, report: dict) -> None:
        self.bench_results.add_report(report)

    def on_bench_failed(self, backend: str, reason: str) -> None:
        self.bench.status.setText(f"{backend}: {reason}")

    def on_bench_done(self) -> None:
        failed = self.bench.status.text() if ":" in self.bench.status.text() else ""
        self._bench_worker = None
        self.bench.set_running(False)
        if not failed:
            self.bench.status.setText(f"Done: {len(self.bench_results.reports())} backend(s) measured.")

    def on_bench_cancel_requested(self) -> None:
        if self._bench_worker is not None:
            self._bench_worker.cancel()
            self.bench.status.setText("Cancelling after the current backend…")

    # -- shutdown ------------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self.memory_timer.stop()
        self.live_timer.stop()
        for _thread, worker in self._jobs:
            worker.cancel()
        for thread, _ in self._jobs:
            thread.quit()
            thread.wait()
        self._jobs.clear()
        self._load_worker = self._gen_worker = self._bench_worker = None
        for model in [self.model, *self._retired]:
            if model is not None:
                model.close()
        self.model = None
        self._retired.clear()
        super().closeEvent(event)
