"""A local engine child process (`python -m kvscope.engine.cli.serve`), started without blocking.

The child prints one line `ready <command endpoint> <state endpoint>` on stdout once the model
is loaded; its stderr (logs) is forwarded to ours and its last lines are kept for error
messages. Until it is ready, its stderr is also read for what it is doing (the first start's
model conversion, app.engine_progress): `progressed` carries that to the window. The app never
imports the engine: it only runs it.
"""
from __future__ import annotations

import collections
import os
import signal
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from kvscope.app.engine_progress import ProgressReader

REPO_ROOT = Path(__file__).resolve().parent.parent


def engine_qprocess(parent: QObject) -> QProcess:
    """A QProcess whose Python finds this checkout's engine (also when it is not installed)."""
    proc = QProcess(parent)
    env = QProcessEnvironment.systemEnvironment()
    path = env.value("PYTHONPATH", "")
    env.insert("PYTHONPATH", os.pathsep.join(p for p in (str(REPO_ROOT), path) if p))
    proc.setProcessEnvironment(env)
    return proc
STDERR_LINES = 40


def serve_command(engine_args: list[str]) -> list[str]:
    """argv of the child: a free port on loopback, then the user's engine options."""
    return [sys.executable, "-m", "kvscope.engine.cli.serve", "--host", "127.0.0.1", "--port", "0",
            *engine_args]


def exit_text(code: int, crashed: bool) -> str:
    """How a child ended, in words. On a crash QProcess's exit code is the signal's number
    (kill -9 is "killed by SIGKILL", never "exited with code 9")."""
    if not crashed:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(code).name}"
    except ValueError:
        return f"was killed by signal {code}"


def start_failure(how: str, tail: list[str]) -> str:
    """Why a child ended before it was ready: one first line with the cause (its last
    "error:" line, else its last line), then the lines before it, for the tooltip."""
    cause = next((line for line in reversed(tail) if "error:" in line), tail[-1] if tail else "")
    first = f"the engine did not start ({how.removeprefix('was ')})"
    if not cause:
        return first
    rest = [line for line in tail if line != cause]
    return f"{first}: {cause.split('error: ', 1)[-1]}" + "".join(f"\n{x}" for x in rest)


class EngineProcess(QObject):
    ready = Signal(str, str)  # command endpoint, state endpoint
    failed = Signal(str)  # it exited (or could not start) before it was ready
    exited = Signal(int)  # exit code, after it had been ready
    # After it had been ready, in words: "exited with code 3" or "killed by SIGKILL".
    exitedBecause = Signal(str)
    progressed = Signal(object)  # app.engine_progress.Progress, while it loads

    def __init__(self, engine_args: list[str] | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine_args = list(engine_args or [])
        self.endpoints: tuple[str, str] | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._stdout = b""
        self._stderr = b""
        self._stopping = False
        self.progress = ProgressReader()
        self.proc: QProcess | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.state() != QProcess.ProcessState.NotRunning

    def pid(self) -> int | None:
        return int(self.proc.processId()) if self.running else None

    def start(self) -> None:
        self.stop()
        self.endpoints, self._stdout, self._stderr, self._stopping = None, b"", b"", False
        self.stderr_tail.clear()
        self.progress = ProgressReader()
        proc = engine_qprocess(self)
        proc.readyReadStandardOutput.connect(self._read_stdout)
        proc.readyReadStandardError.connect(self._read_stderr)
        proc.finished.connect(self._finished)
        proc.errorOccurred.connect(self._error)
        argv = serve_command(self.engine_args)
        self.proc = proc
        proc.start(argv[0], argv[1:])

    def _read_stdout(self) -> None:
        if self.proc is None:
            return
        self._stdout += bytes(self.proc.readAllStandardOutput())
        while b"\n" in self._stdout:
            line, self._stdout = self._stdout.split(b"\n", 1)
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "ready" and self.endpoints is None:
                self.endpoints = (parts[1], parts[2])
                self.ready.emit(parts[1], parts[2])

    def _read_stderr(self) -> None:
        if self.proc is None:
            return
        data = bytes(self.proc.readAllStandardError())
        text = data.decode(errors="replace")
        sys.stderr.write(text)
        if self.endpoints is None:
            for progress in self.progress.feed(text):
                self.progressed.emit(progress)
        self._stderr += data
        *lines, self._stderr = self._stderr.split(b"\n")
        # A progress bar redrawn after carriage returns: its last drawing, as a terminal shows.
        for line in lines:
            drawn = [p for p in line.split(b"\r") if p.strip()]
            if drawn:
                self.stderr_tail.append(drawn[-1].decode(errors="replace"))

    def _finished(self, code: int, status) -> None:
        if self._stopping:
            return
        how = exit_text(code, status == QProcess.ExitStatus.CrashExit)
        if self.endpoints is None:
            self.failed.emit(start_failure(how, list(self.stderr_tail)[-8:]))
        else:
            self.exited.emit(code)
            self.exitedBecause.emit(f"its process {how}")  # "engine is dead: its process…"

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.proc is not None:
            self.failed.emit(f"could not start the engine: {self.proc.errorString()}")

    def stop(self, timeout_ms: int = 8000) -> None:
        """SIGTERM (the engine aborts its requests and exits), then SIGKILL if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self._stopping = True
        if proc.state() != QProcess.ProcessState.NotRunning:
            proc.terminate()
            if not proc.waitForFinished(timeout_ms):
                proc.kill()
                proc.waitForFinished(2000)
        proc.deleteLater()

    def kill(self) -> None:
        """Kill -9, as a crash would (for tests and 'restart')."""
        if self.running:
            self.proc.kill()
