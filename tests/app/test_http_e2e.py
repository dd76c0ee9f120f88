"""The window's own engine with its OpenAI API on: a request over HTTP shows in the block map
(marked "via HTTP") and the status bar, and its blocks come back when the client hangs up."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading

import httpx
import numpy as np
from PySide6.QtCore import QSettings

from kvscope.app.main_window import MainWindow
from kvscope.ipc.messages import BLOCK_STATE_MASK, BLOCK_USED
from tests.app.leaks import active_timers, leaked_threads
from tests.support.server_harness import save_chat_model

# Long enough that only a hang-up ends it within the test's waits, however fast the machine.
LONG = 200_000


def stream_until(url: str, stop: threading.Event, seen: list) -> None:
    body = {"prompt": "over http " * 4, "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/completions", json=body) as r:
        for line in r.iter_lines():
            seen.append(line)
            if stop.is_set():
                return  # hang up mid-stream


def test_http_request_shows_in_the_window(qtbot, tmp_path):
    model = save_chat_model(tmp_path / "tiny", seed=0)
    before = set(threading.enumerate())
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    window = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                     "--max-model-len", str(LONG + 100), "--http-port", "0"],
                        settings=settings)
    qtbot.addWidget(window)
    stop, seen = threading.Event(), []
    client = None
    try:
        window.show()
        window.start()
        qtbot.waitUntil(lambda: window.hello is not None, timeout=120_000)
        url = window.hello.http_url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert f"OpenAI API: {url}" in window.status.metrics_label.text()
        client = threading.Thread(target=stream_until, args=(url, stop, seen))
        client.start()

        def http_frame():
            f = window.block_map.frame
            return f is not None and bool(f.request_sources) and f.used > 0

        qtbot.waitUntil(http_frame, timeout=60_000)
        frame = window.block_map.frame
        (rid,) = frame.request_sources
        assert frame.request_sources[rid] == "http" and rid.startswith("cmpl-")
        bm = window.block_map
        used = np.flatnonzero((frame.array("flags") & BLOCK_STATE_MASK) == BLOCK_USED)
        bm._on_mouse_moved(bm.block_scene_pos(int(used[0])))
        assert f"owner {rid}" in bm.hover_label.text() and "via HTTP" in bm.hover_label.text()
        bm.refresh_labels()
        assert "(1 via HTTP)" in bm.totals.text()
        stop.set()
        client.join(60)
        qtbot.waitUntil(lambda: not bool(window.block_map.frame.request_sources)
                        and window.block_map.frame.used == 0, timeout=60_000)
        assert len(seen) < LONG  # it hung up long before the end
    finally:
        stop.set()
        if client is not None:
            client.join(60)
        window.shutdown()
    assert int(settings.value("engine/http_port")) == 0  # remembered for the next start
    assert active_timers(window) == []
    qtbot.wait(200)
    assert leaked_threads(before) == []
