"""The leak check itself (tests/app/leaks.py) sees what it must: an active timer with no
parent, a running QThread and a Python thread, and lets them go once stopped."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading

from PySide6.QtCore import QThread, QTimer

import tests.app.leaks as app_leaks


def test_leak_check_sees_timers_qthreads_and_threads(qapp):
    before = app_leaks.Snapshot()
    timer = QTimer()  # no parent: only the gc scan finds it
    timer.setObjectName("leaky-timer")
    timer.start(1000)
    qthread = QThread()
    qthread.setObjectName("leaky-qthread")
    qthread.start()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="leaky-thread", daemon=True)
    thread.start()
    try:
        leaks = " ".join(app_leaks.check(before, grace_s=0.1))
        for name in ("leaky-timer", "leaky-qthread", "leaky-thread"):
            assert name in leaks, leaks
    finally:
        timer.stop()
        qthread.quit()
        qthread.wait(5000)
        stop.set()
        thread.join(5)
    assert app_leaks.check(before, grace_s=2.0) == []
