"""Batch and memory over time: tokens per step against the budget, queue depths, KV usage,
throughput and latency. Frames only append to arrays; refresh() (the window's plot clock, a
few times a second) sets the curves' data when something changed, so a burst of frames costs
one redraw. The plots share one x axis (the bottom row's) and their ranges move in steps
(app.plots.time_window), so a refresh repaints curves, not axes."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import stale
from kvscope.app.plots.axes import use_sparse_y_axis
from kvscope.app.plots.plot_title import use_wrapping_title
from kvscope.app.plots.series import Series
from kvscope.app.plots.time_window import WINDOWS, nice_ceiling, x_range

PEN = {"prefill": "#f0a35e", "decode": "#5ec8f0", "budget": "#e06c75", "running": "#98c379",
       "waiting": "#e5c07b", "preempted": "#e06c75", "kv": "#c678dd", "prompt": "#f0a35e",
       "gen": "#5ec8f0", "ttft": "#e5c07b", "itl": "#56b6c2"}


# Steps come back to back while the engine works; a longer silence is idle time, drawn as a
# break in the line rather than a ramp from the last busy step to the next.
STEP_GAP_S = 1.0


class BatchPlots(QWidget):
    windowChanged = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.t0: float | None = None
        self.last_step = -1
        self.last_stats = None
        self.stale: str | None = None  # why the numbers stopped (the engine died)
        self.steps = Series(("prefill", "decode", "budget", "running", "waiting"))
        self.frames = Series(("preempted",))
        self.kv = Series(("usage",))
        self.stats = Series(("prompt", "gen", "ttft", "itl"))
        self._dirty = False
        self.following = True
        self._setting_range = False
        self._ranges: dict[str, tuple[float, float]] = {}  # last range set, per plot / "x"
        self.window = QComboBox()
        self.window.addItems(list(WINDOWS))
        self.window.currentTextChanged.connect(self.set_window)
        self.summary = QLabel("")
        self.summary.setObjectName("plotSummary")
        # Wrap on its own line under the title: clipped, it cut its numbers mid-glyph; kept on
        # one line, its longest text would set the window's least width.
        self.summary.setWordWrap(True)
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.layout_widget.setBackground("#16181d")
        self.plots: dict[str, pg.PlotItem] = {}
        self.not_reported: dict[str, str] = {}  # plot key -> why it stays empty
        self.curves: dict[str, pg.PlotDataItem] = {}
        specs = [("batch", "batch tokens / step", ["prefill", "decode", "budget"]),
                 ("queues", "requests", ["running", "waiting", "preempted"]),
                 ("kv", "KV usage %", ["kv"]),
                 ("tput", "tokens / s", ["prompt", "gen"]),
                 ("latency", "latency p50 (ms)", ["ttft", "itl"])]
        first = None
        for i, (key, title, curves) in enumerate(specs):
            plot = self.layout_widget.addPlot(row=i // 2, col=i % 2)
            use_wrapping_title(plot)  # a legend title must not widen a small window's grid
            plot.setTitle(_legend_title(title, curves), size="8pt", color="#9aa0aa")
            # No grid: pyqtgraph draws it as part of the axes, so every curve update would
            # repaint them. The lowest plot of each column shows the shared time axis.
            if i + 2 < len(specs):
                plot.hideAxis("bottom")
            use_sparse_y_axis(plot)  # small plots: labels that fit, not a blob
            plot.getAxis("left").setWidth(44)  # equal widths: the columns' x line up
            plot.disableAutoRange(axis="y")  # stepped instead: see _fit_y
            plot.setMenuEnabled(False)
            if first is None:
                first = plot
            else:
                plot.setXLink(first)
            plot.getViewBox().sigRangeChangedManually.connect(self._user_moved)
            # Thin lines, no fills, the legend in the title: a pen wider than one pixel, a
            # filled area or a legend box over the data each cost a repaint several times
            # over (the plots' paint was most of a frame).
            for name in curves:
                pen = pg.mkPen(PEN[name], width=1)
                if name == "budget":
                    pen.setStyle(pg.QtCore.Qt.PenStyle.DashLine)
                curve = plot.plot([], [], pen=pen, name=name)
                curve.setClipToView(True)
                curve.setDownsampling(auto=True, method="peak")
                self.curves[name] = curve
            self.plots[key] = plot
        self.plots["kv"].setYRange(0, 100)
        top = QHBoxLayout()
        title = QLabel("Batch & memory")
        title.setObjectName("panelTitle")
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(QLabel("window"))
        top.addWidget(self.window)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.summary)
        layout.addWidget(self.layout_widget, 1)

    def _rel(self, t: float) -> float:
        if self.t0 is None:
            self.t0 = t
        return t - self.t0

    # -- frames -------------------------------------------------------------------------------
    def show_step(self, frame) -> None:
        for rec in frame.history:
            if rec.step <= self.last_step:
                continue
            self.last_step = rec.step
            self.steps.append(self._rel(rec.time), prefill=rec.prefill_tokens,
                              decode=rec.decode_tokens, budget=frame.token_budget,
                              running=rec.num_running, waiting=rec.num_waiting)
        self.frames.append(self._rel(frame.time), preempted=frame.num_preempted)
        self._dirty = True

    def show_blocks(self, frame) -> None:
        self.kv.append(self._rel(frame.time), usage=100.0 * frame.used / max(1, frame.num_blocks))
        self._dirty = True

    def show_stats(self, frame) -> None:
        ms = 1000.0
        self.stats.append(self._rel(frame.time), prompt=frame.prompt_tokens_per_s,
                          gen=frame.generation_tokens_per_s,
                          ttft=None if frame.ttft_s.p50 is None else frame.ttft_s.p50 * ms,
                          itl=None if frame.itl_s.p50 is None else frame.itl_s.p50 * ms)
        self.last_stats = frame  # the summary line follows on the next refresh
        self._dirty = True
        if self.stale is not None:
            self.stale = None
            stale.mark(self.summary, False)

    def mark_stale(self, reason: str) -> None:
        """The engine is gone: its last rates and latencies stay, greyed and said to be old."""
        self.stale = reason
        stale.mark(self.summary, True)
        self._show_summary()

    def _show_summary(self) -> None:
        frame = self.last_stats
        if frame is None:
            return
        text = (f"gen {frame.generation_tokens_per_s:,.0f} tok/s · prompt "
                f"{frame.prompt_tokens_per_s:,.0f} tok/s · TTFT p50/p90 {_ms(frame.ttft_s.p50)}/"
                f"{_ms(frame.ttft_s.p90)} · ITL p50/p90 {_ms(frame.itl_s.p50)}/"
                f"{_ms(frame.itl_s.p90)} · KV {_pct(frame.kv_usage)}")
        if self.stale is not None:
            text = stale.plain(text)
        if text != self.summary.text():
            self.summary.setText(text)
            self.summary.setToolTip(text)  # the label clips in a narrow window

    def mark_not_reported(self, key: str, text: str) -> None:
        """A plot whose data the source lacks says so in its title (never drawn as zero)."""
        plot = self.plots[key]
        plot.setTitle(text, size="8pt", color="#c8a050")
        self.not_reported[key] = text

    # -- view -----------------------------------------------------------------------------------
    def set_window(self, name: str) -> None:
        if name in WINDOWS and self.window.currentText() != name:
            self.window.setCurrentText(name)  # re-enters through currentTextChanged
            return
        self.following = True
        self._dirty = True
        self._ranges.clear()
        self.windowChanged.emit(name)
        self.refresh()

    def _user_moved(self, *_args) -> None:
        if not self._setting_range:
            self.following = False  # pan/zoom by hand: stop following the newest data

    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self._show_summary()
        s = self.steps
        t = s.times()
        for name in ("prefill", "decode", "budget", "running", "waiting"):
            self._set(name, t, s.values(name), max_gap=STEP_GAP_S)
        self._set("preempted", self.frames.times(), self.frames.values("preempted"))
        self._set("kv", self.kv.times(), self.kv.values("usage"))
        st = self.stats.times()
        for name in ("prompt", "gen", "ttft", "itl"):
            self._set(name, st, self.stats.values(name))
        if self.following:
            self._follow()

    def _set(self, name: str, t: np.ndarray, v: np.ndarray,
             max_gap: float | None = None) -> None:
        """A curve's points, broken (not joined by a ramp) where a value is missing or, with
        max_gap, where no sample came for longer than that."""
        if max_gap is not None:
            t, v = with_gaps(t, v, max_gap)
        if np.isfinite(v).all():
            self.curves[name].setData(t, v, skipFiniteCheck=True)
        else:
            self.curves[name].setData(t, v, connect="finite")

    def _follow(self) -> None:
        ends = [x.times()[-1] for x in (self.steps, self.kv, self.stats) if len(x)]
        if not ends:
            return
        self._setting_range = True
        try:
            lo, hi = x_range(max(ends), self.window.currentText())
            if self._ranges.get("x") != (lo, hi):
                self._ranges["x"] = (lo, hi)
                self.plots["batch"].setXRange(lo, hi, padding=0.02)
            for key in ("batch", "queues", "tput", "latency"):
                self._fit_y(key, lo, hi)
        finally:
            self._setting_range = False

    def _fit_y(self, key: str, lo: float, hi: float) -> None:
        """From 0 to a nice ceiling over what the x range shows; moves only when crossed."""
        top = 0.0
        for item in self.plots[key].listDataItems():
            x, y = item.xData, item.yData
            if x is None or not len(x):
                continue
            shown = y[(x >= lo) & (x <= hi) & np.isfinite(y)]
            if len(shown):
                top = max(top, float(shown.max()))
        y_range = (0.0, nice_ceiling(top * 1.05))
        if self._ranges.get(key) != y_range:
            self._ranges[key] = y_range
            self.plots[key].setYRange(*y_range, padding=0)

    def clear(self) -> None:
        for s in (self.steps, self.frames, self.kv, self.stats):
            s.clear()
        self.t0, self.last_step, self._dirty = None, -1, True
        self.last_stats, self.stale = None, None
        self.summary.setText("")
        stale.mark(self.summary, False)
        self._ranges.clear()
        self.refresh()


def with_gaps(t: np.ndarray, v: np.ndarray, max_gap: float) -> tuple[np.ndarray, np.ndarray]:
    """t and v with a NaN point inserted wherever consecutive samples are more than max_gap
    seconds apart (the engine was idle: no steps), so the line breaks there."""
    if len(t) < 2:
        return t, v
    idx = np.nonzero(np.diff(t) > max_gap)[0] + 1
    if not len(idx):
        return t, v
    mid = (t[idx - 1] + t[idx]) / 2
    return np.insert(t, idx, mid), np.insert(v, idx, np.nan)


def _legend_title(title: str, names: list[str]) -> str:
    """A plot's title with its curves' names in their colours (the legend, off the data)."""
    return title + " &nbsp; " + " ".join(f"<span style='color:{PEN[n]}'>━ {n}</span>"
                                         for n in names)


def _pct(x: float | None) -> str:
    return "not reported" if x is None else f"{100 * x:.0f} %"  # a source without it: never 0


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1000:.0f} ms"

