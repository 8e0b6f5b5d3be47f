"""How a chat message is drawn: a role header, the text (Markdown with code blocks for replies) and the reply's
stats line, in a rounded box coloured by role."""

from __future__ import annotations

from collections import OrderedDict

from PySide6.QtCore import QModelIndex, QPointF, QRectF, QSize, Qt
from PySide6.QtGui import (
    QColor,
    QFont,
    QPainter,
    QPen,
    QTextBlock,
    QTextBlockFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import QListView, QStyle, QStyledItemDelegate, QStyleOptionViewItem

from .models import ROLE_COLORS, ConversationModel, format_message_stats

PAD = 8  # inside the box
CODE_BACKGROUND = QColor("#e3e5e8")
MUTED = QColor("#5f6368")


def message_document(role: str, content: str, font: QFont, width: float) -> QTextDocument:
    """The message body laid out at ``width``: assistant text as GitHub Markdown, other roles as typed."""
    doc = QTextDocument()
    doc.setDefaultFont(font)
    doc.setDocumentMargin(0)
    if role == "assistant":
        doc.setMarkdown(content, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
        shade_code_blocks(doc)
    else:
        doc.setPlainText(content)
    doc.setTextWidth(max(1.0, width))
    return doc


def is_code(block: QTextBlock) -> bool:
    """A line of a fenced or indented code block (Qt's Markdown reader marks both, but draws them plain)."""
    fmt = block.blockFormat()
    return fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines()


def shade_code_blocks(doc: QTextDocument) -> None:
    """Give code blocks a background, as chat apps do."""
    shade = QTextBlockFormat()
    shade.setBackground(CODE_BACKGROUND)
    block = doc.begin()
    while block.isValid():
        if is_code(block):
            QTextCursor(block).mergeBlockFormat(shade)
        block = block.next()


def code_blocks(doc: QTextDocument) -> list[str]:
    """The text of each code block of a rendered message (its consecutive code lines joined)."""
    blocks: list[str] = []
    inside = False
    block = doc.begin()
    while block.isValid():
        code = is_code(block)
        if code and inside:
            blocks[-1] += "\n" + block.text()
        elif code:
            blocks.append(block.text())
        inside = code
        block = block.next()
    return blocks


class MessageDelegate(QStyledItemDelegate):
    """Draws ConversationModel rows. Laid-out documents are cached by (role, text, width): while a reply
    streams only its own document is rebuilt."""

    CACHE_SIZE = 256

    def __init__(self, view: QListView):
        super().__init__(view)
        self.view = view
        self._cache: OrderedDict[tuple[str, str, int], QTextDocument] = OrderedDict()

    def _width(self) -> int:
        return max(80, self.view.viewport().width() - 2 * self.view.spacing() - 2 * PAD - 4)

    def document(self, index: QModelIndex) -> QTextDocument:
        message = index.data(ConversationModel.MessageRole)
        content = message["content"] or ("…" if message["role"] == "assistant" else "")
        key = (message["role"], content, self._width())
        doc = self._cache.get(key)
        if doc is None:
            doc = message_document(message["role"], content, self.view.font(), key[2])
            self._cache[key] = doc
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return doc

    def stats_text(self, index: QModelIndex) -> str:
        return format_message_stats(index.data(ConversationModel.StatsRole))

    def _header_font(self) -> QFont:
        font = QFont(self.view.font())
        font.setBold(True)
        return font

    def _small_font(self) -> QFont:
        font = QFont(self.view.font())
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.9))
        return font

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802 (Qt's name)
        height = PAD + self.view.fontMetrics().height() + 2 + self.document(index).size().height() + PAD
        if self.stats_text(index):
            height += 4 + self.view.fontMetrics().height()
        return QSize(self._width() + 2 * PAD, int(height) + 1)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        message = index.data(ConversationModel.MessageRole)
        rect = QRectF(option.rect).adjusted(1, 1, -1, -1)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        border = option.palette.highlight().color() if selected else QColor("#dadce0")
        painter.setPen(QPen(border, 2 if selected else 1))
        painter.setBrush(QColor(ROLE_COLORS.get(message["role"], "#ffffff")))
        painter.drawRoundedRect(rect, 6, 6)

        painter.setPen(QColor("#202124"))
        painter.setFont(self._header_font())
        line = self.view.fontMetrics().height()
        painter.drawText(
            QRectF(rect.left() + PAD, rect.top() + PAD, rect.width() - 2 * PAD, line), message["role"].capitalize()
        )
        doc = self.document(index)
        painter.translate(QPointF(rect.left() + PAD, rect.top() + PAD + line + 2))
        doc.drawContents(painter)
        painter.translate(QPointF(0, doc.size().height() + 4))
        stats = self.stats_text(index)
        if stats:
            painter.setPen(MUTED)
            painter.setFont(self._small_font())
            painter.drawText(QRectF(0, 0, rect.width() - 2 * PAD, line), Qt.AlignmentFlag.AlignLeft, stats)
        painter.restore()
