"""Open a trace, replay it against the settings in the controls or against an OpenAI-compatible
server (`kvscope trace replay [--url]` in a QProcess: the GUI stays live, the server replay's
progress shows as it goes), overlay the two runs, and compare two runs (`kvscope trace
compare`): a table of ratios and TTFT / inter-token latency CDFs side by side."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from PySide6.QtCore import QProcess, Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.engine_process import engine_qprocess
from kvscope.app.traces.cdf_plot import TraceCdfPlot
from kvscope.app.traces.file import read_series
from kvscope.app.traces.narrow import breakable, never_widen
from kvscope.app.traces.plot import TraceOverlayPlot
from kvscope.app.traces.progress import ProgressReader
from kvscope.app.traces.url_form import API_KEY_ENV, ReplayUrlForm
from kvscope.ipc.trace_format import TraceError

# How the trace header's KV rotation reads after the dtype (traces before rotation: none).
ROTATION_SUFFIX = {"hadamard": " + rotated", "calibrated": " + rotated, K-balanced"}
COMPARE_KEYS = ("duration_s", "throughput_tok_s", "steps", "ttft_p50_ms", "ttft_p90_ms",
                "itl_p50_ms", "itl_p90_ms", "preemptions", "kv_usage_peak", "kv_usage_mean",
                "internal_waste_mean", "output_tokens")
# compare's serving metrics, for runs against a server (the engine rows mean nothing there).
SERVING_KEYS = ("succeeded", "failed", "request_throughput", "output_throughput",
                "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
                "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p90_ms",
                "e2e_p99_ms", "duration_s", "output_tokens")


def trace_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvscope", "trace", *args]


def export_paths(json_path: str) -> tuple[str, str]:
    """The Perfetto JSON the user chose and the CSV written beside it (same stem)."""
    path = Path(json_path)
    if path.suffix.lower() != ".json":
        path = path.with_name(path.name + ".json")
    return str(path), str(path.with_suffix(".csv"))


def default_export_path(trace: str) -> str:
    return str(Path(trace).with_suffix(".perfetto.json"))


def replay_output_path(trace: str) -> str:
    stem = str(Path(trace).with_suffix(""))
    millis = int(time.time() * 1000) % 1000
    return f"{stem}.replay-{time.strftime('%Y%m%d-%H%M%S')}-{millis:03d}.jsonl"


def _last_json(data: bytes):
    for line in reversed(data.decode(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _ratio(a: object, b: object) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
        return b / a
    return None


def _summary_rows(result: dict) -> list[tuple[str, object, object, float | None]]:
    """Two kvscope runs: the summaries' numbers, the engine's first."""
    a, b, ratio = result.get("a", {}), result.get("b", {}), result.get("ratio", {})
    keys = [k for k in COMPARE_KEYS if k in a] + [k for k in ratio if k not in COMPARE_KEYS]
    return [(k, a.get(k), b.get(k), ratio.get(k)) for k in keys]


def _serving_rows(a: dict, b: dict) -> list[tuple[str, object, object, float | None]]:
    """A run against a server: compare's serving metrics (throughput, latency percentiles)."""
    def get(run: dict, key: str) -> object:
        return run.get("metrics", {}).get(key, run.get(key))
    return [(k, get(a, k), get(b, k), _ratio(get(a, k), get(b, k))) for k in SERVING_KEYS]


class TraceReplayPanel(QWidget):
    """engine_args: a callable returning the engine options to replay with (the controls'
    settings as CLI flags); the trace's own model is used when they name none."""

    finished = Signal(bool)  # replay + compare done (True) or failed (False)
    exported = Signal(bool)  # `kvscope trace export` wrote the files (True) or failed

    def __init__(self, engine_args=None, parent: QWidget | None = None,
                 start_folder=None) -> None:
        super().__init__(parent)
        self.engine_args = engine_args or list
        # Where "Open trace…" starts: the folder recordings are saved in (a callable).
        self.start_folder = start_folder or (lambda: str(Path.home()))
        self.export_outputs: tuple[str, str] | None = None
        self.trace: str | None = None
        self.replay_path: str | None = None
        self.recorded = None
        self.summary: dict | None = None
        self.comparison: dict | None = None
        self.proc: QProcess | None = None
        self._stage = ""
        self._out = b""
        self._err = b""
        self.open_button = QPushButton("Open trace…")
        self.open_button.clicked.connect(self.browse)
        self.replay_button = QPushButton("Replay with current settings")
        self.replay_button.setObjectName("traceReplayButton")
        self.replay_button.setEnabled(False)
        self.replay_button.clicked.connect(self.replay)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.export_button = QPushButton("Export…")
        self.export_button.setObjectName("traceExportButton")
        self.export_button.setToolTip("Perfetto JSON (ui.perfetto.dev) and a CSV beside it")
        self.export_button.setEnabled(False)
        self.export_button.clicked.connect(self.export)
        self.trace_label = never_widen(QLabel("no trace open"))
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(6)
        self.progress.hide()
        self.status = QLabel("")
        self.status.setObjectName("traceReplayStatus")
        never_widen(self.status)
        self.plot = TraceOverlayPlot()
        self.cdf_plot = TraceCdfPlot()
        self.url_form = ReplayUrlForm()
        self.url_button = QPushButton("Replay against server")
        self.url_button.setObjectName("traceReplayUrlButton")
        self.url_button.setToolTip("stream the trace's requests, at their recorded times, to an "
                                   "OpenAI-compatible server (vLLM, SGLang, llama-server, "
                                   "Ollama, kvscope serve)")
        self.url_button.setEnabled(False)
        self.url_button.clicked.connect(self.replay_url)
        self.compare_button = QPushButton("Compare with…")
        self.compare_button.setToolTip("another run of the same requests (a replay, another "
                                       "server's run) against the open trace")
        self.compare_button.setEnabled(False)
        self.compare_button.clicked.connect(self.browse_compare)
        self.progress_reader = ProgressReader()
        self.compared_names: list[str] = []
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["", "recorded", "replay", "ratio"])
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        # Columns share the dock's width (eliding) instead of widening the panel sideways.
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setMinimumSectionSize(40)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setMinimumWidth(0)
        buttons = QGridLayout()  # two by two: fits a narrow dock
        buttons.addWidget(self.open_button, 0, 0)
        buttons.addWidget(self.export_button, 0, 1)
        buttons.addWidget(self.replay_button, 1, 0)
        buttons.addWidget(self.cancel_button, 1, 1)
        buttons.addWidget(self.compare_button, 2, 0)
        server_box = QGroupBox("Against a server (OpenAI API)")
        server_layout = QVBoxLayout(server_box)
        server_layout.addWidget(self.url_form)
        server_layout.addWidget(self.url_button)
        plots = QTabWidget()
        plots.addTab(self.plot, "steps")
        plots.addTab(self.cdf_plot, "latency CDFs")
        self.plot_tabs = plots
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(buttons)
        layout.addWidget(server_box)
        layout.addWidget(self.trace_label)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(plots, 2)
        layout.addWidget(self.table, 1)

    @property
    def busy(self) -> bool:
        return self.proc is not None

    # -- opening --------------------------------------------------------------------------
    def browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open trace", self.start_folder(),
                                              "kvscope traces (*.jsonl);;All files (*)")
        if path:
            self.open_trace(path)

    def open_trace(self, path: str) -> bool:
        try:
            series = read_series(path)
        except (OSError, TraceError) as exc:
            self.trace_label.setText(f"could not open the trace: {exc}")
            return False
        self.trace, self.recorded = path, series
        self.replay_path = self.summary = self.comparison = None
        self.plot.clear_runs()
        self.plot.show_run("recorded", series)
        self.table.setRowCount(0)
        h = series.header
        note = f" (line {series.cut_line} cut off at the end)" if series.truncated else ""
        self.trace_label.setToolTip(path)  # a path has no spaces to wrap at: the name only
        self.trace_label.setText(
            f"{breakable(Path(path).name)}{note}\n{h.model} · block {h.block_size} · KV "
            f"{h.kv_dtype}{ROTATION_SUFFIX.get(h.kv_rotation, '')}"
            f" · {len(series.t)} steps")
        self.cdf_plot.clear()
        self._set_busy(self.busy)
        self.status.setText("")
        return True

    # -- export -------------------------------------------------------------------------
    def export(self) -> None:
        """Ask where to write the Perfetto JSON (the CSV goes beside it), then export."""
        if self.trace is None or self.busy:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export trace (Perfetto JSON + CSV)",
                                              default_export_path(self.trace),
                                              "Perfetto JSON (*.json)")
        if path:
            self.export_to(path)

    def export_to(self, json_path: str) -> None:
        """`kvscope trace export` in a QProcess (the app never imports the engine)."""
        if self.trace is None or self.busy:
            return
        self.export_outputs = export_paths(json_path)
        out_json, out_csv = self.export_outputs
        self._start("export", trace_command("export", self.trace, "-o", out_json,
                                            "--csv", out_csv))
        self.status.setText("exporting…")

    def on_exported(self, code: int) -> None:
        self._set_busy(False)
        if code != 0 or self.export_outputs is None:
            tail = "\n".join(self._err.decode(errors="replace").strip().splitlines()[-4:])
            self.status.setText(f"export failed (exit code {code})" + (f":\n{tail}" if tail
                                                                      else ""))
            self.exported.emit(False)
            return
        out_json, out_csv = self.export_outputs
        self.status.setText(f"exported {breakable(Path(out_json).name)} and "
                            f"{breakable(Path(out_csv).name)}")
        self.status.setToolTip(f"{out_json}\n{out_csv}")
        self.exported.emit(True)

    # -- replay and compare -------------------------------------------------------------
    def replay(self) -> None:
        if self.trace is None or self.busy:
            return
        args = list(self.engine_args())
        if "--model" not in args and self.recorded.header.model:
            args = ["--model", self.recorded.header.model, *args]
        self.replay_path = replay_output_path(self.trace)
        self.summary = self.comparison = None
        self.plot.clear_run("replay")
        self.table.setRowCount(0)
        self._start("replay", trace_command("replay", self.trace, "--speed", "max", "--json",
                                            "-o", self.replay_path, *args))
        self.status.setText("replaying (as fast as the engine goes)…")

    def replay_url(self) -> None:
        """`kvscope trace replay TRACE --url ...` with progress lines, then compare."""
        if self.trace is None or self.busy:
            return
        if not self.url_form.url_edit.text().strip():
            self.status.setText("give the server's URL, e.g. http://127.0.0.1:8000/v1")
            return
        self.replay_path = replay_output_path(self.trace)
        self.summary = self.comparison = None
        self.plot.clear_run("replay")
        self.cdf_plot.clear()
        self.table.setRowCount(0)
        self.progress_reader = ProgressReader()
        self.progress.setRange(0, 0)
        self._start("replay_url", trace_command("replay", self.trace, *self.url_form.replay_args(),
                                                "--progress", "--json", "-o", self.replay_path),
                    api_key=self.url_form.api_key())
        self.status.setText(f"replaying against {self.url_form.url_edit.text().strip()}…")

    def browse_compare(self) -> None:
        if self.trace is None or self.busy:
            return
        path, _ = QFileDialog.getOpenFileName(self, "Compare with", str(Path(self.trace).parent),
                                              "kvscope traces (*.jsonl);;All files (*)")
        if path:
            self.compare_with(path)

    def compare_with(self, other: str) -> None:
        """`kvscope trace compare OPEN OTHER --json`: the table and the CDFs."""
        if self.trace is None or self.busy:
            return
        self.comparison = None
        self._compare(other)

    def _compare(self, other: str, say: bool = True) -> None:
        """say: whether the status line says so (after a replay it keeps the replay's)."""
        self.compared_names = [Path(self.trace or "").name, Path(other).name]
        self._start("compare", trace_command("compare", self.trace or "", other, "--json"))
        if say:
            self.status.setText(f"comparing with {breakable(Path(other).name)}…")

    def _start(self, stage: str, argv: list[str], api_key: str | None = None) -> None:
        self._stage, self._out, self._err = stage, b"", b""
        proc = engine_qprocess(self)
        if api_key is not None:  # the key in the child's environment, never in its argv
            env = proc.processEnvironment()
            env.remove(API_KEY_ENV)
            if api_key:
                env.insert(API_KEY_ENV, api_key)
            proc.setProcessEnvironment(env)
        proc.readyReadStandardOutput.connect(self._read)
        proc.readyReadStandardError.connect(self._read)
        proc.finished.connect(self._finished)
        proc.errorOccurred.connect(self._error)
        self.proc = proc
        self._set_busy(True)
        proc.start(argv[0], argv[1:])

    def _read(self) -> None:
        if self.proc is not None:
            self._out += bytes(self.proc.readAllStandardOutput())
            err = bytes(self.proc.readAllStandardError())
            self._err += err
            if self._stage == "replay_url" and err:
                self._show_progress(self.progress_reader.feed(err))

    def _show_progress(self, p) -> None:
        if p is None:
            return
        self.progress.setRange(0, max(1, p.total))
        self.progress.setValue(p.done)
        self.status.setText(f"{p.done}/{p.total} requests done, {p.in_flight} in flight"
                            + (f", {p.errors} failed" if p.errors else ""))

    def _finished(self, code: int, _status) -> None:
        self._read()
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.deleteLater()
        if self._stage == "export":
            self.on_exported(code)
            return
        result = _last_json(self._out) if code == 0 else None
        if result is None:
            tail = "\n".join(self._err.decode(errors="replace").strip().splitlines()[-4:])
            self._fail(f"{self._stage} failed (exit code {code})" + (f":\n{tail}" if tail else ""))
            return
        if self._stage in ("replay", "replay_url"):
            self.on_replayed(result)
        else:
            self.on_compared(result)

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.proc is not None:
            proc, self.proc = self.proc, None
            message = f"could not start {self._stage}: {proc.errorString()}"
            if self._stage == "export":
                self._set_busy(False)
                self.status.setText(message)
                self.exported.emit(False)
            else:
                self._fail(message)
            proc.deleteLater()

    def on_replayed(self, summary: dict) -> None:
        self.summary = summary
        try:
            self.plot.show_run("replay", read_series(self.replay_path))
        except (OSError, TraceError) as exc:
            self._fail(f"could not read the replay: {exc}")
            return
        rejected = summary.get("rejected") or summary.get("request_errors") or {}
        same = summary.get("outputs_identical")
        outputs = ("outputs identical" if same else "outputs differ" if same is False
                   else f"outputs not compared: {summary.get('outputs_not_compared')}")
        where = (f" against {summary.get('url')} ({summary.get('served_model')})"
                 if summary.get("url") else f" ({summary.get('steps')} steps)")
        failed = "failed" if summary.get("url") else "rejected"
        early = summary.get("ended_early") or 0
        self.status.setText(
            f"replayed {summary.get('requests')} requests{where} in "
            f"{_fmt(summary.get('duration_s'))} s, {_fmt(summary.get('throughput_tok_s'))} "
            f"tok/s; {outputs}" + (f"; {len(rejected)} {failed}" if rejected else "")
            + (f"; {early} ended early" if early else "")
            + (f"; {summary.get('stopped')}" if summary.get("stopped") else "")
            + f"\n→ {breakable(Path(self.replay_path).name)}")
        self.status.setToolTip("\n".join([self.replay_path or "", *(
            f"{rid}: {message}" for rid, message in list(rejected.items())[:10])]))
        self._compare(self.replay_path or "", say=False)

    def on_compared(self, result: dict) -> None:
        self._set_busy(False)
        self.comparison = result
        runs = result.get("runs") or []
        if any(r.get("server_url") for r in runs[:2]):
            self._fill_table(_serving_rows(runs[0], runs[1]))
        else:
            self._fill_table(_summary_rows(result))
        self.cdf_plot.show_runs(self.compared_names, result.get("cdf") or [])
        self.show_like_for_like(result)
        self.finished.emit(True)

    def show_like_for_like(self, result: dict) -> None:
        """Say, above the table and in its ratio column's title, why the ratios may not
        measure the settings alone (compare's pairs[0].not_like_for_like)."""
        pairs = result.get("pairs") or [{}]
        notes = [str(n) for n in (pairs[0].get("not_like_for_like") or [])]
        header = self.table.horizontalHeaderItem(3)
        base = self.status.text().split("not like for like:")[0].rstrip("\n")
        if notes:
            header.setText("ratio (not like for like)")
            header.setToolTip("\n".join(notes))
            self.status.setText((base + "\n" if base else "") + "not like for like: "
                                + "; ".join(notes))
        else:
            header.setText("ratio")
            header.setToolTip("")
            self.status.setText(base)

    def _fill_table(self, rows: list[tuple[str, object, object, float | None]]) -> None:
        self.table.setRowCount(len(rows))
        for row, (key, a, b, r) in enumerate(rows):
            for col, text in enumerate((key, _fmt(a), _fmt(b), "—" if r is None else f"{r:.3g}×")):
                item = QTableWidgetItem(text)
                item.setToolTip(text)  # the stretched columns may elide it
                self.table.setItem(row, col, item)

    def _fail(self, message: str) -> None:
        self._set_busy(False)
        self.status.setText(message)
        self.finished.emit(False)

    def _set_busy(self, busy: bool) -> None:
        self.progress.setVisible(busy)
        if not busy:
            self.progress.setRange(0, 0)
        self.cancel_button.setEnabled(busy)
        self.open_button.setEnabled(not busy)
        ready = not busy and self.trace is not None
        for button in (self.replay_button, self.export_button, self.url_button,
                       self.compare_button):
            button.setEnabled(ready)
        self.url_form.set_enabled(not busy)

    def cancel(self) -> None:
        if self.stop():
            self._fail("cancelled")

    def stop(self) -> bool:
        """Kill a running replay/compare and wait for it; True if one was running."""
        proc, self.proc = self.proc, None
        if proc is None:
            return False
        proc.finished.disconnect(self._finished)
        proc.errorOccurred.disconnect(self._error)
        if proc.state() != QProcess.ProcessState.NotRunning:
            proc.kill()
            proc.waitForFinished(5000)
        proc.deleteLater()
        return True

    def closeEvent(self, event) -> None:
        self.stop()
        super().closeEvent(event)

