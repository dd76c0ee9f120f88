"""Priorities in traces (issue 26): recorded with each arrival, honoured by replay, 0 for
traces from before them; preemptions carry the scheduler's reason when it gives one."""
from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest
import torch

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.traces.recorder import _block_lines, _Held, start_trace
from kvscope.engine.traces.replay import load_workload, replay
from kvscope.engine.traces.workload import read_mooncake
from kvscope.ipc.trace_format import Arrival, Preempt, parse_trace, read_trace
from kvscope.testing.tiny_models import save_tiny_model
from tests.traces import synthetic

CONFIG = {"block_size": 4, "num_kv_blocks": 32, "max_num_batched_tokens": 64}
PRIORITIES = {"low": 5, "high": -3, "plain": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


def engine_of(model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), **CONFIG))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "t.jsonl"
    engine = engine_of(model)
    start_trace(engine, path)
    for k, (rid, priority) in enumerate(PRIORITIES.items()):
        engine.add_request(prompt(9 + k, k),
                           SamplingParams(max_tokens=4, ignore_eos=True, priority=priority), rid)
    while engine.has_unfinished():
        engine.step()
    engine.stop_trace()
    return path


def test_each_arrival_records_its_priority(recorded):
    arrivals = read_trace(recorded).of_type(Arrival)
    assert {a.id: a.priority for a in arrivals} == PRIORITIES
    assert {a.id: a.sampling["priority"] for a in arrivals} == PRIORITIES
    items, _ = load_workload(recorded)
    assert {w.request_id: w.priority for w in items} == PRIORITIES


def test_replay_submits_at_the_recorded_priority(model, recorded, tmp_path, monkeypatch):
    items, _ = load_workload(recorded)
    engine = engine_of(model)
    submitted = {}
    add = engine.add_request

    def spy(prompt, params, request_id=None):
        submitted[request_id] = params.priority
        return add(prompt, params, request_id)

    monkeypatch.setattr(engine, "add_request", spy)
    out = tmp_path / "replay.jsonl"
    assert replay(items, engine, out, speed=None) == {}
    assert submitted == PRIORITIES
    assert {a.id: a.priority for a in read_trace(out).of_type(Arrival)} == PRIORITIES


def test_a_trace_from_before_priorities_replays_at_priority_0(model, tmp_path):
    old = synthetic.write(tmp_path / "old.jsonl")
    assert all("priority" not in a.sampling for a in read_trace(old).of_type(Arrival))
    items, _ = load_workload(old)
    assert [w.priority for w in items] == [0, 0]
    out = tmp_path / "replay.jsonl"
    assert replay(items, engine_of(model), out, speed=None, hash_block_size=4) == {}
    assert [a.sampling["priority"] for a in read_trace(out).of_type(Arrival)] == [0, 0]


def test_a_bad_recorded_priority_is_refused_by_name(model, tmp_path):
    items, _ = load_workload(synthetic.write(tmp_path / "t.jsonl"))
    items[0].priority = "urgent"
    items[1].priority = 2**31
    rejected = replay(items, engine_of(model), tmp_path / "r.jsonl", speed=None,
                      hash_block_size=4)
    assert set(rejected) == {"r0", "r1"}
    assert all("SamplingParams.priority" in why for why in rejected.values())


def test_mooncake_lines_may_carry_a_priority(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 2,
                                "priority": -1}) + "\n"
                    + json.dumps({"timestamp": 5, "input_length": 4, "output_length": 2}) + "\n")
    assert [w.priority for w in read_mooncake(path)] == [-1, 0]


def test_preempt_lines_carry_the_schedulers_reason():
    seq = SimpleNamespace(block_table=[], num_preemptions=1)
    other = SimpleNamespace(block_table=[], num_preemptions=2)
    before = {"a": _Held([3, 4], 0, seq), "b": _Held([5], 1, other)}
    lines = _block_lines(before, 1.0, {"a": "priority"})
    preempts = {e.id: e.reason for e in lines if isinstance(e, Preempt)}
    assert preempts == {"a": "priority", "b": ""}  # b: no reason given, none made up


def test_preempt_reason_round_trips_and_old_lines_read_without_one():
    header = msgspec.json.encode(synthetic.header()).decode()
    data = "\n".join([header, '{"ev":"preempt","t":1.0,"id":"a"}',
                      '{"ev":"preempt","t":2.0,"id":"b","reason":"memory"}']) + "\n"
    trace = parse_trace(data.encode())
    assert [(e.id, e.reason) for e in trace.of_type(Preempt)] == [("a", ""), ("b", "memory")]


def test_a_recorded_priority_preemption_says_so(model, tmp_path):
    path = tmp_path / "t.jsonl"
    engine = LLMEngine(EngineConfig(model=str(model), **CONFIG, max_num_seqs=1,
                                    scheduling_policy="priority"))
    start_trace(engine, path)
    engine.add_request(prompt(8, 1), SamplingParams(max_tokens=8, ignore_eos=True), "low")
    engine.step()
    engine.step()  # low is decoding
    engine.add_request(prompt(8, 2), SamplingParams(max_tokens=2, ignore_eos=True,
                                                    priority=-1), "high")
    while engine.has_unfinished():
        engine.step()
    engine.stop_trace()
    preempts = [(e.id, e.reason) for e in read_trace(path).of_type(Preempt)]
    assert preempts == [("low", "priority")]
