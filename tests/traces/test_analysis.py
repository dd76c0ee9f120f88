"""Trace analysis on a hand-written session: summary, compare, output check, Perfetto and CSV."""
from __future__ import annotations

import csv
import json

import pytest

from kvscope.engine.traces.compare import compare, ratios
from kvscope.engine.traces.export_csv import CSV_FIELDS, write_csv
from kvscope.engine.traces.export_perfetto import to_chrome, write_chrome
from kvscope.engine.traces.reproduced_outputs import check_outputs, outputs_of
from kvscope.engine.traces.summary import percentile, summarize
from kvscope.ipc.trace_format import Finish, Reconfigure, Step, Token, Trace
from tests.traces import synthetic


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_summary_of_the_synthetic_session():
    s = summarize(synthetic.trace())
    assert (s.requests, s.finished, s.aborted, s.steps) == (2, 2, 0, 3)
    assert s.prompt_tokens == 6 + 3 and s.output_tokens == 4 and s.preemptions == 1
    # from r0's arrival at 0.0 to the end of the last step (0.4 + 0.05)
    assert s.duration_s == pytest.approx(0.45)
    assert s.throughput_tok_s == pytest.approx(4 / 0.45)
    # first tokens: r0 0.25 after arriving at 0.0, r1 0.15 after 0.1
    assert s.ttft_p50_ms == pytest.approx((250 + 150) / 2)
    # r0's tokens 0.1 apart, r1's 0.2 (across its preemption)
    assert s.itl_p50_ms == pytest.approx(150) and s.itl_p99_ms == pytest.approx(199)
    assert s.kv_usage_peak == pytest.approx(3 / 16)
    assert s.kv_usage_mean == pytest.approx((3 + 2 + 1) / 3 / 16)
    # slots held but empty: 1 - kv_tokens / (kv_used * block_size), per step
    waste = [1 - 9 / 12, 1 - 7 / 8, 1 - 4 / 4]
    assert s.internal_waste_mean == pytest.approx(sum(waste) / 3)
    assert not s.truncated and s.block_size == synthetic.BLOCK_SIZE


def test_internal_waste_follows_a_reconfigured_block_size():
    trace = synthetic.trace()
    steps = [e for e in trace.events if isinstance(e, Step)]
    rebuilt = Reconfigure(t=0.28, config={}, kv_dtype="float32", block_size=8, num_kv_blocks=8)
    trace.events.insert(trace.events.index(steps[1]), rebuilt)
    s = summarize(trace)
    assert s.reconfigures == 1
    # the steps after it hold their tokens in 8-token blocks
    assert s.internal_waste_mean == pytest.approx((1 - 9 / 12 + 1 - 7 / 16 + 1 - 4 / 8) / 3)


def test_summary_of_a_trace_without_tokens_has_no_latencies():
    s = summarize(Trace(synthetic.header(), []))
    assert s.requests == s.output_tokens == 0 and s.duration_s == 0
    assert s.throughput_tok_s is None and s.ttft_p50_ms is None and s.itl_p90_ms is None
    assert s.kv_usage_peak == s.kv_usage_mean == 0


def test_compare_takes_ratios_of_numbers_only():
    a = summarize(synthetic.trace())
    b = summarize(synthetic.trace(block_size=8))
    c = compare(a, b)
    assert c.ratio["block_size"] == 2 and c.ratio["output_tokens"] == 1
    assert c.ratio["aborted"] is None  # zero in A
    assert "truncated" not in c.ratio and "model" not in c.ratio  # a bool, a string
    d = c.as_dict()
    assert d["a"]["block_size"] == 4 and d["b"]["block_size"] == 8
    assert json.loads(json.dumps(d)) == d
    assert ratios({"x": 2, "y": None, "z": 1.0}, {"x": 3, "y": 1, "z": True}) == {"x": 1.5}


def _with_tokens(trace: Trace, rid: str, tokens: list[int]) -> Trace:
    events = [e for e in trace.events if not (isinstance(e, Token) and e.id == rid)]
    return Trace(trace.header, [*events, Token(t=0.5, id=rid, tokens=tokens)])


def test_outputs_are_compared_only_where_they_must_match():
    recorded = synthetic.trace()
    assert outputs_of(recorded) == {"r0": [11, 12], "r1": [21, 22]}
    greedy = [{"temperature": 0.0}, {}]
    same = check_outputs(greedy, recorded, synthetic.trace(block_size=8), "auto")
    assert same.identical is True and same.compared == 2 and same.differing == []
    other = check_outputs(greedy, recorded, _with_tokens(recorded, "r1", [21, 99]), "auto")
    assert other.identical is False and other.differing == ["r1"]
    assert other.as_dict() == {"outputs_identical": False, "outputs_compared": 2,
                               "outputs_differing": ["r1"]}
    for sampling, new, kv, why in [
        ([{"temperature": 0.7}], recorded, "auto", "greedy"),
        (greedy, recorded, "int8", "quantised"),
        (greedy, synthetic.trace(kv_dtype="fp8"), "auto", "quantised"),
        (greedy, synthetic.trace(dtype="bfloat16"), "auto", "bfloat16"),
    ]:
        check = check_outputs(sampling, recorded, new, kv)
        assert check.identical is None and why in check.not_compared
        assert check.as_dict()["outputs_identical"] is None
    assert "no prompts" in check_outputs(greedy, synthetic.trace(include_prompts=False),
                                         recorded, "auto").not_compared
    assert "without outputs" in check_outputs(greedy, None, recorded, "auto").not_compared


def _spans(events: list[dict]) -> dict[str, list[str]]:
    """Per request id, the names of its async spans in begin order; asserts they nest."""
    begun: dict[str, list[str]] = {}
    open_: dict[str, list[str]] = {}
    for e in events:
        if e["ph"] == "b":
            begun.setdefault(e["id"], []).append(e["name"])
            open_.setdefault(e["id"], []).append(e["name"])
        elif e["ph"] == "e":
            assert open_[e["id"]].pop() == e["name"]
    assert all(not stack for stack in open_.values())
    return begun


def test_perfetto_spans_follow_each_request(tmp_path):
    chrome = to_chrome(synthetic.trace())
    ev = chrome["traceEvents"]
    spans = _spans(ev)
    assert spans["r0"] == ["r0", "queued", "prefill", "decode"]
    assert spans["r1"] == ["r1", "queued", "prefill", "decode", "preempted", "prefill", "decode"]
    ts = [e["ts"] for e in ev if "ts" in e]
    assert ts == sorted(ts) and all(isinstance(t, int) for t in ts)
    steps = [e for e in ev if e["ph"] == "X"]
    assert [e["dur"] for e in steps] == [50_000] * 3 and steps[0]["args"]["tokens"] == 9
    usage = [e["args"]["usage"] for e in ev if e["name"] == "kv_usage"]
    assert usage == [3 / 16, 2 / 16, 1 / 16]
    (preempt,) = [e for e in ev if e["ph"] == "i"]
    assert preempt["args"]["request"] == "r1" and preempt["ts"] == 300_000
    assert chrome["metadata"]["block_size"] == synthetic.BLOCK_SIZE
    out = tmp_path / "t.json"
    write_chrome(synthetic.trace(), out)
    assert json.loads(out.read_text()) == chrome


def test_perfetto_closes_the_spans_of_a_trace_cut_short():
    trace = synthetic.trace()
    trace.events = [e for e in trace.events if not isinstance(e, Finish)]
    ev = to_chrome(trace)["traceEvents"]
    assert set(_spans(ev)) == {"r0", "r1"}  # every begin ended (checked in _spans)
    end = max(e["ts"] + e.get("dur", 0) for e in ev if "ts" in e)
    assert {e["ts"] for e in ev if e["ph"] == "e" and e["name"] in ("r0", "r1")} == {end}


def test_csv_has_one_row_per_step(tmp_path):
    path = tmp_path / "t.csv"
    write_csv(synthetic.trace(), path)
    rows = list(csv.DictReader(path.open()))
    steps = [e for e in synthetic.events() if isinstance(e, Step)]
    assert list(rows[0]) == CSV_FIELDS and len(rows) == len(steps)
    assert [int(r["tokens"]) for r in rows] == [s.tokens for s in steps]
    assert [float(r["kv_usage"]) for r in rows] == [s.kv_used / s.kv_total for s in steps]
    assert [int(r["t_us"]) for r in rows] == [round(s.t * 1e6) for s in steps]
