"""The Chat tab: conversation view, message box, actions, system prompt and sampling settings."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QListView,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from perfx_core import defaults

from .message_view import MessageDelegate
from .models import ConversationModel

PROFILE_COST = "Times every op of each decoded token; the backend synchronizes after each op, so decoding is slower"


class ChatTab(QWidget):
    """Only widgets and user intents; the main window runs generations and fills the model."""

    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_last_requested = Signal()
    copy_requested = Signal()
    clear_requested = Signal()
    save_requested = Signal()
    open_requested = Signal()

    def __init__(self, conversation: ConversationModel, parent=None):
        super().__init__(parent)
        self.conversation = conversation
        self.view = QListView()
        self.view.setModel(conversation)
        self.view.setItemDelegate(MessageDelegate(self.view))
        self.view.setResizeMode(QListView.ResizeMode.Adjust)  # lay messages out again at the new width
        self.view.setSpacing(4)
        self.view.setVerticalScrollMode(QAbstractItemView.ScrollMode.ScrollPerPixel)
        self.view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.view.setObjectName("conversation")
        conversation.rowsInserted.connect(lambda *_: self.view.scrollToBottom())
        conversation.dataChanged.connect(lambda *_: self.view.scrollToBottom())

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Type a message; Ctrl+Enter sends")
        self.input.setFixedHeight(70)
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.regenerate_button = QPushButton("Regenerate")
        self.edit_button = QPushButton("Edit last")
        self.copy_button = QPushButton("Copy")
        self.clear_button = QPushButton("Clear")
        self.save_button = QPushButton("Save…")
        self.open_button = QPushButton("Open…")
        self.stop_button.setEnabled(False)
        self.edit_button.setToolTip("Put the last user message back in the box to edit and resend it")
        self.copy_button.setToolTip("Copy the selected message, or the whole conversation")

        self.send_button.clicked.connect(self._send)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, activated=self._send)
        self.stop_button.clicked.connect(self.stop_requested)
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button.clicked.connect(self.edit_last_requested)
        self.copy_button.clicked.connect(self.copy_requested)
        self.clear_button.clicked.connect(self.clear_requested)
        self.save_button.clicked.connect(self.save_requested)
        self.open_button.clicked.connect(self.open_requested)

        buttons = QHBoxLayout()
        for b in (self.send_button, self.stop_button, self.regenerate_button, self.edit_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        for b in (self.copy_button, self.clear_button, self.save_button, self.open_button):
            buttons.addWidget(b)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        left_layout.addWidget(self.view, 1)
        left_layout.addWidget(self.input)
        left_layout.addLayout(buttons)

        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.system_prompt.setFixedHeight(90)
        self.temperature = QDoubleSpinBox(
            minimum=0.0, maximum=2.0, singleStep=0.05, value=defaults.TEMPERATURE, decimals=2
        )
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=defaults.TOP_K)
        self.top_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, value=defaults.TOP_P, decimals=2)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=defaults.MAX_TOKENS)
        # Off by default: profiling synchronizes after every op, which slows decoding (docs/gui.md has the cost).
        self.profile = QCheckBox("Profile ops (live table; slower)")
        self.profile.setToolTip(PROFILE_COST)
        self.top_k.setToolTip("0 disables top-k")
        settings = QGroupBox("Settings")
        settings_layout = QVBoxLayout(settings)
        form = QFormLayout()
        settings_layout.addLayout(form)
        settings_layout.addStretch(1)
        form.addRow(self.system_prompt)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow(self.profile)

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(left)
        splitter.addWidget(settings)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

    def _send(self) -> None:
        text = self.input.toPlainText().strip()
        if text and self.send_button.isEnabled():
            self.send_requested.emit(text)

    def sampling(self) -> dict:
        return {
            "max_tokens": self.max_tokens.value(),
            "temperature": self.temperature.value(),
            "top_k": self.top_k.value(),
            "top_p": self.top_p.value(),
        }

    def set_sampling(self, settings: dict) -> None:
        self.max_tokens.setValue(int(settings.get("max_tokens", self.max_tokens.value())))
        self.temperature.setValue(float(settings.get("temperature", self.temperature.value())))
        self.top_k.setValue(int(settings.get("top_k", self.top_k.value())))
        self.top_p.setValue(float(settings.get("top_p", self.top_p.value())))

    def set_state(self, model_ready: bool, generating: bool) -> None:
        has_messages = self.conversation.rowCount() > 0
        self.send_button.setEnabled(model_ready and not generating)
        self.stop_button.setEnabled(generating)
        self.regenerate_button.setEnabled(model_ready and not generating and has_messages)
        self.edit_button.setEnabled(not generating and has_messages)
        for b in (self.clear_button, self.open_button):
            b.setEnabled(not generating)
