"""Two small QPainter charts (no plotting dependency): a line chart over time and a grouped bar chart."""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QSizePolicy, QWidget

PALETTE = ("#1a73e8", "#e8710a", "#188038", "#d93025", "#9334e6")


def nice_max(value: float) -> float:
    """A round number at or above ``value`` for the top of an axis."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** len(str(int(value))) / 10
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


@dataclass
class Series:
    name: str
    color: str
    points: list[tuple[float, float]] = field(default_factory=list)
    markers: bool = False  # draw points (a sparse series, e.g. one prefill per reply) rather than a line


class LineChart(QWidget):
    """Series of (x, y) points; x is seconds of the session, y starts at zero."""

    MAX_POINTS = 2000

    def __init__(self, title: str, unit: str, parent=None):
        super().__init__(parent)
        self.title, self.unit = title, unit
        self.series: dict[str, Series] = {}
        self.setMinimumSize(260, 160)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def add_series(self, name: str, markers: bool = False) -> None:
        self.series[name] = Series(name, PALETTE[len(self.series) % len(PALETTE)], markers=markers)

    def add_point(self, name: str, x: float, y: float) -> None:
        points = self.series[name].points
        points.append((x, y))
        if len(points) > self.MAX_POINTS:
            del points[: len(points) - self.MAX_POINTS]
        self.update()

    def clear(self) -> None:
        for s in self.series.values():
            s.points.clear()
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.fillRect(self.rect(), QColor("white"))
        fm = p.fontMetrics()
        left, top, right, bottom = fm.horizontalAdvance("00000.0") + 8, fm.height() * 2 + 6, 10, fm.height() + 10
        plot = QRectF(left, top, self.width() - left - right, self.height() - top - bottom)
        p.setPen(QColor("#202124"))
        p.drawText(
            QRectF(0, 2, self.width(), fm.height()), Qt.AlignmentFlag.AlignHCenter, f"{self.title} ({self.unit})"
        )
        all_points = [pt for s in self.series.values() for pt in s.points]
        x0 = min((x for x, _ in all_points), default=0.0)
        x1 = max((x for x, _ in all_points), default=1.0)
        x1 = x1 if x1 > x0 else x0 + 1.0
        y1 = nice_max(max((y for _, y in all_points), default=0.0) * 1.05)
        grid = QPen(QColor("#e0e0e0"))
        for i in range(5):
            y = plot.bottom() - plot.height() * i / 4
            p.setPen(grid)
            p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            p.setPen(QColor("#5f6368"))
            label = f"{y1 * i / 4:.3g}"
            p.drawText(QRectF(0, y - fm.height() / 2, left - 4, fm.height()), Qt.AlignmentFlag.AlignRight, label)
        p.drawText(QRectF(plot.left(), plot.bottom() + 2, 80, fm.height()), Qt.AlignmentFlag.AlignLeft, f"{x0:.0f} s")
        p.drawText(
            QRectF(plot.right() - 80, plot.bottom() + 2, 80, fm.height()), Qt.AlignmentFlag.AlignRight, f"{x1:.0f} s"
        )

        def to_screen(x: float, y: float) -> QPointF:
            return QPointF(plot.left() + (x - x0) / (x1 - x0) * plot.width(), plot.bottom() - y / y1 * plot.height())

        legend_x = plot.left()
        for s in self.series.values():
            color = QColor(s.color)
            p.setPen(QPen(color, 2))
            if s.markers:
                p.setBrush(color)
                for x, y in s.points:
                    p.drawEllipse(to_screen(x, y), 3.5, 3.5)
                p.setBrush(Qt.BrushStyle.NoBrush)
            elif len(s.points) > 1:
                p.drawPolyline(QPolygonF([to_screen(x, y) for x, y in s.points]))
            elif s.points:
                p.drawEllipse(to_screen(*s.points[0]), 2, 2)
            latest = f" {s.points[-1][1]:.3g}" if s.points else ""
            text = f"■ {s.name}{latest}"
            p.drawText(QPointF(legend_x, top - 6), text)
            legend_x += fm.horizontalAdvance(text) + 16
        p.end()


class BarChart(QWidget):
    """Grouped bars: one group per metric, one bar per label (e.g. per backend), each group scaled on its own."""

    def __init__(self, title: str, parent=None):
        super().__init__(parent)
        self.title = title
        self.groups: list[tuple[str, dict[str, float]]] = []  # (metric, {label: value})
        self.setMinimumSize(260, 180)

    def set_groups(self, groups: list[tuple[str, dict[str, float]]]) -> None:
        self.groups = groups
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.fillRect(self.rect(), QColor("white"))
        fm = p.fontMetrics()
        p.setPen(QColor("#202124"))
        p.drawText(QRectF(0, 2, self.width(), fm.height()), Qt.AlignmentFlag.AlignHCenter, self.title)
        labels = sorted({label for _, values in self.groups for label in values})
        if not self.groups or not labels:
            p.setPen(QColor("#5f6368"))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no results yet")
            p.end()
            return
        colors = {label: QColor(PALETTE[i % len(PALETTE)]) for i, label in enumerate(labels)}
        top, bottom = fm.height() * 3, fm.height() * 2 + 6
        group_w = self.width() / len(self.groups)
        plot_h = self.height() - top - bottom
        legend_x = 8.0
        for label in labels:
            p.setPen(colors[label])
            p.drawText(QPointF(legend_x, fm.height() * 2 + 2), f"■ {label}")
            legend_x += fm.horizontalAdvance(f"■ {label}") + 16
        for g, (metric, values) in enumerate(self.groups):
            top_value = max(values.values(), default=0.0) or 1.0
            bar_w = (group_w * 0.7) / len(labels)
            for i, label in enumerate(labels):
                value = values.get(label)
                if value is None:
                    continue
                h = plot_h * value / top_value
                x = g * group_w + group_w * 0.15 + i * bar_w
                rect = QRectF(x, top + plot_h - h, bar_w * 0.9, h)
                p.fillRect(rect, colors[label])
                p.setPen(QColor("#202124"))
                p.drawText(
                    QRectF(x, rect.top() - fm.height(), bar_w, fm.height()),
                    Qt.AlignmentFlag.AlignHCenter,
                    f"{value:.3g}",
                )
            p.setPen(QColor("#202124"))
            p.drawText(
                QRectF(g * group_w, self.height() - bottom + 4, group_w, fm.height()),
                Qt.AlignmentFlag.AlignHCenter,
                metric,
            )
        p.end()
