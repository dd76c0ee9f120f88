"""`kvscope trace compare` over kvscope traces, external replays and Mooncake workloads: its
numbers equal a hand computation on a small trace; runs of other requests are refused."""
from __future__ import annotations

import json

import pytest

from kvscope.engine.cli import trace as trace_cli
from kvscope.engine.traces.compare import MismatchError, compare_runs, parse_slo
from kvscope.engine.traces.requests import load_run
from kvscope.ipc.trace_format import (
    Abort,
    Arrival,
    Chunk,
    Finish,
    Response,
    ServerInfo,
    Token,
)
from tests.traces import synthetic

GREEDY = {"max_tokens": 3, "temperature": 0.0}


def external(path, texts=("abc", "de"), ids=("q0", "q1", "q2")):
    """q0: sent at 10.0, chunks at 10.2/10.3/10.5; q1: sent 10.1, chunks 10.5/10.6, ends 10.7;
    q2: a 429 after 0.1 s."""
    q0, q1, q2 = ids
    evs = [Arrival(t=10.0, id=q0, prompt_len=4, sampling=GREEDY),
           Arrival(t=10.1, id=q1, prompt_len=5, sampling=GREEDY),
           Arrival(t=10.2, id=q2, prompt_len=6, sampling=GREEDY)]
    evs += [Chunk(t=t, id=q0, text=c) for t, c in zip((10.2, 10.3, 10.5), texts[0], strict=True)]
    evs += [Response(t=10.5, id=q0, status=200, e2e=0.5, ttft=0.2, finish_reason="length",
                     prompt_tokens=4, completion_tokens=3), Finish(t=10.5, id=q0, reason="length")]
    evs += [Chunk(t=t, id=q1, text=c) for t, c in zip((10.5, 10.6), texts[1], strict=True)]
    evs += [Response(t=10.7, id=q1, status=200, e2e=0.6, ttft=0.4, finish_reason="stop",
                     completion_tokens=2), Finish(t=10.7, id=q1, reason="stop"),
            Response(t=10.3, id=q2, status=429, e2e=0.1, error="HTTP 429: busy"),
            Abort(t=10.3, id=q2)]
    server = ServerInfo(url="http://srv:8000/v1", api="completions", model="m")
    return synthetic.write(path, evs, server=server, device="external")


def kvscope_run(path):
    """The same three requests on kvscope's engine, all finished, token ids 0.. per request."""
    evs = []
    for k, rid in enumerate(("q0", "q1", "q2")):
        a = 1.0 + k
        evs += [Arrival(t=a, id=rid, prompt_len=4 + k, sampling=GREEDY),
                Token(t=a + 0.1, id=rid, tokens=[0]), Token(t=a + 0.3, id=rid, tokens=[1, 2]),
                Finish(t=a + 0.3, id=rid, reason="length")]
    return synthetic.write(path, evs)


def test_numbers_equal_a_hand_computation(tmp_path):
    c = compare_runs([load_run(external(tmp_path / "a.jsonl")),
                      load_run(kvscope_run(tmp_path / "b.jsonl"))],
                     slo=parse_slo("ttft=300ms,tpot=160ms"))
    a, b = c.runs
    assert (a.requests, a.succeeded, a.failed, a.output_tokens) == (3, 2, 1, 5)
    assert a.duration_s == pytest.approx(0.7)  # 10.0 .. q1's end at 10.7
    assert a.request_throughput == pytest.approx(2 / 0.7)
    assert a.output_throughput == pytest.approx(5 / 0.7)
    m = a.metrics
    # TTFT 200, 400 ms; TPOT (500-200)/2 = 150, (600-400)/1 = 200; ITL 100, 200, 100; E2E
    # 500, 600; percentiles linearly interpolated.
    want = {"ttft": (300, 380, 398), "tpot": (175, 195, 199.5), "itl": (100, 180, 198),
            "e2e": (550, 590, 599)}
    for name, (p50, p90, p99) in want.items():
        got = (m[f"{name}_p50_ms"], m[f"{name}_p90_ms"], m[f"{name}_p99_ms"])
        assert got == pytest.approx((p50, p90, p99)), name
    # Within ttft 300 ms and tpot 160 ms: q0 only (q1's TTFT is 400 ms, q2 failed).
    assert a.slo_met == 1 and a.goodput == pytest.approx(1 / 0.7)
    assert a.errors == {"HTTP 429: busy": 1} and a.finish_reasons == {"length": 1, "stop": 1}
    # B: each request 100 ms to its first token, 300 ms in all, 3 tokens: TPOT 100 ms.
    assert b.metrics["ttft_p50_ms"] == pytest.approx(100)
    assert b.metrics["tpot_p99_ms"] == pytest.approx(100) and b.slo_met == 3
    assert b.duration_s == pytest.approx(2.3) and b.output_tokens == 9
    pair = c.pairs[0]
    deltas = {d.id: d for d in pair.deltas}
    assert deltas["q0"].e2e_ms == pytest.approx(300 - 500)
    assert deltas["q1"].ttft_ms == pytest.approx(100 - 400)
    assert deltas["q2"].ttft_ms is None and deltas["q2"].output_tokens == 3
    assert deltas["q2"].e2e_ms is None  # failed in A: no latency to compare
    assert pair.median_delta["e2e_ms"] == pytest.approx(-250)  # -200 and -300
    assert c.cdf[0]["ttft_ms"] == pytest.approx([200, 400])


def test_runs_of_other_requests_are_refused_unless_allowed(tmp_path, capsys):
    a = external(tmp_path / "a.jsonl")
    c = external(tmp_path / "c.jsonl", ids=("q0", "q1", "other"))
    with pytest.raises(MismatchError, match="runs of different requests .* --allow-mismatch"):
        compare_runs([load_run(a), load_run(c)])
    assert trace_cli.main(["compare", str(a), str(c)]) == 2
    assert "different requests" in capsys.readouterr().err
    assert trace_cli.main(["compare", str(a), str(c), "--allow-mismatch", "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)["pairs"][0]
    assert (pair["common"], pair["only_a"], pair["only_b"]) == (2, ["q2"], ["other"])


def test_greedy_outputs_compared_where_both_runs_have_text(tmp_path):
    a = load_run(external(tmp_path / "a.jsonl"))
    same = load_run(external(tmp_path / "b.jsonl"))
    other = load_run(external(tmp_path / "c.jsonl", texts=("abc", "dx")))
    c = compare_runs([a, same, other])
    assert [(p.outputs.identical, p.outputs.compared, p.outputs.differing) for p in c.pairs] == [
        (True, 2, []), (False, 2, ["q1"])]
    ids = load_run(kvscope_run(tmp_path / "k.jsonl"))
    assert "give --tokenizer" in compare_runs([a, ids]).pairs[0].outputs.not_compared
    # With a decoder, ids 0, 1, 2 read "abc": q0 matches, q1 ("de") does not.
    decoded = compare_runs([a, ids], decode=lambda t: "".join("abc"[i] for i in t))
    assert decoded.pairs[0].outputs.differing == ["q1"]


def test_a_mooncake_workload_is_a_run_without_timings(tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 4,
                                      "output_length": 3}) + "\n" for i in range(3)))
    ext = external(tmp_path / "e.jsonl", ids=("mc-0", "mc-1", "mc-2"))
    c = compare_runs([load_run(mc), load_run(ext)])
    assert c.runs[0].kind == "workload" and c.runs[0].metrics["ttft_p50_ms"] is None
    assert c.runs[0].duration_s is None and c.runs[1].metrics["ttft_p50_ms"] == pytest.approx(300)
    assert c.pairs[0].outputs.identical is None


def test_cli_text_markdown_and_json(tmp_path, capsys):
    a, b = str(external(tmp_path / "a.jsonl")), str(kvscope_run(tmp_path / "b.jsonl"))
    assert trace_cli.main(["compare", a, b, "--slo", "ttft=300ms,tpot=160ms"]) == 0
    text = capsys.readouterr().out
    assert "TTFT p50 (ms)" in text and "goodput req/s (ttft=300ms,tpot=160ms)" in text
    assert "external via http://srv:8000/v1" in text and "1 failed: HTTP 429: busy" in text
    assert trace_cli.main(["compare", a, b, "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "| TTFT p50 (ms) | 300 | 100 | 0.333x |" in md
    assert trace_cli.main(["compare", a, b, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["metrics"]["e2e_p50_ms"] == pytest.approx(550)
    assert out["a"]["errors"] == 1 and "ratio" in out  # the summaries, as before
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("ttft=fast")
