"""Two runs of a session overlaid: batch tokens per step and KV usage against the time since
the trace started, "recorded" and "replay" in two colours."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from kvscope.app.plots.axes import use_sparse_y_axis

COLORS = {"recorded": "#5ec8f0", "replay": "#f0a35e"}


class TraceOverlayPlot(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.setBackground("#16181d")
        self.tokens_plot = self.view.addPlot(row=0, col=0)
        self.tokens_plot.setLabel("left", "batch tokens / step")
        self.kv_plot = self.view.addPlot(row=1, col=0)
        self.kv_plot.setLabel("left", "KV usage (%)")
        self.kv_plot.setLabel("bottom", "time since start (s)")
        for plot in (self.tokens_plot, self.kv_plot):
            use_sparse_y_axis(plot)  # small plots in a narrow dock: labels that fit
        # Percent and seconds read better as plain numbers than with an "(x0.001)" SI factor.
        for plot in (self.tokens_plot, self.kv_plot):
            for side in ("left", "bottom"):
                plot.getAxis(side).enableAutoSIPrefix(False)
        self.kv_plot.setXLink(self.tokens_plot)
        self.tokens_plot.addLegend(offset=(-10, 10))
        self.curves: dict[tuple[str, str], pg.PlotDataItem] = {}
        for run, color in COLORS.items():
            pen = pg.mkPen(color, width=1.5)
            self.curves[run, "tokens"] = self.tokens_plot.plot([], [], pen=pen, name=run)
            self.curves[run, "kv"] = self.kv_plot.plot([], [], pen=pen)
        self.setMinimumHeight(260)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view)

    def show_run(self, run: str, series) -> None:
        """run: "recorded" or "replay"; series: app.traces.file.TraceSeries."""
        self.curves[run, "tokens"].setData(series.t, series.tokens)
        self.curves[run, "kv"].setData(series.t, [u * 100 for u in series.kv_usage])

    def points(self, run: str) -> int:
        x, _ = self.curves[run, "tokens"].getData()
        return 0 if x is None else len(x)

    def clear_run(self, run: str) -> None:
        self.curves[run, "tokens"].setData([], [])
        self.curves[run, "kv"].setData([], [])

    def clear_runs(self) -> None:
        for run in COLORS:
            self.clear_run(run)
