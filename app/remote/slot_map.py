"""llama-server's slots as the map's rows: one row per slot, filled to the tokens in its KV out
of the slot's context, coloured by the task it serves (idle slots dimmed). llama-server has no
block table, so this is the whole map it can give."""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from kvscope.app import colors
from kvscope.app.sources.source import SlotsFrame, SlotState

BACKGROUND = QColor(*colors.MAP_BACKGROUND_RGB)
EMPTY = QColor(*colors.FREE_RGB)
TEXT = QColor("#f0f2f5")
SHADOW = QColor(0, 0, 0, 230)
NOTE = QColor("#c8a050")
ROW_MAX, ROW_MIN = 44, 14


@dataclass(frozen=True)
class SlotRow:
    text: str
    fraction: float | None  # None: the fill is not reported
    rgb: tuple[int, int, int]
    processing: bool


def slot_row(s: SlotState, kind: str) -> SlotRow:
    rgb = colors.request_rgb(f"task-{s.task}") if s.task is not None else colors.FREE_RGB
    task = f"task {s.task}" if s.task is not None else "never used"
    state = "processing" if s.processing else "idle"
    if s.n_used is None:
        fill, fraction = f"fill not reported by {kind}", None
    else:
        fraction = min(1.0, s.n_used / s.n_ctx) if s.n_ctx else 0.0
        fill = f"{s.n_used:,} / {s.n_ctx:,} tokens ({100 * fraction:.0f} %)"
    decoded = f" · {s.n_decoded} generated" if s.n_decoded and s.processing else ""
    return SlotRow(f"slot {s.id} · {task} · {state} · {fill}{decoded}", fraction, rgb,
                   s.processing)


class SlotMap(QWidget):
    def __init__(self, kind: str = "llama-server", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.kind = kind
        self.setMinimumSize(240, 120)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.rows: list[SlotRow] = []
        self.message = f"waiting for {kind}'s /slots…"

    def show_slots(self, frame: SlotsFrame) -> None:
        if frame.disabled:
            self.rows, self.message = [], frame.disabled
        else:
            self.rows = [slot_row(s, self.kind) for s in frame.slots]
            self.message = "" if self.rows else f"{self.kind} reports no slots"
        self.update()

    def mark_stale(self, reason: str) -> None:
        self.message = reason
        self.update()

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        p.fillRect(self.rect(), BACKGROUND)
        w, h = self.width(), self.height()
        top = 4
        if self.message:
            p.setPen(NOTE)
            p.drawText(QRectF(8, 4, w - 16, 40), Qt.TextFlag.TextWordWrap, self.message)
            top = 44
        if self.rows:
            row_h = max(ROW_MIN, min(ROW_MAX, (h - top - 4) // len(self.rows)))
            fit = max(1, (h - top - 4) // row_h)
            if fit < len(self.rows):  # the last visible row says how many did not fit
                fit -= 1
            for i, row in enumerate(self.rows[:fit]):
                self._paint_row(p, row, QRectF(8, top + i * row_h + 2, w - 16, row_h - 4))
            if fit < len(self.rows):
                p.setPen(NOTE)
                p.drawText(QRectF(8, top + fit * row_h, w - 16, row_h),
                           Qt.AlignmentFlag.AlignVCenter,
                           f"+ {len(self.rows) - fit} more slots (enlarge the map)")
        p.end()

    def _paint_row(self, p: QPainter, row: SlotRow, r: QRectF) -> None:
        p.fillRect(r, EMPTY)
        color = QColor(*row.rgb)
        if not row.processing:
            color = color.darker(180)
        if row.fraction is None:
            p.fillRect(r, QColor(color.red(), color.green(), color.blue(), 60))
        elif row.fraction > 0:
            p.fillRect(QRectF(r.x(), r.y(), r.width() * row.fraction, r.height()), color)
        text = r.adjusted(6, 0, -6, 0)
        p.setPen(SHADOW)  # readable on a light task colour as on the dark track
        p.drawText(text.translated(1, 1), Qt.AlignmentFlag.AlignVCenter, row.text)
        p.setPen(TEXT)
        p.drawText(text, Qt.AlignmentFlag.AlignVCenter, row.text)
