"""Device history: utilization (%) and memory (GiB) over time, with the batch plots' time
windows. Frames only append to arrays; refresh() (the window's plot clock) sets the curves'
data when something changed; the x range moves in steps and the memory axis only when the
data outgrows a nice ceiling (app.plots.time_window), so a refresh repaints curves, not axes.
Each plot's title is its legend (coloured curve names, no box over the data), and a curve
joins it once it has a point, so a CPU engine's plot does not list GPU curves that will never
get data."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from kvscope.app.plots.axes import use_sparse_y_axis
from kvscope.app.plots.plot_title import use_wrapping_title
from kvscope.app.plots.series import Series
from kvscope.app.plots.time_window import WINDOWS, nice_ceiling, x_range

GIB = float(2**30)
# (plot, title, [(curve, legend name, colour)])
SPECS = (
    ("util", "util %", (("gpu", "GPU", "#98c379"), ("membw", "mem bw", "#56b6c2"),
                               ("cpu", "engine", "#e5c07b"),
                               ("system", "system", "#7f848e"))),
    ("memory", "GiB", (("process", "kvscope", "#e06c75"), ("kv_pool", "KV pool", "#c678dd"),
                              ("weights", "weights", "#d19a66"),
                              ("used", "used", "#61afef"))),
)


class DevicePlots(QWidget):
    windowChanged = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.t0: float | None = None
        self.util = Series(("gpu", "membw", "cpu", "system"))
        self.memory = Series(("process", "kv_pool", "weights", "used"))
        self._dirty = False
        self.following = True
        self._setting_range = False
        self._ranges: dict[str, tuple[float, float]] = {}  # last range set: "x", "memory"
        self.window = QComboBox()
        self.window.addItems(list(WINDOWS))
        self.window.currentTextChanged.connect(self._window_chosen)
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.layout_widget.setBackground("#16181d")
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.in_legend: set[str] = set()
        first = None
        for row, (key, _title, curves) in enumerate(SPECS):
            plot = self.layout_widget.addPlot(row=row, col=0)  # no grid: see batch_plots
            use_wrapping_title(plot)  # its legend may be wider than a small window's panel
            plot.setMenuEnabled(False)
            plot.hideButtons()
            use_sparse_y_axis(plot)  # a small plot: labels that fit, not a blob
            plot.getAxis("left").setWidth(34)  # same width in both plots: their x lines up
            if first is None:
                first = plot
                plot.hideAxis("bottom")  # x-linked: the lower plot's axis serves both
            else:
                plot.setXLink(first)
            plot.getViewBox().sigRangeChangedManually.connect(self._user_moved)
            for name, _label, colour in curves:
                curve = plot.plot([], [], pen=pg.mkPen(colour, width=1))  # see batch_plots
                curve.setClipToView(True)
                curve.setDownsampling(auto=True, method="peak")
                self.curves[name] = curve
            self.plots[key] = plot
            self._show_legend(key)
        self.plots["util"].setYRange(0, 100, padding=0.02)
        self.plots["util"].disableAutoRange(axis="y")
        self.plots["memory"].disableAutoRange(axis="y")  # from 0 up: see _fit_memory
        top = QHBoxLayout()
        title = QLabel("history")
        title.setObjectName("note")
        top.addWidget(title, 1)
        top.addWidget(QLabel("window"))
        top.addWidget(self.window)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(top)
        layout.addWidget(self.layout_widget, 1)

    # -- frames -------------------------------------------------------------------------------
    def show_device(self, f) -> None:
        if self.t0 is None:
            self.t0 = f.time
        t = f.time - self.t0
        # Engine CPU as a share of the whole machine (cpu_percent is 100 per busy core), so it
        # shares the 0-100 axis with the system figure.
        cpu = None if f.cpu_percent is None else f.cpu_percent / max(1, f.num_cpus)
        self.util.append(t, gpu=f.gpu_utilization, membw=f.memory_utilization, cpu=cpu,
                         system=f.system_cpu_percent)
        self.memory.append(t, process=f.process_bytes / GIB, kv_pool=f.kv_pool_bytes / GIB,
                           weights=f.weights_bytes / GIB, used=f.memory_used / GIB)
        self._dirty = True

    # -- view -----------------------------------------------------------------------------------
    def set_window(self, name: str) -> None:
        """Show a time window preset; a no-op for the current one (so two synced views do not
        echo each other forever)."""
        if name in WINDOWS and self.window.currentText() != name:
            self.window.setCurrentText(name)  # re-enters through _window_chosen

    def _window_chosen(self, name: str) -> None:
        self._ranges.pop("x", None)
        self.following = True
        self._dirty = True
        self.refresh()
        self.windowChanged.emit(name)

    def _user_moved(self, *_args) -> None:
        if not self._setting_range:
            self.following = False  # pan/zoom by hand: stop following the newest data

    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        for key, series in (("util", self.util), ("memory", self.memory)):
            t = series.times()
            named = len(self.in_legend)
            for name in series.names:
                v = series.values(name)
                ok = ~np.isnan(v)
                self.curves[name].setData(t[ok], v[ok])
                if ok.any():
                    self.in_legend.add(name)
            if len(self.in_legend) != named:
                self._show_legend(key)
        self._fit_memory()
        if self.following:
            self._follow()

    def _fit_memory(self) -> None:
        """The memory axis starts at 0, so a line's height reads as its share of the top."""
        cols = [self.memory.values(n) for n in self.memory.names]
        top = max((float(np.nanmax(c)) for c in cols if len(c) and not np.isnan(c).all()),
                  default=1.0)
        y_range = (0.0, nice_ceiling(max(top, 1e-3) * 1.05))
        if self._ranges.get("memory") != y_range:
            self._ranges["memory"] = y_range
            self.plots["memory"].setYRange(*y_range, padding=0)

    def _follow(self) -> None:
        if not len(self.util):
            return
        end = float(self.util.times()[-1])
        self._setting_range = True
        try:
            x = x_range(end, self.window.currentText())
            if self._ranges.get("x") != x:
                self._ranges["x"] = x
                self.plots["util"].setXRange(*x, padding=0.02)
        finally:
            self._setting_range = False

    def _show_legend(self, key: str) -> None:
        """The plot's title: its unit, then the names of the curves that have data, each in
        its curve's colour."""
        _, title, curves = next(spec for spec in SPECS if spec[0] == key)
        names = " ".join(f"<span style='color:{colour}'>━ {label}</span>"
                         for name, label, colour in curves if name in self.in_legend)
        self.plots[key].setTitle(f"{title} &nbsp; {names}", size="8pt", color="#9aa0aa")

    def legend_text(self, key: str) -> str:
        return self.plots[key].titleLabel.text

    def clear(self) -> None:
        self.util.clear()
        self.memory.clear()
        self.in_legend.clear()
        for key in self.plots:
            self._show_legend(key)
        self.t0, self._dirty = None, True
        self._ranges.clear()
        self.refresh()

