"""Leak check for the app tests: no test may leave Python threads, running QThreads or
active QTimers behind once its widgets are closed.

Used by the autouse fixture in tests/app/conftest.py for every test there. pytest-qt closes
the widgets registered with qtbot.addWidget in its runtest_teardown hook, before fixtures
are torn down, so `check` runs after the test's widgets are closed; it then gives threads
and deferred deletions a short grace period before failing the test."""
from __future__ import annotations

import gc
import threading
import time

# Process-lifetime threads that libraries start once and never stop (not ours to join).
ALLOWED_THREAD_CLASSES = {"TMonitor"}  # tqdm's monitor (transformers' save/load bars)
GRACE_S = 3.0


def _valid(obj) -> bool:
    import shiboken6

    try:
        return shiboken6.isValid(obj)
    except Exception:  # noqa: BLE001 - not a wrapper any more
        return False


def _qt_objects():
    """Live QTimer / QThread wrappers: children of the application and of every top-level
    widget, plus any wrapper the garbage collector knows about (parentless ones included)."""
    from PySide6.QtCore import QThread, QTimer
    from PySide6.QtWidgets import QApplication

    found: dict[int, object] = {}
    app = QApplication.instance()
    if app is not None:
        roots = [app, *QApplication.topLevelWidgets()]
        for root in roots:
            if not _valid(root):
                continue
            for kind in (QTimer, QThread):
                for obj in root.findChildren(kind):
                    found[id(obj)] = obj
    kinds = (QTimer, QThread)
    for obj in gc.get_objects():  # type(), not isinstance(): no lazy-module __getattr__
        if issubclass(type(obj), kinds):
            found[id(obj)] = obj
    return list(found.values())


def _describe(obj) -> str:
    name = obj.objectName() or ""
    parent = obj.parent()
    owner = type(parent).__name__ if parent is not None else "no parent"
    return f"{type(obj).__name__}({name!r}, parent={owner})"


def active_qt() -> dict[int, str]:
    from PySide6.QtCore import QThread, QTimer

    out: dict[int, str] = {}
    for obj in _qt_objects():
        if not _valid(obj):
            continue
        try:
            alive = obj.isActive() if isinstance(obj, QTimer) else (
                isinstance(obj, QThread) and obj.isRunning())
        except RuntimeError:  # deleted underneath us
            continue
        if alive:
            out[id(obj)] = _describe(obj)
    return out


def live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate()
            if t.is_alive() and type(t).__name__ not in ALLOWED_THREAD_CLASSES}


class Snapshot:
    def __init__(self) -> None:
        self.threads = live_threads()
        self.qt = active_qt()

    def leaks(self) -> list[str]:
        threads = sorted(f"thread {t.name!r}" for t in live_threads() - self.threads)
        qt = sorted(desc for key, desc in active_qt().items() if key not in self.qt)
        return threads + qt


def check(before: Snapshot, grace_s: float = GRACE_S) -> list[str]:
    """Process events (deferred deletes included) until nothing new is alive, or give up
    after grace_s and return what is still alive."""
    from PySide6.QtCore import QCoreApplication, QEvent
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    deadline = time.monotonic() + grace_s
    collected = False
    while True:
        if app is not None:
            app.processEvents()
            QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        leaks = before.leaks()
        if not leaks or time.monotonic() > deadline:
            return leaks
        if not collected:  # unreferenced wrappers of stopped objects: only once, it is slow
            gc.collect()
            collected = True
        time.sleep(0.02)


def leaked_threads(before: set) -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def active_timers(root) -> list[str]:
    from PySide6.QtCore import QTimer

    return [t.objectName() or repr(t) for t in root.findChildren(QTimer) if t.isActive()]
