"""A trace recorded on the in-process engine, replayed with `trace replay --url` against a real
`kvscope serve --http-port` on the same tiny model: the server streams back exactly the text
the recorded greedy token ids decode to, and `trace compare` says so too."""
from __future__ import annotations

import json

import pytest

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.cli import trace as trace_cli
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.traces.http_replay import HttpReplayConfig, replay_url_file
from kvscope.engine.traces.recorder import start_trace
from kvscope.engine.traces.reproduced_outputs import outputs_of
from kvscope.ipc.trace_format import Response, read_trace
from kvscope.testing.tiny_models import save_tiny_model
from tests.support.server_harness import Server

PROMPTS = [[5, 17, 99, 3, 42, 8], [120, 7, 7, 64], [33, 1, 250, 19, 80, 81, 82]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "rec.jsonl"
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64))
    start_trace(engine, path)
    for k, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=10 + k), f"r{k}")
    while engine.has_unfinished():
        engine.step()
    engine.stop_trace()
    return path


@pytest.fixture(scope="module")
def url(model, tmp_path_factory):
    from kvscope.ipc import EngineClient

    s = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", "--http-port", "0")
    try:
        with EngineClient(s.command, s.state, timeout=60, heartbeat_timeout=15) as c:
            yield c.hello().http_url
    finally:
        s.stop()


def test_replay_against_kvscope_serve_reproduces_greedy_outputs(model, recorded, url, tmp_path,
                                                                capsys):
    out = tmp_path / "replay.jsonl"
    result = replay_url_file(recorded, out, HttpReplayConfig(
        url=url, speed=None, max_concurrency=2, tokenizer=str(model)))
    assert result.errors == {} and result.stopped is None
    assert result.outputs.identical is True and result.outputs.compared == 3
    trace = read_trace(out)
    assert trace.header.server.version is not None and trace.header.server.models["data"]
    # usage came from the server, and matches the recorded output lengths.
    lengths = {k: len(v) for k, v in outputs_of(read_trace(recorded)).items()}
    assert {r.id: r.completion_tokens for r in trace.of_type(Response)} == lengths
    assert {r.usage_from for r in trace.of_type(Response)} == {"server"}
    assert trace_cli.main(["compare", str(recorded), str(out), "--tokenizer", str(model),
                           "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)["pairs"][0]
    assert pair["outputs"]["identical"] is True and pair["outputs"]["compared"] == 3
    assert [d["output_tokens"] for d in pair["deltas"]] == [0, 0, 0]
