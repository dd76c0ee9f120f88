"""A small heatmap of one KV setting's passkey grid: lengths down, depths across.

Each cell's colour is the share of its keys found (green all, red none; grey when the grid
has no right answers); a dot marks a cell where some answer differed from float32 KV's. The
tooltip has the cell's numbers.
"""
from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

from kvscope.app.kv_grid.saved_grid import Cell, SettingGrid

CELL = 14  # px per cell side
LABEL_W = 30  # the length labels on the left
HEAD_H = 14  # the title on top


def share_colour(share: float | None) -> QColor:
    """Red (0) through amber to green (1); grey for no value."""
    if share is None:
        return QColor(120, 120, 120)
    share = min(max(share, 0.0), 1.0)
    hue = int(120 * share)  # 0 red .. 120 green
    return QColor.fromHsv(hue, 170, 200)


def short_length(n: int) -> str:
    return f"{n / 1024:.0f}k" if n >= 1024 and n % 1024 < 64 else str(n)


class Heatmap(QWidget):
    def __init__(self, grid: SettingGrid, lengths: list[int], depths: list[float],
                 title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.grid = grid
        self.lengths = lengths
        self.depths = depths
        self.title = title
        self.highlighted = False
        self.cells = {(c.length, c.depth): c for c in grid.cells}
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.setToolTip(self.summary())

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(max(LABEL_W + CELL * len(self.depths) + 2, 80),
                     HEAD_H + CELL * len(self.lengths) + 2)

    def set_highlighted(self, on: bool) -> None:
        self.highlighted = on
        self.update()

    def cell_rect(self, row: int, col: int) -> QRect:
        return QRect(LABEL_W + col * CELL, HEAD_H + row * CELL, CELL - 1, CELL - 1)

    def cell_at(self, pos: QPoint) -> Cell | None:
        for r, length in enumerate(self.lengths):
            for c, depth in enumerate(self.depths):
                if self.cell_rect(r, c).contains(pos):
                    return self.cells.get((length, depth))
        return None

    def summary(self) -> str:
        g = self.grid
        found = [c.right for c in g.cells if c.right is not None]
        right = f"{sum(found) / len(found):.0%} of keys found, " if found else ""
        same = sum(c.same for c in g.cells) / len(g.cells)
        return (f"{g.name}: rotation {g.kv_rotation}, {g.kv_anchor_tokens} exact first "
                f"tokens\n{right}{same:.0%} as float32 KV answered")

    def mouseMoveEvent(self, event) -> None:  # noqa: N802
        cell = self.cell_at(event.position().toPoint())
        if cell is None:
            self.setToolTip(self.summary())
            return
        right = "-" if cell.right is None else f"{cell.right:.0%}"
        self.setToolTip(f"{self.grid.name}, {cell.length} tokens, key at {cell.depth:.0%}\n"
                        f"found {right}, same as float32 {cell.same:.0%}\n"
                        f"KL {cell.kl:.4f}, rank of the right digit {cell.rank:.0f}")

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        font = p.font()
        font.setPointSizeF(max(6.5, font.pointSizeF() * 0.8))
        font.setBold(self.highlighted)
        p.setFont(font)
        text = self.palette().windowText().color()
        p.setPen(text)
        p.drawText(QRect(0, 0, self.width(), HEAD_H), Qt.AlignmentFlag.AlignLeft, self.title)
        for r, length in enumerate(self.lengths):
            p.setPen(text)
            p.drawText(QRect(0, HEAD_H + r * CELL, LABEL_W - 3, CELL),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                       short_length(length))
            for c, depth in enumerate(self.depths):
                self._paint_cell(p, self.cell_rect(r, c), self.cells.get((length, depth)))
        if self.highlighted:
            p.setPen(self.palette().highlight().color())
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.drawRect(QRect(LABEL_W - 2, HEAD_H - 2, CELL * len(self.depths) + 2,
                             CELL * len(self.lengths) + 2))
        p.end()

    def _paint_cell(self, p: QPainter, rect: QRect, cell: Cell | None) -> None:
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(share_colour(None if cell is None else cell.right))
        p.drawRect(rect)
        if cell is not None and cell.same < 1.0:  # some answer differed from float32 KV's
            p.setBrush(QColor(20, 20, 20))
            p.drawEllipse(rect.center(), 2, 2)
