"""Qt item models: the conversation, backends and devices, model facts, the op profile and bench results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractListModel, QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor

from .facts import OpRow, format_bytes

ROLE_COLORS = {"user": "#e8f0fe", "assistant": "#f1f3f4", "system": "#fff8e1"}


class ConversationModel(QAbstractListModel):
    """The chat messages ({'role', 'content'}, and 'stats' on an assistant reply); the last reply grows as tokens
    stream in, and its stats (see ``message_stats``) are updated live."""

    MessageRole = Qt.ItemDataRole.UserRole + 1
    StatsRole = Qt.ItemDataRole.UserRole + 2

    def __init__(self, parent=None):
        super().__init__(parent)
        self._messages: list[dict[str, Any]] = []

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008 (Qt's signature)
        return 0 if parent.isValid() else len(self._messages)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        message = self._messages[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            content = message["content"] or ("…" if message["role"] == "assistant" else "")
            return f"{message['role'].capitalize()}\n{content}"
        if role == Qt.ItemDataRole.BackgroundRole:
            return QBrush(QColor(ROLE_COLORS.get(message["role"], "#ffffff")))
        if role == self.MessageRole:
            return dict(message)
        if role == self.StatsRole:
            return dict(message["stats"]) if "stats" in message else None
        return None

    def messages(self) -> list[dict[str, Any]]:
        """Every message as stored (with its stats), e.g. to save the conversation."""
        return [_copy_message(m) for m in self._messages]

    def chat_messages(self) -> list[dict[str, str]]:
        """{'role', 'content'} only: what the model's chat template is given."""
        return [{"role": m["role"], "content": m["content"]} for m in self._messages]

    def set_messages(self, messages: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self._messages = []
        for m in messages:
            message: dict[str, Any] = {"role": str(m["role"]), "content": str(m["content"])}
            if isinstance(m.get("stats"), dict):
                message["stats"] = dict(m["stats"])
            self._messages.append(message)
        self.endResetModel()

    def append(self, role: str, content: str = "") -> None:
        n = len(self._messages)
        self.beginInsertRows(QModelIndex(), n, n)
        self._messages.append({"role": role, "content": content})
        self.endInsertRows()

    def append_to_last(self, text: str) -> None:
        if not self._messages or not text:
            return
        self._messages[-1]["content"] += text
        index = self.index(len(self._messages) - 1)
        self.dataChanged.emit(index, index, [Qt.ItemDataRole.DisplayRole])

    def set_last_stats(self, stats: dict[str, Any]) -> None:
        """Replace the stats of the last message (the reply being generated, or the one just finished)."""
        if not self._messages:
            return
        self._messages[-1]["stats"] = dict(stats)
        index = self.index(len(self._messages) - 1)
        self.dataChanged.emit(index, index, [self.StatsRole])

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` messages."""
        if n >= len(self._messages):
            return
        self.beginRemoveRows(QModelIndex(), n, len(self._messages) - 1)
        del self._messages[n:]
        self.endRemoveRows()

    def last_index_of(self, role: str) -> int:
        for i in range(len(self._messages) - 1, -1, -1):
            if self._messages[i]["role"] == role:
                return i
        return -1

    def as_text(self) -> str:
        return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in self._messages)


def _copy_message(message: dict[str, Any]) -> dict[str, Any]:
    copy = dict(message)
    if "stats" in copy:
        copy["stats"] = dict(copy["stats"])
    return copy


def message_stats(stats: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """The stats kept with a reply, from a generation worker's snapshot (finish_reason is "" while it runs)."""
    return {
        "tokens": int(stats["generated_tokens"]),
        "tokens_per_s": float(stats["decode_tokens_per_s"] or 0.0),
        "time_to_first_token_s": float(stats["time_to_first_token_s"] or 0.0),
        "elapsed_s": float(elapsed_s),
        "finish_reason": str(stats.get("finish_reason") or ""),
    }


# finish_reason values, and "error" for a reply cut short by a failure
STOP_REASONS = {"stop": "end of turn", "length": "max tokens", "cancelled": "stopped", "error": "error"}


def format_message_stats(stats: dict[str, Any] | None) -> str:
    """One line under a reply: tokens, speed, first-token time and why it stopped (or that it is running)."""
    if not stats:
        return ""
    parts = [f"{stats['tokens']} tokens", f"{stats['tokens_per_s']:.1f} tok/s"]
    if stats.get("time_to_first_token_s"):
        parts.append(f"first token {stats['time_to_first_token_s']:.2f} s")
    parts.append(f"{stats['elapsed_s']:.1f} s")
    reason = stats.get("finish_reason")
    parts.append(f"stop reason: {STOP_REASONS.get(reason, reason)}" if reason else "generating…")
    return " · ".join(parts)


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    device: int | None  # None for a backend that reported no device
    label: str
    available: bool
    reason: str  # why it is unavailable, or the device description


class BackendDeviceModel(QAbstractListModel):
    """Every (backend, device) of the plugin registry; an unavailable backend is a disabled row with its reason."""

    ChoiceRole = Qt.ItemDataRole.UserRole + 1

    def __init__(self, parent=None):
        super().__init__(parent)
        self._choices: list[BackendChoice] = []

    def refresh(self) -> None:
        from perfx_core.errors import PerfxError
        from perfx_core.plugins import get_registry

        choices = []
        for name, backend in sorted(get_registry().backends.items(), key=lambda kv: (kv[0] != "numpy", kv[0])):
            try:
                devices = backend.devices()
            except PerfxError as exc:
                choices.append(BackendChoice(name, None, f"{name} — unavailable: {exc}", False, str(exc)))
                continue
            except Exception as exc:  # a broken plugin is shown, not fatal
                reason = f"{type(exc).__name__}: {exc}"
                choices.append(BackendChoice(name, None, f"{name} — unavailable: {reason}", False, reason))
                continue
            if not devices:
                choices.append(
                    BackendChoice(name, None, f"{name} — no devices", False, "the backend reported no devices")
                )
            for d in devices:
                detail = f"{d.kind}, {format_bytes(d.memory_bytes)}" if d.memory_bytes else d.kind
                choices.append(
                    BackendChoice(name, d.index, f"{name} · {d.index}: {d.name}", True, f"{d.name} ({detail})")
                )
        self.beginResetModel()
        self._choices = choices
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._choices)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        choice = self._choices[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return choice.label
        if role == Qt.ItemDataRole.ToolTipRole:
            return choice.reason
        if role == self.ChoiceRole:
            return choice
        return None

    def flags(self, index: QModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        if self._choices[index.row()].available:
            return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable
        return Qt.ItemFlag.NoItemFlags

    def choice(self, row: int) -> BackendChoice | None:
        return self._choices[row] if 0 <= row < len(self._choices) else None

    def choices(self) -> list[BackendChoice]:
        return list(self._choices)

    def row_of(self, backend: str, device: int | str | None = None) -> int:
        for i, c in enumerate(self._choices):
            if c.backend == backend and c.available and (device in (None, "") or str(c.device) == str(device)):
                return i
        return -1


class FactsModel(QAbstractTableModel):
    """Two columns, label and value, of the loaded model's facts."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._rows: list[tuple[str, str]] = []

    def set_rows(self, rows: list[tuple[str, str]]) -> None:
        self.beginResetModel()
        self._rows = list(rows)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else 2

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if index.isValid() and role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.ToolTipRole):
            return self._rows[index.row()][index.column()]
        return None

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return ("Fact", "Value")[section]
        return None

    def value(self, label: str) -> str | None:
        return next((v for k, v in self._rows if k == label), None)


class OpProfileModel(QAbstractTableModel):
    """Per-op decode profile: time per token, share, weight bytes and achieved bandwidth."""

    HEADERS = ("Op", "Calls/token", "ms/token", "Share", "Weight bytes/token", "Achieved GB/s", "Of peak BW")

    def __init__(self, parent=None):
        super().__init__(parent)
        self._rows: list[OpRow] = []

    def set_rows(self, rows: list[OpRow]) -> None:
        self.beginResetModel()
        self._rows = list(rows)
        self.endResetModel()

    def rows(self) -> list[OpRow]:
        return list(self._rows)

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.HEADERS)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r = self._rows[index.row()]
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() > 0:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        return (
            r.op,
            f"{r.calls_per_token:.0f}",
            f"{r.ms_per_token:.2f}",
            f"{100 * r.share:.1f} %",
            format_bytes(r.bytes_per_token) if r.bytes_per_token else "—",
            f"{r.achieved_gbs:.2f}" if r.achieved_gbs is not None else "—",
            f"{100 * r.bandwidth_fraction:.0f} %" if r.bandwidth_fraction is not None else "n/a",
        )[index.column()]

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.HEADERS[section]
        if role == Qt.ItemDataRole.ToolTipRole and orientation == Qt.Orientation.Horizontal and section == 4:
            return "bytes of the op's weights in the model file's format, read once per decoded token"
        return None


BENCH_METRICS = (
    ("prefill_tokens_per_s", "Prefill tokens/s", "{:.1f}"),
    ("decode_tokens_per_s", "Decode tokens/s", "{:.2f}"),
    ("time_to_first_token_s", "Time to first token (s)", "{:.3f}"),
    ("load_s", "Load (s)", "{:.2f}"),
    ("warmup_s", "Warm-up (s)", "{:.2f}"),
    ("peak_host_bytes", "Peak host memory", None),
    ("backend_bytes", "Backend memory", None),
    ("device", "Device", "{}"),
)


class BenchResultsModel(QAbstractTableModel):
    """One column per benchmarked backend, one row per metric of run_bench's report."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._reports: list[dict] = []

    def set_reports(self, reports: list[dict]) -> None:
        self.beginResetModel()
        self._reports = list(reports)
        self.endResetModel()

    def add_report(self, report: dict) -> None:
        n = len(self._reports)
        self.beginInsertColumns(QModelIndex(), n, n)
        self._reports.append(report)
        self.endInsertColumns()

    def reports(self) -> list[dict]:
        return list(self._reports)

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(BENCH_METRICS)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._reports)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or role != Qt.ItemDataRole.DisplayRole:
            return None
        key, _, fmt = BENCH_METRICS[index.row()]
        value = self._reports[index.column()].get(key)
        if value is None:
            return "n/a"
        return format_bytes(value) if fmt is None else fmt.format(value)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if orientation == Qt.Orientation.Vertical:
            return BENCH_METRICS[section][1]
        return self._reports[section]["backend"]
