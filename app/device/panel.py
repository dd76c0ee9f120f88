"""The Device panel, beside the batch plots: what the engine's device is, where its memory
went (a stacked bar: weights | KV used | KV free | KV cached | other | free) and how busy it
is over time. Fed by the `device` topic (about once a second); frames only store the newest
one and append history; refresh_bar() (every frame) draws the bar, refresh_plots() (the
plots' slower clock) the curves, refresh_labels() the text, each only when a frame arrived."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.device import text as device_text
from kvscope.app.device.memory_bar import MemoryBar, MemoryLegend
from kvscope.app.device.memory_math import memory_segments
from kvscope.app.device.plots import DevicePlots

NO_DATA = "no device data yet"
MIN_WIDTH = 300  # the two-column legend (8.5 pt) and the number grid (9 pt) still fit
# The number grid, row by row: one key spans the row, or two share it.
GRID = (("memory",), ("process", "temp"), ("gpu", "membw"), ("clock", "power"),
        ("cpu", "system"))


class DevicePanel(QWidget):
    windowChanged = Signal(str)  # the history's time window preset, chosen here

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.frame = None
        self.stale: str | None = None  # why the numbers stopped updating (engine dead)
        self._bar_dirty = False
        self._labels_dirty = False
        title = QLabel("Device")
        title.setObjectName("panelTitle")
        self.name = QLabel(NO_DATA)
        self.name.setObjectName("deviceName")
        self.name.setWordWrap(True)
        self.name.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        heading = QHBoxLayout()
        heading.addWidget(title)
        heading.addWidget(self.name, 1)
        self.keys: dict[str, QLabel] = {}
        self.values: dict[str, QLabel] = {}
        self.bar = MemoryBar()
        self.legend = MemoryLegend()
        self.plots = DevicePlots()
        self.plots.windowChanged.connect(self.windowChanged)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(4)
        layout.addLayout(heading)
        layout.addLayout(self._number_grid())
        layout.addWidget(self.bar)
        layout.addWidget(self.legend)
        layout.addWidget(self.plots, 1)
        self.setMinimumWidth(MIN_WIDTH)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)

    def _number_grid(self) -> QGridLayout:
        """Label/value pairs; two a row where the values are short, so the plots keep their
        height. The last row's pairs sit side by side, not in the grid's columns: the CPU
        value is the widest and would widen the whole left column."""
        grid = QGridLayout()
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(0)
        grid.setColumnStretch(1, 1)
        for row, pairs in enumerate(GRID):
            inline = QHBoxLayout() if row == len(GRID) - 1 else None
            if inline is not None:
                inline.setSpacing(6)
            for i, key in enumerate(pairs):
                text, tip = device_text.LABELS[key]
                k = QLabel(text)
                k.setObjectName("deviceKey")
                k.setToolTip(tip)
                v = QLabel(device_text.DASH)
                v.setObjectName("deviceValue")
                v.setToolTip(tip)
                v.setMinimumWidth(1)  # a narrow panel clips a value rather than the window
                self.keys[key], self.values[key] = k, v
                if inline is not None and i > 0:
                    inline.addStretch(1)
                    inline.addWidget(k)
                    inline.addWidget(v)
                elif inline is not None:
                    grid.addWidget(k, row, 0)
                    inline.addWidget(v)
                    grid.addLayout(inline, row, 1, 1, 3)
                else:
                    span = 3 if len(pairs) == 1 else 1
                    v.setWordWrap(span == 3)  # a long full-width value wraps instead
                    grid.addWidget(k, row, 2 * i)
                    grid.addWidget(v, row, 2 * i + 1, 1, span)
        return grid

    # -- input ------------------------------------------------------------------------------
    def show_device(self, frame) -> None:
        """Keep the newest frame and append its history; drawing waits for the clocks."""
        self.frame = frame
        self.stale = None
        self.plots.show_device(frame)
        self._bar_dirty = self._labels_dirty = True

    def mark_stale(self, reason: str) -> None:
        """The engine is gone: keep its last numbers on screen, but say they are old."""
        self.stale = reason
        self._labels_dirty = self.frame is not None

    def set_window(self, name: str) -> None:
        self.plots.set_window(name)

    def clear(self) -> None:
        """Forget everything (the engine restarted): back to the no-data state."""
        self.frame, self.stale = None, None
        self._bar_dirty = self._labels_dirty = False
        self.plots.clear()
        self.bar.details = {}
        self.bar.clear()
        self.legend.show_segments([])
        self.legend.set_details({})
        self.name.setText(NO_DATA)
        for key in self.values:
            self.values[key].setText(device_text.DASH)
            self._show_row(key, True)

    # -- clocks -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Bar and curves."""
        self.refresh_bar()
        self.refresh_plots()

    def refresh_plots(self) -> None:
        """The history curves (the plots' slower clock)."""
        self.plots.refresh()

    def refresh_bar(self) -> None:
        """The memory bar (every frame: a few rectangles)."""
        if self._bar_dirty:
            self._bar_dirty = False
            self.bar.details = self._details()
            self.bar.set_segments(memory_segments(self.frame), self.frame.memory_total)

    def refresh_labels(self) -> None:
        """Header numbers and the legend (4 Hz)."""
        if not self._labels_dirty:
            return
        self._labels_dirty = False
        f = self.frame
        title = device_text.title(f)
        self.name.setText(title if self.stale is None else
                          f"{title} — last sample, not updating ({self.stale})")
        self.name.setToolTip(f"engine process {f.pid}")
        for key, text in device_text.values(f).items():
            self._show_row(key, text is not None)
            if text is not None and self.values[key].text() != text:
                self.values[key].setText(text)
        self.legend.show_segments(memory_segments(f))
        self.legend.set_details(self._details())

    def _details(self) -> dict[str, str]:
        listed = device_text.processes(self.frame)
        return {"other processes": listed} if listed else {}

    def _show_row(self, key: str, visible: bool) -> None:
        self.keys[key].setVisible(visible)
        self.values[key].setVisible(visible)
