"""The long-context box: the last saved passkey grid as a small heatmap per KV setting, its
date and model, and a button that measures it again in the background.

Put in the Engine tab under the KV dtype control and in the KV calculator; highlight(dtype)
marks the maps of the dtype chosen there. Both boxes share one runner, so a run started in
one shows its progress in both, and both reload the grid when it ends. Before a run the box
says how long one takes (the last run's time, else a first guess); during one, the child's
own estimate of the time left, and Cancel ends it.
"""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtWidgets import (
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.kv_grid import saved_grid
from kvscope.app.kv_grid.heatmap import Heatmap
from kvscope.app.kv_grid.runner import CANCELLED, GridRunner, shared_runner

DTYPE_ORDER = ("float32", "bfloat16", "float16", "int8", "fp8")
FIRST_GUESS_MIN = 10  # a --quick grid on 2 CPU cores, before this machine has run one


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def estimate_text(grid: saved_grid.SavedGrid | None) -> str:
    """How long Measure will take, said before it starts."""
    if grid is not None and grid.seconds > 0 and not grid.partial:
        return (f"Measure takes about {minutes(grid.seconds)} here (the last run), at full "
                "CPU in its own process; Cancel stops it.")
    return (f"Measure takes about {FIRST_GUESS_MIN} min on 2 CPU cores, at full CPU in its "
            "own process; Cancel stops it.")


def _title(setting: saved_grid.SettingGrid) -> str:
    if setting.kv_rotation == "none" and setting.kv_anchor_tokens == 0 \
            and setting.kv_dtype in ("int8", "fp8"):
        return f"{setting.kv_dtype} none"
    return setting.name


class KVGridBox(QGroupBox):
    def __init__(self, path: Path | None = None, runner: GridRunner | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__("Long context: passkey found, per KV dtype", parent)
        self.setObjectName("kvGridBox")
        self.path = path or saved_grid.saved_path()
        self.runner = runner or shared_runner()
        self.grid: saved_grid.SavedGrid | None = None
        self.maps: list[Heatmap] = []
        self.chosen: str | None = None
        self.caption = QLabel("")
        self.caption.setObjectName("note")
        self.caption.setWordWrap(True)
        self.maps_holder = QWidget()
        self.maps_layout = QGridLayout(self.maps_holder)
        self.maps_layout.setContentsMargins(0, 0, 0, 0)
        self.maps_layout.setHorizontalSpacing(10)
        self.measure_button = QPushButton("Measure")
        self.measure_button.setObjectName("kvGridMeasure")
        self.measure_button.setToolTip(
            "run `kvscope kv-accuracy --task passkey --quick` in the background (its own "
            "process and model; a few minutes on 2 cores)")
        self.measure_button.clicked.connect(self.measure)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("kvGridCancel")
        self.cancel_button.setToolTip("Stop the measurement: its process ends; the settings "
                                      "it finished are kept as a partial grid")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.hide()
        self.started_at: float | None = None
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setMaximumHeight(12)
        self.progress.hide()
        self.status = QLabel("")
        self.status.setObjectName("note")
        self.status.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.progress, 1)
        row.addWidget(self.measure_button)
        row.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.caption)
        layout.addWidget(self.maps_holder)
        layout.addLayout(row)
        layout.addWidget(self.status)
        self.runner.started.connect(self._show_started)
        self.runner.progressed.connect(self._show_progress)
        self.runner.finished.connect(self._show_finished)
        if self.runner.is_running():
            self._show_started()
        self.reload()

    # -- slots ------------------------------------------------------------------------------
    def reload(self) -> None:
        """Read the saved grid again; a missing or corrupt one leaves a message, no maps."""
        self.grid, message = saved_grid.load(self.path)
        self._clear_maps()
        if not self.runner.is_running():
            self.status.setText(estimate_text(self.grid))
        if self.grid is None:
            self.caption.setText(message)
            return
        g = self.grid
        self.caption.setText(
            f"{g.model}, {g.date.replace('T', ' ')[:16]} UTC: share of keys found (red none, "
            f"green all) at each length (rows) and depth {_depths(g.depths)}; "
            f"a dot: an answer differed from float32 KV's"
            + (" (partial run: the settings it finished)" if g.partial else ""))
        self._add_maps(g)
        self.highlight(self.chosen)

    def highlight(self, dtype: str | None) -> None:
        self.chosen = dtype
        for m in self.maps:
            m.set_highlighted(m.grid.kv_dtype == dtype)

    def measure(self) -> None:
        self.runner.start()

    def cancel(self) -> None:
        self.runner.cancel()

    # -- internals --------------------------------------------------------------------------
    def _clear_maps(self) -> None:
        for m in self.maps:
            self.maps_layout.removeWidget(m)
            m.deleteLater()
        self.maps = []

    def _add_maps(self, g: saved_grid.SavedGrid) -> None:
        """One row per dtype: its defaults, then its `none` setting beside them (two maps
        wide: the side dock is narrow)."""
        dtypes = sorted({s.kv_dtype for s in g.settings},
                        key=lambda d: DTYPE_ORDER.index(d) if d in DTYPE_ORDER else 99)
        for r, dtype in enumerate(dtypes):
            for c, setting in enumerate(g.for_dtype(dtype)[:2]):
                m = Heatmap(setting, g.lengths, g.depths, _title(setting))
                self.maps_layout.addWidget(m, r, c)
                self.maps.append(m)

    def _show_started(self) -> None:
        self.started_at = time.monotonic()
        self.measure_button.setEnabled(False)
        self.cancel_button.show()
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.progress.show()
        guess = estimate_text(self.grid).split(",")[0].removeprefix("Measure takes ")
        self.status.setText(f"measuring in the background: {guess} in all ...")

    def _show_progress(self, percent: int, text: str) -> None:
        self.progress.setValue(percent)
        spent = "" if self.started_at is None else \
            f", {minutes(time.monotonic() - self.started_at)} so far"
        self.status.setText(f"measuring: {percent} %, {text.replace('eta', 'time left')}{spent}")

    def _show_finished(self, ok: bool, message: str) -> None:
        self.started_at = None
        self.measure_button.setEnabled(True)
        self.cancel_button.hide()
        self.progress.hide()
        self.reload()
        if message == CANCELLED:
            self.status.setText("cancelled")
        elif not ok:
            self.status.setText(message)


def _depths(depths: list[float]) -> str:
    return " ".join(f"{d:.0%}" for d in depths) + " (columns)"
