"""The shared trace format (kvscope.ipc.trace_format): strict reading, the cut-off last line,
and the engine and the window reading a file with the same code."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app.traces import file as app_file
from kvscope.engine.cli import trace as trace_cli
from kvscope.engine.traces import workload
from kvscope.engine.traces.summary import summarize
from kvscope.ipc import trace_format
from kvscope.ipc.trace_format import Finish, Step, TraceError, parse_trace, read_trace
from tests.traces import synthetic

ROOT = Path(__file__).resolve().parents[2]


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def test_written_events_read_back_equal(tmp_path):
    path = synthetic.write(tmp_path / "t.jsonl")
    trace = read_trace(path)
    assert trace.header == synthetic.header() and trace.events == synthetic.events()
    assert not trace.truncated and trace.cut_line is None
    assert path.read_bytes().endswith(b"\n") and len(lines_of(path)) == 1 + len(trace.events)


def test_a_cut_off_last_line_is_dropped_and_its_number_reported(tmp_path):
    path = synthetic.write(tmp_path / "t.jsonl")
    data = path.read_bytes()
    n = len(lines_of(path))
    for cut in (2, 10, len(lines_of(path)[-1]) - 1):  # a few places inside the last line
        path.write_bytes(data[:-1 - cut])
        trace = read_trace(path)
        assert trace.truncated and trace.cut_line == n
        assert trace.events == synthetic.events()[:-1]


def test_a_character_cut_in_half_at_the_end_is_a_cut_off_line(tmp_path):
    evs = [*synthetic.events(), Finish(t=0.5, id="r2", reason="stop ✓")]
    data = synthetic.write(tmp_path / "t.jsonl", evs).read_bytes()
    cut = data.index("✓".encode()) + 1  # inside the three bytes of the check mark
    trace = parse_trace(data[:cut], "t")
    assert trace.cut_line == len(evs) + 1 and trace.events == evs[:-1]
    with pytest.raises(TraceError, match=r"^t:2: not JSON"):  # not UTF-8 mid-file: an error
        parse_trace(data.replace(b"r0", b"r\xff", 1), "t")


@pytest.mark.parametrize("damage,match", [
    (lambda line: line[:20], r"t\.jsonl:4: not JSON"),
    (lambda line: b"__import__('os').system('true')", r"t\.jsonl:4: not JSON"),
    (lambda line: b"", r"t\.jsonl:4: not JSON"),
    (lambda line: b'{"ev": "token", "t": 1.0, "id": "r0", "tokens": ["x"]}',
     r"t\.jsonl:4: Expected `int`"),
    (lambda line: line.replace(b"}", b', "evil": 1}'), r"t\.jsonl:4: Object contains unknown"),
])
def test_a_bad_line_anywhere_but_the_end_is_an_error_naming_it(tmp_path, damage, match):
    path = synthetic.write(tmp_path / "t.jsonl")
    lines = lines_of(path)
    lines[3] = damage(lines[3])
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceError, match=match):
        read_trace(path)


def test_a_complete_last_line_without_newline_must_still_validate(tmp_path):
    path = synthetic.write(tmp_path / "t.jsonl")
    path.write_bytes(path.read_bytes() + b'{"ev": "token", "t": 1.0}')
    with pytest.raises(TraceError, match=rf":{len(lines_of(path)) + 1}: Object missing"):
        read_trace(path)


def test_the_header_is_checked_first(tmp_path):
    header = json.loads(lines_of(synthetic.write(tmp_path / "t.jsonl"))[0])
    with pytest.raises(TraceError, match=r"^t:1: unsupported schema_version 2"):
        parse_trace(json.dumps({**header, "schema_version": 2, "new": 1}).encode(), "t")
    without_model = {k: v for k, v in header.items() if k != "model"}
    with pytest.raises(TraceError, match=r"^t:1: Object missing required field `model`"):
        parse_trace(json.dumps(without_model).encode() + b"\n", "t")
    with pytest.raises(TraceError, match=r"^t:1: the header line is cut off"):
        parse_trace(b'{"ev": "header", "schema_', "t")
    with pytest.raises(TraceError, match=r"^t:1: expected a kvscope trace header"):
        parse_trace(b'{"ev": "token", "t": 0, "id": "a", "tokens": []}\n', "t")
    with pytest.raises(TraceError, match=r"^t:1: empty"):
        parse_trace(b"", "t")


# -- one reader for the engine and the window ----------------------------------------------
def test_the_engine_and_the_window_use_the_ipc_reader():
    assert app_file.read_trace is trace_format.read_trace
    assert workload.read_trace is trace_format.read_trace
    assert trace_cli.read_trace is trace_format.read_trace
    assert app_file.TraceSeries.__module__ == "kvscope.app.traces.file"
    assert not hasattr(app_file, "TraceFileError")


def test_both_read_a_cut_off_trace_alike(tmp_path, capsys):
    path = synthetic.write(tmp_path / "t.jsonl")
    path.write_bytes(path.read_bytes()[:-9])
    n = len(lines_of(path)) + 1
    series = app_file.read_series(path)
    assert series.truncated and series.cut_line == n
    assert series.events == len(synthetic.events()) - 1 and len(series.t) == 3
    # the engine side: `kvscope trace compare` reports it, fragsim's lengths still come back
    assert trace_cli.main(["compare", str(path), str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["a"]["truncated"] is True
    assert summarize(read_trace(path)).truncated
    # r1's finish line is the one cut off: its tokens are all there
    assert sorted(workload.request_lengths(path)) == [3 + 2, 6 + 2]


def test_both_refuse_a_malformed_middle_line_with_the_same_message(tmp_path, capsys):
    path = synthetic.write(tmp_path / "t.jsonl")
    lines = lines_of(path)
    lines[5] = b'{"ev": "step", "t": "soon"}'
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:6: ") as app_error:
        app_file.read_series(path)
    with pytest.raises(TraceError) as engine_error:
        workload.request_lengths(path)
    assert str(app_error.value) == str(engine_error.value)
    assert trace_cli.main(["export", str(path), "-o", str(tmp_path / "x.json")]) == 2
    assert str(app_error.value) in capsys.readouterr().err


def test_the_window_series_are_the_steps(tmp_path):
    series = app_file.read_series(synthetic.write(tmp_path / "t.jsonl"))
    steps = [e for e in synthetic.events() if isinstance(e, Step)]
    assert series.tokens == [s.tokens for s in steps]
    assert series.kv_usage == [s.kv_used / s.kv_total for s in steps]
    assert series.t == [s.t for s in steps]  # the first event is at t=0
    assert series.header.block_size == synthetic.BLOCK_SIZE
    assert series.events == len(synthetic.events())


# -- what it imports -----------------------------------------------------------------------
def loaded_after(module: str, *packages: str) -> list[str]:
    """Which of `packages` a fresh interpreter has loaded once it imports `module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    loaded = json.loads(out.stdout)
    return [p for p in packages if any(m == p or m.startswith(p + ".") for m in loaded)]


@pytest.mark.parametrize("module", ["kvscope.ipc.trace_format", "kvscope.app.traces.file"])
def test_the_format_loads_neither_torch_nor_qt_nor_the_engine(module):
    assert loaded_after(module, "msgspec") == ["msgspec"]  # the check sees what is loaded
    assert loaded_after(module, "torch", "PySide6", "pyqtgraph", "kvscope.engine",
                        "kvscope.kernels") == []


def test_trace_compare_and_export_start_without_torch():
    """Only `kvscope trace replay` runs an engine; the window's compare step needs no torch."""
    assert loaded_after("kvscope.engine.cli.trace", "torch") == []
