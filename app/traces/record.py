"""Record the session to a trace: a start/stop button driving the bridge's worker
(EngineClient.trace_start / trace_stop), the file, and its size (stat'ed every second)."""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QStandardPaths, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.fmt import human_bytes
from kvscope.app.traces.narrow import breakable, never_widen

SIZE_INTERVAL_MS = 1000


def default_trace_path(trace_dir: str | None = None) -> str:
    """<the engine's trace folder, else Documents or home>/kvscope-YYYYmmdd-HHMMSS.jsonl
    (the engine records only under its trace folder, which its hello names)."""
    if trace_dir:
        folder = Path(trace_dir)
    else:
        docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
        folder = Path(docs) if docs and Path(docs).is_dir() else Path.home()
    return str(folder / time.strftime("kvscope-%Y%m%d-%H%M%S.jsonl"))


class TraceRecordPanel(QWidget):
    """`bridge` needs trace_start(path, include_prompts), trace_stop() and the signals
    traceChanged(TraceResult) and commandFailed(command, message)."""

    recordingChanged = Signal(bool)

    def __init__(self, bridge, parent: QWidget | None = None, *, ask_path: bool = True) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.ask_path = ask_path  # tests set False: no file dialog
        self.recording = False
        self.pending = False
        self.path: str | None = None
        self.size_bytes: int | None = None
        self.trace_dir: str | None = None  # the engine's, from its hello
        self.record_button = QPushButton("● Record trace")
        self.record_button.setObjectName("traceRecordButton")
        self.record_button.clicked.connect(self.toggle)
        self.path_edit = QLineEdit(default_trace_path())
        self.browse_button = QPushButton("…")
        self.browse_button.clicked.connect(self.browse)
        self.no_prompts = QCheckBox("no prompts (record prompt lengths only)")
        self.file_label = never_widen(QLabel(""))
        self.size_label = QLabel("")
        self.size_label.setObjectName("traceSize")
        self.size_timer = QTimer(self)
        self.size_timer.setInterval(SIZE_INTERVAL_MS)
        self.size_timer.timeout.connect(self.update_size)
        row = QHBoxLayout()
        row.addWidget(self.path_edit, 1)
        row.addWidget(self.browse_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.no_prompts)
        layout.addWidget(self.record_button)
        layout.addWidget(self.file_label)
        layout.addWidget(self.size_label)
        bridge.traceChanged.connect(self.on_trace_changed)
        bridge.helloReceived.connect(self.on_hello)
        bridge.commandFailed.connect(self.on_command_failed)

    def browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Record trace to", self.path_edit.text(),
                                              "kvscope traces (*.jsonl)")
        if path:
            self.path_edit.setText(path)

    def toggle(self) -> None:
        if self.pending:
            return
        if self.recording:
            self.pending = True
            self.record_button.setEnabled(False)
            self.bridge.trace_stop()
            return
        path = self.path_edit.text().strip() or default_trace_path(self.trace_dir)
        if Path(path).exists():  # the engine refuses existing files: pick a fresh name
            path = default_trace_path(self.trace_dir)
            self.path_edit.setText(path)
        self.pending = True
        self.record_button.setEnabled(False)
        self.bridge.trace_start(path, not self.no_prompts.isChecked())

    def on_trace_changed(self, result) -> None:
        self.pending = False
        self.record_button.setEnabled(True)
        self.recording = bool(result.recording)
        if result.path:
            self.path = result.path
        self.record_button.setText("■ Stop recording" if self.recording else "● Record trace")
        self.path_edit.setEnabled(not self.recording)
        self.browse_button.setEnabled(not self.recording)
        self.no_prompts.setEnabled(not self.recording)
        if self.recording:
            self.file_label.setText(f"recording to {breakable(Path(self.path).name)}")
            self.file_label.setToolTip(self.path)  # a path has no spaces to wrap at
            self.size_timer.start()
        else:
            self.size_timer.stop()
            self.file_label.setText(f"saved {breakable(Path(self.path).name)}" if self.path
                                    else "not recording")
            self.file_label.setToolTip(self.path or "")
            self.path_edit.setText(default_trace_path(self.trace_dir))
        self.update_size()
        self.recordingChanged.emit(self.recording)

    def traces_folder(self) -> str:
        """Where recordings are saved: the last one's folder, else the engine's trace folder,
        else the folder the path field proposes."""
        if self.path:
            return str(Path(self.path).parent)
        if self.trace_dir:
            return self.trace_dir
        return str(Path(self.path_edit.text() or default_trace_path()).parent)

    def on_hello(self, hello) -> None:
        """Propose a file in the engine's trace folder, unless the user typed a path."""
        proposed = default_trace_path(self.trace_dir)
        self.trace_dir = hello.trace_dir
        if not self.recording and Path(self.path_edit.text()).parent == Path(proposed).parent:
            self.path_edit.setText(default_trace_path(self.trace_dir))

    def on_command_failed(self, command: str, message: str) -> None:
        if command in ("trace_start", "trace_stop"):
            self.pending = False
            self.record_button.setEnabled(True)
            self.file_label.setText(f"{command} failed: {message}")

    def update_size(self) -> None:
        if not self.path:
            self.size_label.setText("")
            return
        try:
            size = Path(self.path).stat().st_size
        except OSError:
            self.size_label.setText("(no file yet)")
            return
        self.size_bytes = size
        self.size_label.setText(f"{human_bytes(size)} ({size:,} bytes)")

    def stop_timers(self) -> None:
        self.size_timer.stop()

    def closeEvent(self, event) -> None:
        self.stop_timers()
        super().closeEvent(event)
