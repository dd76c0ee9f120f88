"""Trace recording and strict reading on the tiny model."""
from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.traces.recorder import start_trace
from kvscope.engine.traces.reproduced_outputs import outputs_of
from kvscope.engine.traces.workload import request_lengths
from kvscope.ipc.trace_format import (
    Abort,
    Alloc,
    Arrival,
    Finish,
    Free,
    Preempt,
    Reconfigure,
    Step,
    Token,
    TraceError,
    read_trace,
)
from kvscope.main import main as kvscope
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


def prompts(lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


def record(model, path, include_prompts=True, **cfg):
    cfg = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 64, **cfg}
    engine = LLMEngine(EngineConfig(model=str(model), **cfg))
    start_trace(engine, path, include_prompts)
    ps = prompts([20, 30, 25, 18])
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in ps]
    while engine.has_unfinished():
        engine.step()
    outs = {i: engine.pop_output(i).token_ids for i in ids}
    engine.stop_trace()
    return engine, ps, outs


def test_record_read_round_trip(model, tmp_path):
    path = tmp_path / "t.jsonl"
    engine, ps, outs = record(model, path)
    assert engine.trace is None
    trace = read_trace(path)
    h = trace.header
    assert h.schema_version == 1 and h.include_prompts and h.block_size == 4
    assert h.config["num_kv_blocks"] == 24 and h.device == "cpu" and h.wall_time > 0
    arrivals = trace.of_type(Arrival)
    assert [a.prompt for a in arrivals] == ps
    assert outputs_of(trace) == outs
    assert len(trace.of_type(Finish)) == 4
    steps = trace.of_type(Step)
    assert len(steps) == engine.num_steps
    assert all(s.tokens == sum(n for _, n in s.seqs) <= s.budget for s in steps)
    # the pool is tiny: preemptions happen, and every block allocated is freed again
    assert len(trace.of_type(Preempt)) == engine.stats().num_preemptions > 0
    held: dict[str, list[int]] = {}
    for ev in trace.events:
        if isinstance(ev, Alloc):
            held.setdefault(ev.id, []).extend(ev.blocks)
        elif isinstance(ev, Free):
            assert held.pop(ev.id) == ev.blocks
    assert held == {}
    times = [e.t for e in trace.events if not isinstance(e, Token | Finish)]
    assert times == sorted(times)
    assert sorted(request_lengths(path)) == sorted(len(p) + 30 for p in ps)


def test_engine_without_trace_is_unchanged(model):
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64))
    assert engine.trace is None
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


def test_no_prompts_records_lengths_only(model, tmp_path):
    path = tmp_path / "t.jsonl"
    record(model, path, include_prompts=False)
    text = path.read_text()
    trace = read_trace(path)
    assert trace.header.include_prompts is False
    assert all(a.prompt is None for a in trace.of_type(Arrival))
    assert [a.prompt_len for a in trace.of_type(Arrival)] == [20, 30, 25, 18]
    assert '"prompt":' not in text


def test_abort_is_recorded(model, tmp_path):
    path = tmp_path / "t.jsonl"
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64))
    start_trace(engine, path)
    rid = engine.add_request([5] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(rid)
    engine.stop_trace()
    trace = read_trace(path)
    assert [e.id for e in trace.of_type(Abort)] == [rid]
    assert trace.of_type(Free)[-1].blocks == trace.of_type(Alloc)[0].blocks


def test_killed_writer_loses_only_the_last_line(model, tmp_path):
    path = tmp_path / "t.jsonl"
    record(model, path)
    data = path.read_bytes()
    full = read_trace(path)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[:-25])  # killed in the middle of writing the last line
    trace = read_trace(cut)
    assert trace.truncated and len(trace.events) == len(full.events) - 1
    # the same damage anywhere but the last line is an error, with its line number
    lines = data.split(b"\n")
    lines[3] = lines[3][:20]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines))
    with pytest.raises(TraceError, match=r"bad.jsonl:4:"):
        read_trace(bad)


def _with_line(model, tmp_path, n, line):
    path = tmp_path / "t.jsonl"
    record(model, path)
    lines = path.read_text().splitlines()
    lines[n] = line
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line,match", [
    ('{"ev": "token", "t": 1.0, "id": "req-0", "tokens": ["x"]}', r":3: Expected `int`"),
    ('{"ev": "token", "t": 1.0, "id": "req-0"}', r":3: Object missing required field"),
    ('{"ev": "launch_missiles", "t": 1.0}', r":3: Invalid value 'launch_missiles'"),
    ('{"ev": "step", "t": 1.0, "evil": 1}', r":3: "),
    ('[1, 2', r":3: "),
    ("__import__('os')", r":3: "),
])
def test_invalid_lines_are_rejected_with_line_number(model, tmp_path, line, match):
    with pytest.raises(TraceError, match=match):
        read_trace(_with_line(model, tmp_path, 2, line))


def test_wrong_schema_version_and_missing_header(model, tmp_path):
    path = tmp_path / "t.jsonl"
    record(model, path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["schema_version"] = 99
    path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    with pytest.raises(TraceError, match=r":1: unsupported schema_version 99"):
        read_trace(path)
    path.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(TraceError, match=r":1: expected a kvscope trace header"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceError, match=r":1: empty"):
        read_trace(path)


def test_generate_trace_option(model, tmp_path, capsys):
    path = tmp_path / "g.jsonl"
    assert kvscope(["generate", "abc", "--raw", "--model", str(model), "--max-tokens", "3",
                    "--trace", str(path), "--no-prompts", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    trace = read_trace(path)
    assert trace.header.include_prompts is False
    (arrival,) = trace.of_type(Arrival)
    assert arrival.prompt is None and arrival.prompt_len == 3
    assert outputs_of(trace)[arrival.id] == out["token_ids"]


def test_reconfigure_mid_session_frees_blocks_and_is_recorded(model, tmp_path):
    path = tmp_path / "t.jsonl"
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64))
    start_trace(engine, path)
    rid = engine.add_request([5] * 10, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.reconfigure(block_size=8, num_kv_blocks=32)
    while engine.has_unfinished():
        engine.step()
    engine.stop_trace()
    trace = read_trace(path)
    (rc,) = trace.of_type(Reconfigure)
    assert rc.block_size == 8 and rc.num_kv_blocks == 32 and rc.config["block_size"] == 8
    held: list[int] = []
    for ev in trace.events:
        if isinstance(ev, Alloc):
            held += ev.blocks
        elif isinstance(ev, Free):
            assert ev.blocks == held[:len(ev.blocks)]
            held = held[len(ev.blocks):]
    assert held == [] and len(outputs_of(trace)[rid]) == 6


def test_blocks_freed_behind_a_sliding_window_are_recorded_as_partial_frees(tmp_path):
    """A model whose every layer is windowed frees blocks as the window moves on: the trace
    says which ones went back (never a -1 table entry), and allocs and frees still balance."""
    model = save_tiny_model(tmp_path / "mistral", "mistral", seed=0, sliding_window=8)
    path = tmp_path / "w.jsonl"
    record(model, path, num_kv_blocks=64)
    trace = read_trace(path)
    held: dict[str, list[int]] = {}
    partial = 0
    for ev in trace.events:
        if isinstance(ev, Alloc | Free):
            assert all(b >= 0 for b in ev.blocks), ev
        if isinstance(ev, Alloc):
            held.setdefault(ev.id, []).extend(ev.blocks)
        elif isinstance(ev, Free):
            mine = held[ev.id]
            assert set(ev.blocks) <= set(mine), (ev, mine)
            partial += len(ev.blocks) < len(mine)
            held[ev.id] = [b for b in mine if b not in ev.blocks]
            if not held[ev.id]:
                del held[ev.id]
    assert partial > 0  # the window freed blocks while requests ran
    assert held == {}
