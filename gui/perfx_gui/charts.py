"""Two small QPainter charts (no plotting dependency): a line chart over time and a grouped bar chart."""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QSizePolicy, QWidget

PALETTE = ("#1a73e8", "#e8710a", "#188038", "#d93025", "#9334e6")


def nice_max(value: float) -> float:
    """A round number at or above ``value`` for the top of an axis, whose quarters are round too."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** len(str(int(value))) / 10
    for step in (1, 2, 4, 6, 8, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def plain_number(value: float) -> str:
    """A number as people write it on an axis: 1500, 62.5, 0.25 (never 1.5e+03)."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    text = f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


@dataclass
class Series:
    name: str
    color: str
    markers: bool = False  # draw points (a sparse series, e.g. one prefill per reply) rather than a line
    # A line joins the points of one segment only: a new segment starts where the data stopped for a while
    # (between two replies), so no line is drawn across the idle time.
    segments: list[list[tuple[float, float]]] = field(default_factory=lambda: [[]])
    current: float | None = None  # the value the legend shows: the latest point of the current segment

    @property
    def points(self) -> list[tuple[float, float]]:
        return [pt for segment in self.segments for pt in segment]


class LineChart(QWidget):
    """Series of (x, y) points; x is seconds of the session, y starts at zero.

    The x range is the points' own unless ``set_time_range`` fixes it (so that two charts side by side cover
    the same time); points outside it are not drawn.
    """

    MAX_POINTS = 4000

    def __init__(self, title: str, unit: str, parent=None):
        super().__init__(parent)
        self.title, self.unit = title, unit
        self.series: dict[str, Series] = {}
        self.time_range: tuple[float, float] | None = None
        self.setMinimumSize(260, 150)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def add_series(self, name: str, markers: bool = False) -> None:
        self.series[name] = Series(name, PALETTE[len(self.series) % len(PALETTE)], markers=markers)

    def add_point(self, name: str, x: float, y: float) -> None:
        series = self.series[name]
        series.segments[-1].append((x, y))
        series.current = y
        while sum(len(segment) for segment in series.segments) > self.MAX_POINTS:
            del series.segments[0][0]
            if not series.segments[0] and len(series.segments) > 1:
                del series.segments[0]
        self.update()

    def break_series(self, name: str) -> None:
        """End the current segment of ``name``; the legend shows no value until the next point."""
        series = self.series[name]
        if series.segments[-1]:
            series.segments.append([])
        series.current = None
        self.update()

    def set_time_range(self, x0: float, x1: float) -> None:
        self.time_range = (x0, max(x1, x0 + 1.0))
        self.update()

    def x_range(self) -> tuple[float, float]:
        if self.time_range is not None:
            return self.time_range
        xs = [x for s in self.series.values() for x, _ in s.points]
        x0, x1 = min(xs, default=0.0), max(xs, default=1.0)
        return x0, (x1 if x1 > x0 else x0 + 1.0)

    def clear(self) -> None:
        for s in self.series.values():
            s.segments, s.current = [[]], None
        self.update()

    def _layout(self, fm) -> tuple[QRectF, float]:
        """The plot area and the top of the y axis, for the points in the x range."""
        x0, x1 = self.x_range()
        visible = [y for s in self.series.values() for x, y in s.points if x0 <= x <= x1]
        y1 = nice_max(max(visible, default=0.0) * 1.05)
        widest = max(fm.horizontalAdvance(plain_number(y1 * i / 4)) for i in range(5))
        left, top, right, bottom = widest + 10, fm.height() * 2 + 6, 10, fm.height() + 10
        return QRectF(left, top, self.width() - left - right, self.height() - top - bottom), y1

    def _mapping(self, fm):
        plot, y1 = self._layout(fm)
        x0, x1 = self.x_range()

        def to_screen(x: float, y: float) -> QPointF:
            return QPointF(plot.left() + (x - x0) / (x1 - x0) * plot.width(), plot.bottom() - y / y1 * plot.height())

        return plot, y1, to_screen

    def plot_area(self) -> QRectF:
        """The rectangle the series are drawn in, in widget coordinates."""
        return self._layout(self.fontMetrics())[0]

    def position(self, x: float, y: float) -> QPointF:
        """Where the point (x, y) is drawn, in widget coordinates."""
        return self._mapping(self.fontMetrics())[2](x, y)

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.fillRect(self.rect(), QColor("white"))
        fm = p.fontMetrics()
        plot, y1, to_screen = self._mapping(fm)
        x0, x1 = self.x_range()
        p.setPen(QColor("#202124"))
        p.drawText(
            QRectF(0, 2, self.width(), fm.height()), Qt.AlignmentFlag.AlignHCenter, f"{self.title} ({self.unit})"
        )
        grid = QPen(QColor("#e0e0e0"))
        for i in range(5):
            y = plot.bottom() - plot.height() * i / 4
            p.setPen(grid)
            p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            p.setPen(QColor("#5f6368"))
            label = plain_number(y1 * i / 4)
            p.drawText(QRectF(0, y - fm.height() / 2, plot.left() - 6, fm.height()), Qt.AlignmentFlag.AlignRight, label)
        p.drawText(QRectF(plot.left(), plot.bottom() + 2, 80, fm.height()), Qt.AlignmentFlag.AlignLeft, f"{x0:.0f} s")
        p.drawText(
            QRectF(plot.right() - 80, plot.bottom() + 2, 80, fm.height()), Qt.AlignmentFlag.AlignRight, f"{x1:.0f} s"
        )

        legend_x = plot.left()
        for s in self.series.values():
            color = QColor(s.color)
            p.setPen(QPen(color, 2))
            p.save()
            p.setClipRect(plot.adjusted(-4, -4, 4, 4))
            if s.markers:
                p.setBrush(color)
                for x, y in s.points:
                    p.drawEllipse(to_screen(x, y), 3.5, 3.5)
            for segment in [] if s.markers else s.segments:
                if len(segment) > 1:
                    p.drawPolyline(QPolygonF([to_screen(x, y) for x, y in segment]))
                elif segment:
                    p.drawEllipse(to_screen(*segment[0]), 2, 2)
            p.restore()
            latest = f" {plain_number(s.current)}" if s.current is not None else ""
            text = f"■ {s.name}{latest}"
            p.drawText(QPointF(legend_x, plot.top() - 6), text)
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
                    plain_number(value),
                )
            p.setPen(QColor("#202124"))
            p.drawText(
                QRectF(g * group_w, self.height() - bottom + 4, group_w, fm.height()),
                Qt.AlignmentFlag.AlignHCenter,
                metric,
            )
        p.end()
