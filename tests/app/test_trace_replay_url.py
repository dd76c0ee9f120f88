"""The Trace tab against an OpenAI-compatible server: the open trace replayed with `kvscope
trace replay --url` in a QProcess (the key in its environment, not its argv), progress shown
while it runs, then compared: serving metrics in the table, TTFT and ITL CDFs side by side.
The server is tests/traces/fake_openai.py's, with planned delays."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess
import sys
from pathlib import Path

from kvscope.app.traces.cdf_plot import cdf_xy
from kvscope.app.traces.progress import ProgressReader, parse_progress
from kvscope.app.traces.replay import SERVING_KEYS, TraceReplayPanel
from tests.traces import synthetic
from tests.traces.fake_openai import FakeOpenAI, Plan

REPO = Path(__file__).resolve().parents[2]


def slow_second(body):
    """r1 (prompt 7, 8, 9) takes a while: the first request's progress shows before the end."""
    first = (body.get("prompt") or [0])[0]
    return Plan(delays=[1.0, 0.05, 0.05] if first == 7 else [0.05, 0.05, 0.05])


def test_replay_against_a_server_shows_progress_and_compares(qtbot, tmp_path):
    trace = synthetic.write(tmp_path / "rec.jsonl")
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert panel.open_trace(str(trace)) and panel.url_button.isEnabled()
    with FakeOpenAI(plan=slow_second, auth="k3y") as srv:
        panel.url_form.url_edit.setText(srv.url)
        panel.url_form.key_edit.setText("k3y")
        panel.url_form.speed.setCurrentText("max")
        with qtbot.waitSignal(panel.finished, timeout=120_000) as done:
            panel.url_button.click()
            assert panel.busy and not panel.url_button.isEnabled()
            argv = panel.proc.arguments()
            assert "--url" in argv and "k3y" not in " ".join(argv)
            qtbot.waitUntil(lambda: panel.progress.maximum() == 2, timeout=60_000)
            assert "requests done" in panel.status.text() or not panel.busy
    assert done.args == [True], panel.status.text()
    assert len(srv.bodies) == 2  # both authorised with the key
    assert f"replayed 2 requests against {srv.url}" in panel.status.text()
    assert panel.summary["errors"] == 0 and Path(panel.replay_path).exists()
    # The table holds the serving metrics; the CDFs one curve per run, a point per request.
    rows = {panel.table.item(r, 0).text() for r in range(panel.table.rowCount())}
    assert rows == set(SERVING_KEYS)
    assert panel.cdf_plot.points(0, "ttft_ms") == 2 and panel.cdf_plot.points(1, "ttft_ms") == 2
    assert panel.cdf_plot.points(1, "itl_ms") == 4
    runs = panel.comparison["runs"]
    # The planned 1 s before the first chunk, as the client timed it (its clock starts a few
    # ms after the server's, so not exactly 1000); the other requests' is 50 ms.
    assert runs[1]["server_url"] == srv.url and runs[1]["metrics"]["ttft_p99_ms"] >= 900
    assert not panel.busy and panel.compare_button.isEnabled()


def test_a_failing_server_and_a_mismatched_compare_are_shown(qtbot, tmp_path):
    trace = synthetic.write(tmp_path / "rec.jsonl")
    other = tmp_path / "other.jsonl"
    evs = [e for e in synthetic.events() if getattr(e, "id", "r0") == "r0"]
    synthetic.write(other, evs)
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert panel.open_trace(str(trace))
    with FakeOpenAI(plan=lambda body: Plan(status=429, error="busy")) as srv:
        panel.url_form.url_edit.setText(srv.url)
        with qtbot.waitSignal(panel.finished, timeout=120_000) as done:
            panel.replay_url()
    assert done.args == [True] and "2 failed" in panel.status.text()
    assert "HTTP 429: busy" in panel.status.toolTip()
    with qtbot.waitSignal(panel.finished, timeout=60_000) as done:
        panel.compare_with(str(other))
    assert done.args == [False] and "different requests" in panel.status.text()


def test_progress_lines_and_cdf_points():
    reader = ProgressReader()
    assert reader.feed(b'log line\n{"progress": {"done": 1, "total": 3, "errors": 0, ') is None
    p = reader.feed(b'"in_flight": 2}}\n')
    assert (p.done, p.total, p.in_flight) == (1, 3, 2)
    assert parse_progress('{"progress": "nope"}') is None
    assert cdf_xy([1.0, 2.0, 4.0, 8.0]) == ([1.0, 2.0, 4.0, 8.0], [0.25, 0.5, 0.75, 1.0])


def test_the_trace_tab_still_imports_no_engine():
    code = ("import sys, kvscope.app.traces.panel; "
            "sys.exit(any(m.startswith('kvscope.engine') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode == 0
