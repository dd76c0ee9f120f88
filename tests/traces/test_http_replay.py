"""`trace replay --url` against a fake OpenAI server with planned replies: what the trace
records (send, chunk times, TTFT/E2E, usage or chunk counts, the server's answers), and every
failure recorded per request - 429, 401, a wrong model, a disconnect mid-stream, malformed
SSE, a reply that is not a stream, a request past its timeout, a dropped idle connection."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from kvscope.engine.cli import trace as trace_cli
from kvscope.engine.traces.compare import compare_runs, latency_values
from kvscope.engine.traces.http_replay import HttpReplayConfig, replay_url_file
from kvscope.engine.traces.requests import load_run
from kvscope.engine.traces.summary import percentile
from kvscope.ipc.trace_format import Abort, Arrival, Chunk, Finish, Response, read_trace
from tests.traces import synthetic
from tests.traces.fake_openai import MODEL, FakeOpenAI, Plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def source(tmp_path):
    return str(synthetic.write(tmp_path / "rec.jsonl"))


def replay(source, tmp_path, url, **cfg):
    out = str(tmp_path / "out.jsonl")
    cfg = {"speed": None, "tokenizer": "none", **cfg}
    result = replay_url_file(source, out, HttpReplayConfig(url=url, **cfg))
    return result, read_trace(out)


def by_first_token(plans: dict[int, Plan]):
    """A plan per request, chosen by its prompt's first token (synthetic: r0 1, r1 7)."""
    return lambda body: plans.get((body.get("prompt") or [0])[0], Plan())


def test_records_sends_chunk_times_ttft_e2e_and_the_server(source, tmp_path):
    plan = Plan(pieces=["x", "y", "z", "w"], delays=[0.3, 0.06, 0.06, 0.06])
    with FakeOpenAI(plan=lambda body: plan) as srv:
        result, trace = replay(source, tmp_path, srv.url.removesuffix("/v1"))
    h = trace.header
    assert h.server.url == srv.url and h.server.model == MODEL and h.device == "external"
    assert h.server.models["data"][0]["id"] == MODEL and h.server.version == {"version": "9.9-fake"}
    # r0's body (the two may reach the server in either order): the recorded prompt as token
    # ids, its sampling, usage asked for
    body = next(b for b in srv.bodies if b["prompt"][0] == 1)
    assert body["prompt"] == [1, 2, 3, 4, 5, 6] and body["max_tokens"] == 2
    assert body["temperature"] == 0.0 and body["stream"] and body["stream_options"] == {
        "include_usage": True} and body["model"] == MODEL
    assert [a.id for a in trace.of_type(Arrival)] == ["r0", "r1"]
    responses = {r.id: r for r in trace.of_type(Response)}
    for rid, r in responses.items():
        chunks = [c for c in trace.of_type(Chunk) if c.id == rid]
        sent = next(a.t for a in trace.of_type(Arrival) if a.id == rid)
        assert "".join(c.text for c in chunks) == "xyzw"
        # The server waited 300 ms before the first piece and 60 ms before each next one.
        assert r.ttft == pytest.approx(chunks[0].t - sent) and r.ttft >= 0.3
        assert all(b.t - a.t >= 0.055 for a, b in zip(chunks, chunks[1:], strict=False))
        # Three more pieces 60 ms apart, with the gaps' own tolerance (timestamps are taken on
        # either side of a socket, so a gap can read a few ms short).
        assert r.e2e >= r.ttft + 3 * 0.055 and r.t == pytest.approx(sent + r.e2e)
        assert r.status == 200 and r.error is None and r.finish_reason == "length"
        assert (r.completion_tokens, r.usage_from, r.attempts) == (4, "server", 1)
    assert len(trace.of_type(Finish)) == 2 and result.errors == {}
    # The summary's percentiles are those of the recorded times.
    ttfts = sorted(r.ttft for r in responses.values())
    assert result.summary.ttft_p50_ms == pytest.approx(percentile(ttfts, 50) * 1000)
    assert result.summary.itl_p50_ms >= 55 and result.summary.output_tokens == 8
    gaps = latency_values(load_run(trace_path := str(tmp_path / "out.jsonl")))["itl"]
    assert len(gaps) == 6 and min(gaps) >= 0.055
    assert load_run(trace_path).requests["r0"].text == "xyzw"


def test_a_server_without_usage_is_counted_from_chunks(source, tmp_path):
    with FakeOpenAI(plan=lambda body: Plan(usage=False)) as srv:
        result, trace = replay(source, tmp_path, srv.url)
    assert {(r.completion_tokens, r.usage_from) for r in trace.of_type(Response)} == {
        (3, "chunks")}
    assert result.summary.output_tokens == 6


def test_429_and_wrong_model_are_recorded_per_request(source, tmp_path):
    plans = {7: Plan(status=429, error="too many requests in flight")}
    with FakeOpenAI(plan=by_first_token(plans)) as srv:
        result, trace = replay(source, tmp_path, srv.url)
    assert result.errors == {"r1": "HTTP 429: too many requests in flight"}
    assert [a.id for a in trace.of_type(Abort)] == ["r1"] and result.summary.errors == 1
    assert {r.id: r.status for r in trace.of_type(Response)} == {"r0": 200, "r1": 429}

    def wrong_model(body):
        return Plan() if body["model"] == MODEL else Plan(status=404, error="no such model")

    with FakeOpenAI(plan=wrong_model) as srv:
        result, _ = replay(source, tmp_path, srv.url, model="gpt-9")
    assert set(result.errors.values()) == {"HTTP 404: no such model"}


def test_api_key_is_sent_and_a_wrong_one_is_a_401_per_request(source, tmp_path):
    with FakeOpenAI(auth="s3cret") as srv:
        bad, _ = replay(source, tmp_path, srv.url, api_key="wrong")
        good, _ = replay(source, tmp_path, srv.url, api_key="s3cret")
    assert set(bad.errors.values()) == {"HTTP 401: wrong key"} and len(bad.errors) == 2
    assert good.errors == {} and good.summary.finished == 2


@pytest.mark.parametrize("plan, error", [
    (Plan(disconnect_after=1), "connection lost mid-stream, after 1 chunks"),
    (Plan(malformed_after=1), "malformed stream after 1 chunks"),
    (Plan(content_type="application/json"), "expected an event stream"),
])
def test_broken_streams_are_errors_of_their_request(source, tmp_path, plan, error):
    with FakeOpenAI(plan=by_first_token({7: plan})) as srv:
        result, trace = replay(source, tmp_path, srv.url)
    assert list(result.errors) == ["r1"] and error in result.errors["r1"]
    assert result.summary.finished == 1  # r0 went through
    if plan.disconnect_after:
        assert [c.text for c in trace.of_type(Chunk) if c.id == "r1"] == ["a"]


def test_a_request_past_its_timeout_ends_without_hanging_the_run(source, tmp_path):
    slow = Plan(delays=[5.0, 0.0, 0.0])
    with FakeOpenAI(plan=by_first_token({7: slow})) as srv:
        result, _ = replay(source, tmp_path, srv.url, request_timeout_s=0.5)
    assert "no end within the request timeout (0.5 s)" in result.errors["r1"]
    assert result.summary.finished == 1 and result.stopped is None


def test_the_runs_timeout_stops_it_and_keeps_what_ended(source, tmp_path):
    slow = Plan(delays=[5.0, 0.0, 0.0])
    with FakeOpenAI(plan=by_first_token({7: slow})) as srv:
        result, trace = replay(source, tmp_path, srv.url, timeout_s=1.0)
    assert result.stopped == "timeout" and "timeout (1 s) ran out" in result.errors["r1"]
    assert {r.id for r in trace.of_type(Response)} == {"r0", "r1"}


def mooncake(path, n):
    path.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 5 + i,
                                        "output_length": 3, "hash_ids": [0]}) + "\n"
                            for i in range(n)))
    return str(path)


def test_a_dropped_idle_connection_is_retried_once(tmp_path):
    """llama-server closes idle keep-alive connections: the next request on one gets no
    answer at all, and goes again on a fresh connection."""
    src = mooncake(tmp_path / "mc.jsonl", 3)
    with FakeOpenAI(drop_idle=True) as srv:
        result, trace = replay(src, tmp_path, srv.url, max_concurrency=1, vocab_size=100,
                               hash_block_size=4)
    assert result.errors == {} and result.summary.finished == 3 and srv.dropped >= 1
    assert sorted(r.attempts for r in trace.of_type(Response)) == [1, 2, 2]
    # Mooncake items: synthesised prompts of the recorded lengths, sharing the hash block.
    prompts = [b["prompt"] for b in srv.bodies]
    assert [len(p) for p in prompts] == [5, 6, 7] and prompts[0][:4] == prompts[2][:4]
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 for b in srv.bodies)


def test_ignore_eos_asks_for_the_recorded_lengths_else_early_ends_are_counted(tmp_path):
    evs = synthetic.events()
    for e in evs:  # asked for 8, emitted 2 (r0) and 2 (r1): they ended at EOS
        if isinstance(e, Arrival):
            e.sampling = {"max_tokens": 8, "temperature": 0.0}
    src = str(synthetic.write(tmp_path / "rec.jsonl", evs))
    one = Plan(pieces=["a"], delays=[0.0])
    with FakeOpenAI(plan=lambda body: one) as srv:
        result, _ = replay(src, tmp_path, srv.url)
        assert result.ended_early == ["r0", "r1"]  # 1 token where the recording had 2
        assert srv.bodies[0]["max_tokens"] == 8 and "ignore_eos" not in srv.bodies[0]
        srv.bodies.clear()
        replay(src, tmp_path, srv.url, ignore_eos=True)
    assert {(b["max_tokens"], b["ignore_eos"]) for b in srv.bodies} == {(2, True)}


def test_chat_needs_a_tokenizer_and_a_bad_url_is_refused(source, tmp_path):
    with pytest.raises(ValueError, match="--chat sends prompts as text"):
        replay(source, tmp_path, "http://127.0.0.1:9/v1", api="chat")
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        replay(source, tmp_path, "ftp://x")


def test_no_server_lists_no_model_and_is_a_clear_error(source, tmp_path):
    with pytest.raises(ValueError, match="which model to ask for"):
        replay(source, tmp_path, "http://127.0.0.1:9/v1", connect_timeout_s=1)
    # Given a model, the refused connections are each request's error (tried twice).
    result, _ = replay(source, tmp_path, "http://127.0.0.1:9/v1", model="m")
    assert all("before any answer (2 attempts)" in e for e in result.errors.values())


def test_cli_json_report_and_compare_against_the_recording(source, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    with FakeOpenAI(plan=by_first_token({7: Plan(status=429, error="slow down")})) as srv:
        assert trace_cli.main(["replay", source, "--url", srv.url, "--speed", "max",
                               "--tokenizer", "none", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request_errors"] == {"r1": "HTTP 429: slow down"}
    assert report["url"] == srv.url and report["requests"] == 2 and report["errors"] == 1
    runs = [load_run(source), load_run(out)]
    c = compare_runs(runs)
    assert c.runs[1].failed == 1 and c.runs[1].errors == {"HTTP 429: slow down": 1}


def press_ctrl_c_as_in_a_terminal() -> None:
    """A foreground command gets SIGINT's default; a suite started as a background job of a
    non-interactive shell (`make test &`) passes SIG_IGN down, and the replay never saw it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_cleanly_and_keeps_what_was_recorded(source, tmp_path):
    out = tmp_path / "int.jsonl"
    with FakeOpenAI(plan=by_first_token({7: Plan(delays=[30.0, 0.0, 0.0])})) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope", "trace", "replay", source, "--url", srv.url,
             "--speed", "max", "--tokenizer", "none", "-o", str(out), "--json"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=press_ctrl_c_as_in_a_terminal)
        deadline = time.monotonic() + 120
        while b'"response"' not in (out.read_bytes() if out.exists() else b""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    report = json.loads(stdout)
    assert report["stopped"] == "interrupted" and report["request_errors"] == {
        "r1": "interrupted"}
    trace = read_trace(out)  # complete lines only
    assert {r.id: r.error for r in trace.of_type(Response)} == {"r0": None, "r1": "interrupted"}
    assert msgspec.json.decode(out.read_bytes().splitlines()[-1])["ev"] == "abort"


def test_an_external_run_replays_again_and_its_text_is_the_reference(source, tmp_path):
    first = tmp_path / "first.jsonl"
    with FakeOpenAI() as srv:
        replay_url_file(source, first, HttpReplayConfig(url=srv.url, speed=None,
                                                        tokenizer="none"))
        again, trace = replay(str(first), tmp_path, srv.url)
    assert again.outputs.identical is True and again.outputs.compared == 2
    # the second replay sent r0 as recorded (its two requests may reach the server in either
    # order: at speed None they go out together)
    sent = {tuple(b["prompt"]): b["max_tokens"] for b in srv.bodies[2:]}
    assert len(srv.bodies) == 4 and sent[(1, 2, 3, 4, 5, 6)] == 2


def test_chat_sends_the_prompt_decoded_by_the_tokenizer(source, tmp_path):
    from kvscope.testing.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny", "llama", seed=0)
    with FakeOpenAI() as srv:
        result, trace = replay(source, tmp_path, srv.url, api="chat", tokenizer=str(model))
    assert [{"role": "user", "content": "<1><2><3><4><5><6>"}] in [
        b["messages"] for b in srv.bodies]
    assert all("prompt" not in b for b in srv.bodies) and trace.header.server.api == "chat"
    assert result.errors == {} and load_run(str(tmp_path / "out.jsonl")).requests[
        "r0"].text == "abc"


def test_a_workload_without_a_vocabulary_is_a_clear_error(tmp_path):
    src = mooncake(tmp_path / "mc.jsonl", 2)
    with pytest.raises(ValueError, match="give --tokenizer or --vocab-size"):
        replay(src, tmp_path, "http://127.0.0.1:9/v1")
