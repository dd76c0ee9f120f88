"""The long-context heatmaps: the saved grid read (a corrupt one ignored with a message), the
maps drawn headless, the background run's progress and end."""
import json
import sys

import pytest
from PySide6.QtCore import QPoint

from kvscope.app.kv_grid import runner as runner_mod
from kvscope.app.kv_grid import saved_grid
from kvscope.app.kv_grid.heatmap import share_colour
from kvscope.app.kv_grid.panel import KVGridBox
from kvscope.app.kv_grid.runner import GridRunner, parse_progress

LENGTHS, DEPTHS = [1024, 4096], [0.0, 0.5, 1.0]


def grid(right=1.0):
    def cells(r):
        return [{"length": n, "depth": d, "tokens": n, "samples": 2, "right": r,
                 "same_as_float32": 1.0 if r else 0.5, "agreement": 1.0 if r else 0.5,
                 "top1_agreement": 0.9, "kl": 0.01, "rank": 1.0,
                 "answers": [{"answer": " 12345", "key": 12345, "right": bool(r)}]}
                for n in LENGTHS for d in DEPTHS]
    settings = {}
    for name, dtype, rot, anchors in [("float32", "float32", "none", 0),
                                      ("bfloat16", "bfloat16", "none", 0),
                                      ("int8", "int8", "calibrated", 4),
                                      ("int8+none", "int8", "none", 0),
                                      ("fp8", "fp8", "calibrated", 4),
                                      ("fp8+none", "fp8", "none", 0)]:
        settings[name] = {"kv_dtype": dtype, "kv_rotation": rot, "kv_anchor_tokens": anchors,
                          "kv_bytes_per_token": 12240,
                          "cells": cells(0.0 if name == "fp8+none" else right)}
    return {"task": "passkey", "model": "SmolLM2-135M", "date": "2026-12-02T04:00:00+00:00",
            "seconds": 300.0, "machine": "x86_64, 2 cores", "probes": 12,
            "lengths": LENGTHS, "depths": DEPTHS, "seeds": 2, "partial": False,
            "settings": settings}


class IdleRunner(GridRunner):
    def start(self):  # never runs a process in these tests
        self.started.emit()


@pytest.fixture
def box(qtbot, tmp_path):
    path = tmp_path / "last-passkey.json"
    path.write_text(json.dumps(grid()))
    b = KVGridBox(path, runner=IdleRunner(path))
    qtbot.addWidget(b)
    return b


def test_saved_grid_is_drawn_one_map_per_setting(box):
    assert len(box.maps) == 6
    assert "SmolLM2-135M" in box.caption.text() and "2026-12-02 04:00" in box.caption.text()
    box.highlight("int8")
    assert [m.title for m in box.maps if m.highlighted] == ["int8", "int8 none"]
    box.show()
    image = box.grab().toImage()
    assert not image.isNull() and image.width() > 100
    fp8_none = next(m for m in box.maps if m.title == "fp8 none")
    cell = fp8_none.grab().toImage().pixelColor(fp8_none.cell_rect(0, 0).topLeft())
    assert cell.red() > cell.green()  # no key found: red
    found = next(m for m in box.maps if m.title == "float32")
    cell = found.grab().toImage().pixelColor(found.cell_rect(1, 2).topLeft())
    assert cell.green() > cell.red()


def test_cell_tooltip_names_its_numbers(box):
    m = box.maps[0]
    assert m.cell_at(m.cell_rect(1, 1).center()).length == 4096
    assert m.cell_at(QPoint(0, 0)) is None
    assert "keys found" in m.summary()


@pytest.mark.parametrize("content", [
    "{not json", json.dumps([1, 2]), json.dumps({**grid(), "task": "document"}),
    json.dumps({**grid(), "settings": {"int8": {"kv_dtype": "int8"}}}),
    json.dumps({**grid(), "settings": {}}), "\xff\xfe",
    json.dumps({**grid(), "model": None})])
def test_corrupt_saved_grid_is_ignored_with_a_message(qtbot, tmp_path, content):
    path = tmp_path / "last-passkey.json"
    path.write_text(content, encoding="latin-1")
    grid_, message = saved_grid.load(path)
    assert grid_ is None and message.startswith(f"ignored the saved grid {path}")
    b = KVGridBox(path, runner=IdleRunner(path))
    qtbot.addWidget(b)
    assert b.maps == [] and "ignored" in b.caption.text()


def test_missing_grid_says_how_to_measure(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert saved_grid.saved_path() == tmp_path / "kvscope" / "kv-accuracy" / "last-passkey.json"
    b = KVGridBox(runner=IdleRunner())
    qtbot.addWidget(b)
    assert "Measure" in b.caption.text() and b.maps == []


def test_the_window_reads_where_the_command_writes(tmp_path, monkeypatch):
    """The command's writer (ipc.saved_results, as kv_accuracy.run_long_task calls it) and
    the window agree on the path and the format."""
    from kvscope.ipc import saved_results

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    written = saved_results.save(saved_results.from_result(grid()),
                                 saved_results.saved_path("passkey"))
    assert written == saved_grid.saved_path()
    loaded, message = saved_grid.load()
    assert message == "" and loaded is not None
    assert [s.name for s in loaded.settings][:2] == ["float32", "bfloat16"]
    assert loaded.lengths == LENGTHS and loaded.depths == DEPTHS
    assert loaded.setting("fp8+none").cells[0].right == 0.0


def test_background_run_shows_progress_then_reloads(qtbot, tmp_path, monkeypatch):
    """A stand-in for the command: prints progress on stderr, writes the grid, exits."""
    path = tmp_path / "last-passkey.json"
    script = (f"import json,sys,time; sys.stderr.write('[kv-accuracy] progress 40% eta 1m05s "
              f"int8\\n'); sys.stderr.flush(); time.sleep(0.3); "
              f"open({str(path)!r},'w').write({json.dumps(json.dumps(grid()))})")
    monkeypatch.setattr(runner_mod, "command", lambda save, extra: [sys.executable, "-c",
                                                                    script])
    run = GridRunner(path)
    b = KVGridBox(path, runner=run)
    qtbot.addWidget(b)
    assert b.maps == []
    seen = []
    run.progressed.connect(lambda p, t: seen.append((p, t)))
    with qtbot.waitSignal(run.finished, timeout=20000) as done:
        b.measure_button.click()
        assert not b.measure_button.isEnabled()  # returns at once: the window goes on
    assert done.args == [True, "measured"]
    assert seen == [(40, "eta 1m05s, int8")]
    assert len(b.maps) == 6 and b.measure_button.isEnabled()


def test_failed_run_says_why(qtbot, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "command", lambda save, extra: [
        sys.executable, "-c", "import sys; sys.stderr.write('boom: no model\\n'); sys.exit(3)"])
    run = GridRunner(tmp_path / "x.json")
    with qtbot.waitSignal(run.finished, timeout=20000) as done:
        run.start()
    assert done.args[0] is False and "exited with code 3" in done.args[1] and \
        "boom" in done.args[1]


def test_cancel_ends_the_child_and_says_cancelled(qtbot, tmp_path, monkeypatch):
    """Measure runs for minutes at full CPU: Cancel ends its process (it must not linger)
    and the box says "cancelled", not "the measurement failed (exit 15)"."""
    import os

    pid_file = tmp_path / "pid"
    script = (f"import os,sys,time; open({str(pid_file)!r},'w').write(str(os.getpid())); "
              "sys.stderr.write('[kv-accuracy] progress 5% eta 9m30s float32\\n'); "
              "sys.stderr.flush(); time.sleep(120)")
    monkeypatch.setattr(runner_mod, "command", lambda save, extra: [sys.executable, "-c",
                                                                    script])
    path = tmp_path / "last-passkey.json"
    path.write_text(json.dumps(grid()))
    run = GridRunner(path)
    b = KVGridBox(path, runner=run)
    qtbot.addWidget(b)
    assert "Measure takes about" in b.status.text()  # said before it starts
    assert b.cancel_button.isHidden()
    with qtbot.waitSignal(run.progressed, timeout=20000):
        b.measure_button.click()
    assert not b.cancel_button.isHidden() and "time left 9m30s" in b.status.text()
    pid = int(pid_file.read_text())
    with qtbot.waitSignal(run.finished, timeout=10000) as done:
        b.cancel_button.click()
    assert done.args == [False, "cancelled"]
    assert b.status.text() == "cancelled" and "exit" not in b.status.text()
    assert b.cancel_button.isHidden() and b.measure_button.isEnabled()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child is gone (reaped by QProcess)


def test_the_estimate_is_the_last_runs_time():
    from kvscope.app.kv_grid.panel import FIRST_GUESS_MIN, estimate_text

    loaded = saved_grid.parse(json.dumps(grid()))
    assert f"{FIRST_GUESS_MIN} min" in estimate_text(None)
    assert "about 5 min here (the last run)" in estimate_text(loaded)  # its 300 s


def test_command_and_progress_lines():
    cmd = runner_mod.command(saved_grid.saved_path(), [])
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 8] == [
        "kvscope", "kv-accuracy", "--task", "passkey", "--quick", "--json", "--save"]
    assert parse_progress("[kv-accuracy] progress 7% eta ? float32") == (7, "?", "float32")
    assert parse_progress("[kv-accuracy] saved to x") is None
    assert share_colour(None).red() == share_colour(None).green()
