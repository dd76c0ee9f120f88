"""TTFT and inter-token latency as CDFs side by side, one curve per run, from the quantiles
`kvscope trace compare --json` prints ("cdf": per run, sorted ttft_ms and itl_ms)."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from kvscope.app.plots.axes import use_sparse_y_axis

RUN_COLORS = ["#5ec8f0", "#f0a35e", "#8fd16a", "#d16ab8"]
METRICS = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"))


def cdf_xy(sorted_ms: list[float]) -> tuple[list[float], list[float]]:
    """x: the latencies; y: the share of values at or below each (0..1]."""
    n = len(sorted_ms)
    return list(sorted_ms), [(k + 1) / n for k in range(n)]


class TraceCdfPlot(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.setBackground("#16181d")
        self.plots: dict[str, pg.PlotItem] = {}
        for col, (key, label) in enumerate(METRICS):
            plot = self.view.addPlot(row=0, col=col)
            plot.setLabel("bottom", label)
            plot.setLabel("left", "share of requests" if key == "ttft_ms" else "share of gaps")
            plot.setYRange(0, 1)
            use_sparse_y_axis(plot)
            for side in ("left", "bottom"):
                plot.getAxis(side).enableAutoSIPrefix(False)
            self.plots[key] = plot
        self.plots["ttft_ms"].addLegend(offset=(-10, -10))
        self.curves: dict[tuple[int, str], pg.PlotDataItem] = {}
        self.setMinimumHeight(180)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view)

    def show_runs(self, names: list[str], cdf: list[dict]) -> None:
        """names: one label per run; cdf: compare's per-run quantiles."""
        self.clear()
        for k, (name, points) in enumerate(zip(names, cdf, strict=False)):
            pen = pg.mkPen(RUN_COLORS[k % len(RUN_COLORS)], width=1.5)
            for key, _ in METRICS:
                x, y = cdf_xy([float(v) for v in points.get(key) or []])
                self.curves[k, key] = self.plots[key].plot(
                    x, y, pen=pen, name=name if key == "ttft_ms" else None)

    def points(self, run: int, key: str) -> int:
        curve = self.curves.get((run, key))
        if curve is None:
            return 0
        x, _ = curve.getData()
        return 0 if x is None else len(x)

    def clear(self) -> None:
        for plot in self.plots.values():
            plot.clear()
        legend = self.plots["ttft_ms"].legend
        if legend is not None:
            legend.clear()
        self.curves.clear()
