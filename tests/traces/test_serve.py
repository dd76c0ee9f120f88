"""`kvscope serve --trace PATH` and the trace_start/trace_stop commands (a real subprocess)."""
from __future__ import annotations

import pytest

from kvscope.engine.traces.reproduced_outputs import outputs_of
from kvscope.ipc import EngineClient, EngineError
from kvscope.ipc.trace_format import Arrival, Finish, read_trace
from tests.support.server_harness import Server, save_chat_model


def test_serve_records_a_trace_and_starts_and_stops_on_command(tmp_path):
    model = save_chat_model(tmp_path / "chat", seed=1)
    first, second = tmp_path / "serve.jsonl", tmp_path / "second.jsonl"
    server = Server(model, tmp_path / "serve.log", "--block-size", "8", "--num-kv-blocks", "64",
                    "--trace", str(first), "--no-prompts", "--trace-dir", str(tmp_path))
    try:
        client = EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15)
        try:
            got = client.generate([3, 4, 5, 6], {"max_tokens": 5, "ignore_eos": True},
                                  timeout=60)
            stopped = client.trace_stop()
            assert not stopped.recording and stopped.path == str(first) and stopped.bytes > 0
            assert client.trace_stop().path is None  # nothing left to stop
            started = client.trace_start(str(second))
            assert started.recording and started.bytes > 0  # the header is on disk at once
            got2 = client.generate([7, 8, 9], {"max_tokens": 4, "ignore_eos": True},
                                   timeout=60)
            with pytest.raises(EngineError) as exc:
                client.trace_start(str(first))
            assert exc.value.code == "refused" and "exists" in str(exc.value)
        finally:
            client.close()
    finally:
        assert server.stop() == 0
    trace = read_trace(first)
    assert trace.header.include_prompts is False and trace.header.block_size == 8
    (arrival,) = trace.of_type(Arrival)
    assert arrival.prompt is None and arrival.prompt_len == 4
    assert outputs_of(trace)[arrival.id] == got.token_ids
    assert [f.reason for f in trace.of_type(Finish)] == ["length"]
    trace2 = read_trace(second)  # closed by the server's exit
    assert trace2.header.include_prompts is True
    (arrival2,) = trace2.of_type(Arrival)
    assert arrival2.prompt == [7, 8, 9] and outputs_of(trace2)[arrival2.id] == got2.token_ids


def test_kill_9_mid_generation_keeps_every_flushed_line(tmp_path):
    """A SIGKILL loses at most the line being written: the trace still reads, with the
    arrival, steps and tokens up to the kill."""
    import signal
    import time

    from kvscope.ipc.trace_format import Step, Token

    model = save_chat_model(tmp_path / "chat", seed=2)
    path = tmp_path / "killed.jsonl"
    server = Server(model, tmp_path / "serve.log", "--block-size", "4", "--num-kv-blocks", "64",
                    "--trace", str(path))
    client = EngineClient(server.command, server.state, timeout=30, heartbeat_timeout=15)
    try:
        rid = client.submit([3, 4, 5], {"max_tokens": 400, "ignore_eos": True})
        deadline = time.monotonic() + 30
        seen = 0
        for delta in client.stream(rid, timeout=30):
            seen += len(delta.token_ids)
            if seen >= 10 or time.monotonic() > deadline:
                break
        server.signal(signal.SIGKILL)
        server.proc.wait(10)
    finally:
        client.close()
        server.stop()
    trace = read_trace(path)
    (arrival,) = trace.of_type(Arrival)
    assert arrival.id == rid and not trace.of_type(Finish)
    assert len(trace.of_type(Step)) >= 10
    assert sum(len(t.tokens) for t in trace.of_type(Token)) >= 10
