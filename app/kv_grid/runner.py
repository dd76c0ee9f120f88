"""Runs the passkey grid in the background: `kvscope kv-accuracy --task passkey --quick --json`
in a QProcess (its own process and model, niced where `nice` exists), so neither the window
nor the engine waits for it. Progress comes from the command's stderr lines
("[kv-accuracy] progress 42% eta 3m10s int8"); the grid, once the process ends, from the file
it saved. One runner is shared by every view (shared_runner), so two buttons never start two
runs. cancel() ends the child (SIGTERM, then SIGKILL if it lingers) and the run ends as
"cancelled", never as a failure.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QObject, QProcess, QTimer, Signal

from kvscope.app.engine_process import exit_text
from kvscope.app.kv_grid.saved_grid import saved_path

PROGRESS = re.compile(r"progress (\d+)% eta (\S+)(?: (.*))?")
KILL_AFTER_MS = 3000  # a cancelled child that has not ended on SIGTERM by then is killed
CANCELLED = "cancelled"


def command(save: Path, extra: list[str] | None = None) -> list[str]:
    """The program and arguments: the window's own Python running the launcher."""
    args = [sys.executable, "-m", "kvscope", "kv-accuracy", "--task", "passkey", "--quick",
            "--json", "--save", str(save), *(extra or [])]
    nice = shutil.which("nice")
    return [nice, "-n", "10", *args] if nice else args


def parse_progress(line: str) -> tuple[int, str, str] | None:
    """(percent, eta, setting) from one progress line, None for any other line."""
    m = PROGRESS.search(line)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), (m.group(3) or "").strip()


class GridRunner(QObject):
    started = Signal()
    progressed = Signal(int, str)  # percent, "eta 3m10s, int8"
    finished = Signal(bool, str)  # ok, message

    def __init__(self, save: Path | None = None, extra: list[str] | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.save = save or saved_path()
        self.extra = extra or []
        self.process: QProcess | None = None
        self._buffer = ""
        self._last_lines: list[str] = []
        self.cancelled = False
        self._kill_timer = QTimer(self)  # SIGKILL for a cancelled child that lingers
        self._kill_timer.setSingleShot(True)
        self._kill_timer.setInterval(KILL_AFTER_MS)
        self._kill_timer.timeout.connect(self.stop)

    def is_running(self) -> bool:
        return self.process is not None

    def start(self) -> None:
        if self.process is not None:
            return
        program, *args = command(self.save, self.extra)
        proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.SeparateChannels)
        proc.readyReadStandardError.connect(self._read_stderr)
        proc.readyReadStandardOutput.connect(proc.readAllStandardOutput)  # the JSON: unused
        proc.finished.connect(self._ended)
        proc.errorOccurred.connect(self._failed)
        self.process = proc
        self._buffer, self._last_lines, self.cancelled = "", [], False
        proc.start(program, args)
        self.started.emit()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()

    def cancel(self) -> None:
        """End the run the user started: SIGTERM, then SIGKILL if the child lingers."""
        proc = self.process
        if proc is None:
            return
        self.cancelled = True
        proc.terminate()
        self._kill_timer.start()

    def _read_stderr(self) -> None:
        if self.process is None:
            return
        self._buffer += bytes(self.process.readAllStandardError().data()).decode(
            "utf-8", "replace").replace("\r", "\n")
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line.strip():
                self._last_lines = (self._last_lines + [line.strip()])[-3:]
            got = parse_progress(line)
            if got is not None:
                percent, eta, setting = got
                self.progressed.emit(percent, f"eta {eta}" + (f", {setting}" if setting else ""))

    def _ended(self, code: int, status: QProcess.ExitStatus) -> None:
        self._read_stderr()
        proc, self.process = self.process, None
        self._kill_timer.stop()
        if proc is not None:
            proc.deleteLater()
        crashed = status == QProcess.ExitStatus.CrashExit
        if self.cancelled:
            self.finished.emit(False, CANCELLED)
        elif code == 0 and not crashed:
            self.finished.emit(True, "measured")
        else:
            tail = self._last_lines[-1] if self._last_lines else ""
            how = exit_text(code, crashed)
            self.finished.emit(False, f"the measurement {how}" + (f": {tail}" if tail else ""))

    def _failed(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.process is not None:
            self.process = None
            self.finished.emit(False, "could not start the measurement")


_shared: GridRunner | None = None


def shared_runner() -> GridRunner:
    global _shared
    if _shared is None:
        _shared = GridRunner()
        app = QCoreApplication.instance()
        if app is not None:  # a run still going when the window closes ends with it
            app.aboutToQuit.connect(_shared.stop)
    return _shared
