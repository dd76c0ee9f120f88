"""`kvscope trace replay|compare|export` and Mooncake-style input, on the tiny model."""
from __future__ import annotations

import argparse
import csv
import json

import pytest

from kvscope.engine.cli import trace as trace_command
from kvscope.engine.cli.trace import main as trace_cli
from kvscope.ipc.trace_format import Arrival, Step, read_trace
from kvscope.main import main as kvscope
from kvscope.testing.tiny_models import save_tiny_model
from tests.traces import synthetic
from tests.traces.test_record import record


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "t.jsonl"
    record(model, path)
    return path


def run_json(capsys, argv):
    assert trace_cli(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_against_another_block_size_reproduces_outputs(model, recorded, tmp_path,
                                                              capsys):
    out = tmp_path / "r.jsonl"
    s = run_json(capsys, ["replay", str(recorded), "--model", str(model), "--block-size", "16",
                          "--num-kv-blocks", "64", "--speed", "max", "--json", "-o", str(out)])
    assert s["outputs_identical"] is True and s["outputs_compared"] == 4
    assert s["block_size"] == 16 and s["requests"] == 4 and s["finished"] == 4
    assert s["output_tokens"] == 120 and s["preemptions"] == 0 and s["rejected"] == {}
    for key in ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
                "kv_usage_peak", "kv_usage_mean", "internal_waste_mean"):
        assert s[key] is not None and s[key] >= 0
    assert 0 < s["kv_usage_mean"] <= s["kv_usage_peak"] <= 1
    new = read_trace(out)
    assert [a.id for a in new.of_type(Arrival)] == [a.id for a in
                                                   read_trace(recorded).of_type(Arrival)]


@pytest.mark.parametrize("option,reason", [(["--kv-dtype", "int8"], "quantised"),
                                           (["--dtype", "bfloat16"], "bfloat16")])
def test_replay_that_may_change_outputs_does_not_claim_identity(model, recorded, tmp_path,
                                                                 capsys, option, reason):
    s = run_json(capsys, ["replay", str(recorded), "--model", str(model), *option,
                          "--num-kv-blocks", "24", "--block-size", "4", "--speed", "max",
                          "--json", "-o", str(tmp_path / "r.jsonl")])
    assert s["outputs_identical"] is None and reason in s["outputs_not_compared"]
    assert s["finished"] == 4


def test_replay_refuses_a_bad_speed_and_its_own_input_as_output(model, recorded, capsys):
    assert trace_cli(["replay", str(recorded), "--model", str(model), "--speed", "0"]) == 2
    assert "--speed" in capsys.readouterr().err
    assert trace_cli(["replay", str(recorded), "--model", str(model),
                      "-o", str(recorded)]) == 2
    assert "input trace" in capsys.readouterr().err


def test_replay_keeps_inter_arrival_times_scaled(model, tmp_path, capsys):
    src = tmp_path / "mc.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2}\n'
                   '{"timestamp": 400, "input_length": 8, "output_length": 2}\n')
    out = tmp_path / "r.jsonl"
    run_json(capsys, ["replay", str(src), "--model", str(model), "--speed", "2", "--json",
                      "-o", str(out)])
    a, b = read_trace(out).of_type(Arrival)
    assert 0.18 <= b.t - a.t < 1.0


def test_mooncake_input_replays_with_shared_prefixes(model, tmp_path, capsys):
    src = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 24, "output_length": 3, "hash_ids": [1, 2, 7]},
            {"timestamp": 9, "input_length": 6, "output_length": 2}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.jsonl"
    s = run_json(capsys, ["replay", str(src), "--model", str(model), "--block-size", "4",
                          "--num-kv-blocks", "64", "--hash-block-size", "8", "--speed", "max",
                          "--json", "-o", str(out)])
    assert s["requests"] == 3 and s["finished"] == 3 and s["output_tokens"] == 9
    assert s["outputs_identical"] is None
    p0, p1, p2 = (a.prompt for a in read_trace(out).of_type(Arrival))
    assert (len(p0), len(p1), len(p2)) == (20, 24, 6)
    assert p0[:16] == p1[:16] and p0[16:20] != p1[16:20]
    # fragsim reads the same lengths
    assert kvscope(["fragsim", "--trace", str(src), "--block-size", "16", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert f["used_slots"] == 24 + 27 + 8 and f["paged_slots"] == 32 + 32 + 16


def test_bad_mooncake_line_is_an_error(model, tmp_path, capsys):
    src = tmp_path / "mooncake.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 20, "output_length": 4}\n'
                   '{"timestamp": 1, "input_length": "many", "output_length": 4}\n')
    assert trace_cli(["replay", str(src), "--model", str(model)]) == 2
    assert "mooncake.jsonl:2:" in capsys.readouterr().err


def test_compare_json_has_ratios(model, recorded, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    run_json(capsys, ["replay", str(recorded), "--model", str(model), "--block-size", "16",
                      "--num-kv-blocks", "64", "--speed", "max", "--json", "-o", str(out)])
    c = run_json(capsys, ["compare", str(recorded), str(out), "--json"])
    assert c["a"]["block_size"] == 4 and c["b"]["block_size"] == 16
    assert c["ratio"]["block_size"] == 4 and c["ratio"]["output_tokens"] == 1
    assert c["ratio"]["throughput_tok_s"] == pytest.approx(
        c["b"]["throughput_tok_s"] / c["a"]["throughput_tok_s"])
    assert trace_cli(["compare", str(recorded), str(out)]) == 0
    assert "B/A" in capsys.readouterr().out


def test_export_is_valid_chrome_trace_json(recorded, tmp_path, capsys):
    out, out_csv = tmp_path / "t.json", tmp_path / "t.csv"
    assert trace_cli(["export", str(recorded), "-o", str(out), "--csv", str(out_csv)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    phases = {e["ph"] for e in events}
    assert {"X", "C", "b", "e", "i", "M"} <= phases
    ts = [e["ts"] for e in events if "ts" in e]
    assert all(isinstance(t, int) for t in ts) and ts == sorted(ts)
    assert all(e["dur"] >= 1 for e in events if e["ph"] == "X")
    assert {e["name"] for e in events if e["ph"] == "C"} == {"batch_size", "tokens_per_step",
                                                           "kv_usage"}
    # async spans nest per request: a stack per id, every begin ends, in order
    stacks: dict[str, list[str]] = {}
    for e in events:
        if e["ph"] == "b":
            stacks.setdefault(e["id"], []).append(e["name"])
        elif e["ph"] == "e":
            assert stacks[e["id"]].pop() == e["name"]
    assert all(not s for s in stacks.values()) and len(stacks) == 4
    names = {e["name"] for e in events if e["ph"] == "b"}
    assert {"queued", "prefill", "decode", "preempted"} <= names
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == len(read_trace(recorded).of_type(Step))
    assert {"batch_size", "tokens", "kv_usage"} <= set(rows[0])


def test_corrupt_trace_is_a_clear_error(recorded, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = recorded.read_text().splitlines()
    lines[4] = '{"ev": "step", "t": "soon"}'
    bad.write_text("\n".join(lines) + "\n")
    assert trace_cli(["export", str(bad), "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:5:" in err and "error" in err


def test_the_command_module_contract(tmp_path, capsys):
    """add_parser registers `trace` (with its subcommands) on a subparsers action; run runs it;
    the launcher reaches it the same way."""
    parser = argparse.ArgumentParser(prog="kvscope")
    sub = parser.add_subparsers(dest="command", required=True)
    trace_parser = trace_command.add_parser(sub)
    assert list(sub.choices) == ["trace"] and sub.choices["trace"] is trace_parser
    path = synthetic.write(tmp_path / "t.jsonl")
    args = parser.parse_args(["trace", "compare", str(path), str(path), "--json"])
    assert args.command == "trace" and trace_command.run(args) == 0
    ratio = json.loads(capsys.readouterr().out)["ratio"]
    assert ratio["output_tokens"] == ratio["steps"] == 1 and ratio["aborted"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "launch"])
    assert "replay" in capsys.readouterr().err  # the error lists the subcommands
    out = tmp_path / "t.json"
    assert kvscope(["trace", "export", str(path), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["metadata"]["block_size"] == synthetic.BLOCK_SIZE
