"""The window marks requests that came in over the engine's OpenAI API, shows the API's URL
and remembers the local engine's HTTP port."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import msgspec
from PySide6.QtCore import QSettings

from kvscope.app import settings as app_settings
from kvscope.app.blocks.block_map import BlockMap
from kvscope.app.status_bar import EngineStatusBar
from kvscope.ipc import messages as m
from kvscope.testing.frames import blocks_frame, engine_settings, stats_frame


def test_block_map_marks_http_requests(qtbot):
    frame = msgspec.structs.replace(
        blocks_frame(64, 16, {"chatcmpl-1": [3, 4], "req-7": [8]}),
        request_sources={"chatcmpl-1": "http"})
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.resize(900, 500)
    bm.show_blocks(frame)
    bm.refresh()
    bm._on_mouse_moved(bm.block_scene_pos(4))
    assert "owner chatcmpl-1 (logical block 1) via HTTP" in bm.hover_label.text()
    bm._on_mouse_moved(bm.block_scene_pos(8))
    assert "owner req-7" in bm.hover_label.text() and "HTTP" not in bm.hover_label.text()
    bm.click_block(3)
    bm.refresh_labels()
    assert "running via HTTP" in bm.selection_label.text()
    assert "in 2 requests (1 via HTTP)" in bm.totals.text()
    bm.show_blocks(blocks_frame(64, 16, {"req-7": [8]}, seq=2))  # an engine without HTTP
    bm.refresh_labels()
    assert "HTTP" not in bm.totals.text()


def test_status_bar_shows_the_api_url(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    bar.show()
    bar.show_hello(m.HelloResult(1, "x", "default", 1, engine_settings(), 512, 1 << 20,
                                 http_url="http://127.0.0.1:8000/v1"))
    assert bar.metrics_label.isVisible()
    assert bar.metrics_label.text() == "OpenAI API: http://127.0.0.1:8000/v1"
    bar.stop_watching()


def test_status_bar_counts_http_requests_in_flight(qtbot):
    bar = EngineStatusBar()
    qtbot.addWidget(bar)
    frame = stats_frame()
    bar.show_stats(stats_frame(server={"http_in_flight": 3}))
    assert bar.blocks_label.text().endswith("· 3 via HTTP")
    bar.show_stats(frame)
    assert "HTTP" not in bar.blocks_label.text()
    bar.stop_watching()


def test_local_engine_http_port_is_remembered(tmp_path):
    s = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    assert app_settings.with_http_port(["--model", "m"], s) == ["--model", "m"]
    assert app_settings.with_http_port(["--http-port", "8011"], s) == ["--http-port", "8011"]
    assert app_settings.with_http_port(["--model", "m"], s) == \
        ["--model", "m", "--http-port", "8011"]
    assert app_settings.with_http_port(["--http-port", "-1"], s) == []
    assert app_settings.with_http_port([], s) == []
