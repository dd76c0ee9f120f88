"""The app's trace parts: the JSONL reader, the record button (against a fake client on the
real bridge worker) and a real replay + compare of a tiny-model trace in a QProcess."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app.bridge import EngineBridge
from kvscope.app.traces.file import read_series
from kvscope.app.traces.narrow import shown_name
from kvscope.app.traces.panel import engine_args_from
from kvscope.app.traces.record import TraceRecordPanel
from kvscope.app.traces.replay import TraceReplayPanel
from kvscope.ipc import messages as m
from kvscope.ipc.trace_format import TraceError
from kvscope.testing.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "session.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "kvscope", "generate", "hi", "--raw", "--model",
                    str(model), "--max-tokens", "5", "--trace", str(path)],
                   check=True, cwd=REPO, env=env, capture_output=True, timeout=120)
    return path


def test_reader_parses_a_recorded_trace(recorded):
    s = read_series(recorded)
    assert s.header.schema_version == 1 and s.header.block_size > 0
    assert len(s.t) == len(s.tokens) == len(s.kv_usage) >= 5
    assert s.t[0] >= 0 and s.t == sorted(s.t)
    assert s.tokens[0] > 1  # the prefill step
    assert all(0 <= u <= 1 for u in s.kv_usage) and max(s.kv_usage) > 0
    assert not s.truncated


def test_reader_rejects_a_malformed_line_with_its_number(recorded, tmp_path):
    lines = recorded.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:2], '{"ev": "step", "t": "soon"}', *lines[2:]]) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:3:"):
        read_series(bad)
    bad.write_text("\n".join([*lines[:3], "__import__('os')", *lines[3:]]) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:4: not JSON"):
        read_series(bad)
    bad.write_text('{"ev": "step", "t": 0}\n')
    with pytest.raises(TraceError, match=r":1: expected a kvscope trace header"):
        read_series(bad)


def test_reader_tolerates_a_truncated_last_line(recorded, tmp_path):
    data = recorded.read_bytes().rstrip(b"\n")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[:-7])  # the last event, cut mid-line
    s = read_series(cut)
    assert s.truncated and s.events == read_series(recorded).events - 1
    assert s.cut_line == data.count(b"\n") + 1
    cut.write_bytes(data + b"\n" + b'{"ev": "step", "t": 1.0, "du')
    assert read_series(cut).truncated


class FakeClient:
    def __init__(self):
        self.calls = []

    def trace_start(self, path, include_prompts=True, timeout=None):
        self.calls.append(("start", path, include_prompts))
        Path(path).write_bytes(b'{"ev":"header"}\n')
        return m.TraceResult(recording=True, path=path, bytes=16)

    def trace_stop(self, timeout=None):
        self.calls.append(("stop",))
        return m.TraceResult(recording=False, path=self.calls[0][1], bytes=0)

    def close(self):
        pass


def test_record_button_toggles_and_shows_the_growing_size(qtbot, tmp_path):
    bridge = EngineBridge()
    client = FakeClient()
    bridge.client = bridge._worker.client = client
    panel = TraceRecordPanel(bridge, ask_path=False)
    qtbot.addWidget(panel)
    try:
        path = tmp_path / "rec.jsonl"
        panel.path_edit.setText(str(path))
        panel.no_prompts.setChecked(True)
        panel.record_button.click()
        qtbot.waitUntil(lambda: panel.recording, timeout=5000)
        assert client.calls == [("start", str(path), False)]
        assert "Stop" in panel.record_button.text()
        assert path.name in shown_name(panel.file_label.text())
        assert panel.file_label.toolTip() == str(path)
        assert panel.size_bytes == 16 and panel.size_timer.isActive()
        with path.open("ab") as f:
            f.write(b"x" * 5000 + b"\n")
        qtbot.waitUntil(lambda: panel.size_bytes == 5017, timeout=3000)
        assert "5,017 bytes" in panel.size_label.text()
        panel.record_button.click()
        qtbot.waitUntil(lambda: not panel.recording and panel.record_button.isEnabled(),
                        timeout=5000)
        assert client.calls[-1] == ("stop",)
        assert not panel.size_timer.isActive() and "saved" in panel.file_label.text()
    finally:
        panel.close()
        bridge.close()


def test_record_without_engine_reports_the_failure(qtbot):
    bridge = EngineBridge()
    panel = TraceRecordPanel(bridge, ask_path=False)
    qtbot.addWidget(panel)
    try:
        panel.record_button.click()
        assert not panel.recording and panel.record_button.isEnabled()
        assert "no engine is connected" in panel.file_label.text()
    finally:
        panel.close()
        bridge.close()


def test_replay_panel_replays_overlays_and_compares(qtbot, model, recorded, tmp_path):
    trace = tmp_path / "session.jsonl"
    trace.write_bytes(recorded.read_bytes())
    values = {"block_size": 8, "kv_dtype": "auto", "kv_cache_bytes": 4 << 20,
              "max_num_seqs": 4, "max_num_batched_tokens": 256,
              "enable_prefix_caching": False}
    args = engine_args_from(values, {"model": str(model), "device": "cpu"})
    panel = TraceReplayPanel(lambda: args)
    qtbot.addWidget(panel)
    assert panel.open_trace(str(trace))
    assert panel.plot.points("recorded") == len(read_series(trace).t)
    with qtbot.waitSignal(panel.finished, timeout=60_000) as done:
        panel.replay_button.click()
        assert panel.busy and panel.progress.isVisible() is panel.isVisible()
    assert done.args == [True], panel.status.text()
    assert Path(panel.replay_path).exists()
    assert panel.summary["block_size"] == 8 and panel.summary["requests"] == 1
    assert "outputs identical" in panel.status.text()
    assert panel.plot.points("replay") == panel.summary["steps"] > 0
    ratios = panel.comparison["ratio"]
    assert ratios["output_tokens"] == 1.0
    rows = {panel.table.item(r, 0).text(): panel.table.item(r, 3).text()
            for r in range(panel.table.rowCount())}
    assert rows["output_tokens"] == "1×"
    assert not panel.busy and not panel.progress.isVisible()


def test_replay_panel_reports_a_bad_trace(qtbot, recorded, tmp_path):
    bad = tmp_path / "bad.jsonl"
    header = recorded.read_text().splitlines()[0]
    bad.write_text(f'{header}\n{{"ev": "nope", "t": 0}}\n')
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert not panel.open_trace(str(bad))
    assert "bad.jsonl:2" in panel.trace_label.text() and not panel.replay_button.isEnabled()
    # a header without the fields the engine writes is refused as strictly as by the engine
    bad.write_text('{"ev": "header", "schema_version": 1}\n')
    assert not panel.open_trace(str(bad))
    assert "bad.jsonl:1: Object missing required field" in panel.trace_label.text()


def test_replay_panel_says_where_a_trace_was_cut_off(qtbot, recorded, tmp_path):
    cut = tmp_path / "cut.jsonl"
    data = recorded.read_bytes()
    cut.write_bytes(data[:-7])
    lines = data.count(b"\n")
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert panel.open_trace(str(cut))
    assert f"line {lines} cut off" in panel.trace_label.text()
    assert panel.replay_button.isEnabled()


def test_replay_can_be_cancelled_and_close_kills_it(qtbot, model, recorded):
    panel = TraceReplayPanel(lambda: ["--model", str(model), "--device", "cpu"])
    qtbot.addWidget(panel)
    assert panel.open_trace(str(recorded))
    with qtbot.waitSignal(panel.finished, timeout=10_000) as done:
        panel.replay()
        assert panel.busy
        panel.cancel()
    assert done.args == [False] and panel.status.text() == "cancelled" and not panel.busy
    panel.replay()
    proc = panel.proc
    assert proc is not None
    panel.close()  # a window closed mid-replay leaves no process behind
    assert panel.proc is None


def test_window_records_a_real_session_and_replays_it(qtbot, model, tmp_path, monkeypatch):
    from PySide6.QtCore import QSettings, Qt

    from kvscope.app.main_window import MainWindow

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the engine's trace folder
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    window = MainWindow(engine_args=["--model", str(model), "--device", "cpu",
                                     "--block-size", "4", "--kv-cache-bytes", "262144"],
                        settings=settings)
    qtbot.addWidget(window)
    rec, replay = window.trace_panel.record, window.trace_panel.replay
    try:
        window.start()
        qtbot.waitUntil(lambda: window.hello is not None, timeout=120_000)
        traces = tmp_path / "data" / "kvscope" / "traces"
        assert window.hello.trace_dir == str(traces.resolve())
        # the panel proposes a file where the engine records (it refuses anywhere else)
        assert Path(rec.path_edit.text()).parent == Path(window.hello.trace_dir)
        path = traces / "live.jsonl"
        rec.path_edit.setText(str(path))
        rec.record_button.click()
        qtbot.waitUntil(lambda: rec.recording, timeout=10_000)
        window.chat.max_tokens.setValue(8)
        window.chat.temperature.setValue(0.0)
        qtbot.keyClicks(window.chat.input, "hello engine")
        qtbot.keyClick(window.chat.input, Qt.Key.Key_Return)
        turn = next(iter(window.chat.turns.values()))
        qtbot.waitUntil(lambda: turn.done, timeout=60_000)
        qtbot.waitUntil(lambda: (rec.size_bytes or 0) > 1000, timeout=5000)
        rec.record_button.click()
        qtbot.waitUntil(lambda: not rec.recording and rec.record_button.isEnabled(),
                        timeout=10_000)
        assert read_series(path).tokens
        # Replay against the controls as shown (block size 8, not applied to the engine).
        window.controls.block_size.setCurrentText("8")
        assert replay.open_trace(str(path))
        with qtbot.waitSignal(replay.finished, timeout=60_000) as done:
            replay.replay_button.click()
        assert done.args == [True], replay.status.text()
        assert replay.summary["block_size"] == 8 and replay.summary["requests"] == 1
        assert replay.plot.points("replay") > 0 and replay.table.rowCount() > 5
    finally:
        window.shutdown()


def test_replay_args_carry_the_kv_rotation():
    values = {"block_size": 8, "kv_dtype": "int8", "kv_rotation": "none",
              "kv_cache_bytes": 4 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 256,
              "enable_prefix_caching": True}
    args = engine_args_from(values, {"model": "m"})
    assert args[args.index("--kv-rotation") + 1] == "none"
    assert "--kv-rotation" not in engine_args_from({**values, "kv_rotation": ""}, {})


def test_export_writes_perfetto_json_and_csv_through_the_cli(qtbot, tmp_path, monkeypatch):
    import json

    from PySide6.QtWidgets import QFileDialog

    from tests.traces import synthetic

    trace = synthetic.write(tmp_path / "synthetic.jsonl")
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert not panel.export_button.isEnabled()  # nothing open yet
    assert panel.open_trace(str(trace)) and panel.export_button.isEnabled()
    asked = {}

    def save_dialog(_parent, _title, start, _filter):
        asked["start"] = start
        return str(tmp_path / "out" / "session"), "Perfetto JSON (*.json)"

    (tmp_path / "out").mkdir()
    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_dialog)
    with qtbot.waitSignal(panel.exported, timeout=60000) as done:
        panel.export()
    assert done.args == [True], panel.status.text()
    assert asked["start"] == str(tmp_path / "synthetic.perfetto.json")
    events = json.loads((tmp_path / "out" / "session.json").read_text())
    assert events["traceEvents"] if isinstance(events, dict) else events
    csv_lines = (tmp_path / "out" / "session.csv").read_text().splitlines()
    assert len(csv_lines) > 1  # a header and the steps
    assert "exported session.json and session.csv" in shown_name(panel.status.text())
    assert panel.export_button.isEnabled() and panel.open_button.isEnabled()


def test_export_failure_is_shown(qtbot, tmp_path):
    from tests.traces import synthetic

    trace = synthetic.write(tmp_path / "synthetic.jsonl")
    panel = TraceReplayPanel()
    qtbot.addWidget(panel)
    assert panel.open_trace(str(trace))
    with qtbot.waitSignal(panel.exported, timeout=60000) as done:
        panel.export_to(str(tmp_path / "no-such-folder" / "x.json"))
    assert done.args == [False]
    assert "export failed" in panel.status.text()


def test_open_trace_starts_in_the_folder_recordings_are_saved_in(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    from kvscope.app.traces.panel import TracePanel

    bridge = EngineBridge()
    panel = TracePanel(bridge)
    qtbot.addWidget(panel)
    try:
        panel.record.trace_dir = str(tmp_path / "traces")  # as the engine's hello names it
        started = []
        monkeypatch.setattr(QFileDialog, "getOpenFileName",
                            lambda _p, _t, folder, _f: (started.append(folder), ("", ""))[1])
        panel.replay.browse()
        assert started == [str(tmp_path / "traces")]
        panel.record.path = str(tmp_path / "saved" / "kvscope-1.jsonl")  # a recording, saved
        panel.replay.browse()
        assert started[-1] == str(tmp_path / "saved")
    finally:
        panel.stop()
        panel.close()
        bridge.close()
