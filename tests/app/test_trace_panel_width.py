"""The Trace panel never grows sideways after a replay or compare (issue 53: it grew wider
than its dock, cutting Export…, Cancel, file names and the ratio column), and a comparison
says in the window when its runs are not like for like."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QApplication

from kvscope.app.main_window import SIDE_MIN_WIDTH, scrollable
from kvscope.app.traces.panel import TracePanel

LONG_NAME = "session-with-a-rather-long-name-20250101-120000.replay-20250101-120500-123.jsonl"
NOTES = ["sampled, not greedy: 3 of 3 requests in A, 0 in B (their outputs and lengths "
         "differ by chance)",
         "not paced alike: requests arrived over 41.0 s in A and 0.0 s in B (B replayed "
         "unpaced, as fast as it goes)"]


class QuietBridge(QObject):
    """The three signals the record half listens to; nothing is recorded here."""
    traceChanged = Signal(object)
    helloReceived = Signal(object)
    commandFailed = Signal(str, str)


def comparison(notes):
    keys = {"duration_s": 41.2, "throughput_tok_s": 12.5, "a_very_long_metric_name_p99_ms": 3.0}
    return {"a": keys, "b": {k: v * 7.53 for k, v in keys.items()},
            "ratio": {k: 7.53 for k in keys}, "runs": [{}, {}],
            "pairs": [{"not_like_for_like": notes}]}


def make(qtbot):
    panel = TracePanel(QuietBridge())
    area = scrollable(panel)
    qtbot.addWidget(area)
    area.resize(SIDE_MIN_WIDTH, 900)
    area.show()
    qtbot.waitExposed(area)
    return panel, area


def test_long_names_and_a_comparison_do_not_widen_the_panel(qtbot):
    panel, area = make(qtbot)
    replay = panel.replay
    replay.trace_label.setText(f"{LONG_NAME}\nSmolLM2 · block 16 · KV bfloat16 · 120 steps")
    replay.status.setText(f"replayed 3 requests in 0.5 s, 99 tok/s; outputs differ\n→ {LONG_NAME}")
    panel.record.file_label.setText(f"saved {LONG_NAME}")
    replay.on_compared(comparison(NOTES))
    QApplication.processEvents()
    assert panel.minimumSizeHint().width() <= SIDE_MIN_WIDTH
    assert area.horizontalScrollBar().maximum() == 0
    for button in (replay.export_button, replay.cancel_button, replay.compare_button):
        assert button.geometry().right() <= area.viewport().width()
    panel.stop()


def test_a_comparison_says_its_runs_are_not_like_for_like(qtbot):
    panel, _area = make(qtbot)
    replay = panel.replay
    replay.on_compared(comparison(NOTES))
    text = replay.status.text()
    assert "not like for like" in text and "sampled" in text and "not paced alike" in text
    assert "not like for like" in replay.table.horizontalHeaderItem(3).text()
    replay.on_compared(comparison([]))
    assert "not like for like" not in replay.status.text()
    assert "not like for like" not in replay.table.horizontalHeaderItem(3).text()
    panel.stop()
