"""Traces record the K/V rotation, and a replay can switch it (A/B against the old behaviour)."""
from __future__ import annotations

import pytest

from kvscope.ipc.trace_format import Reconfigure, read_trace
from kvscope.testing.tiny_models import save_tiny_model
from tests.cli.test_trace import run_json
from tests.traces.test_record import record


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "t.jsonl"
    record(model, path)
    return path


def replay(capsys, model, recorded, out, *options):
    return run_json(capsys, ["replay", str(recorded), "--model", str(model), *options,
                             "--num-kv-blocks", "64", "--block-size", "8", "--speed", "max",
                             "--json", "-o", str(out)])


@pytest.mark.parametrize("options,rotation", [([], "calibrated"),
                                              (["--kv-rotation", "hadamard"], "hadamard"),
                                              (["--kv-rotation", "none"], "none")])
def test_int8_replay_records_the_rotation(model, recorded, tmp_path, capsys, options, rotation):
    out = tmp_path / "r.jsonl"
    s = replay(capsys, model, recorded, out, "--kv-dtype", "int8", *options)
    assert s["kv_rotation"] == rotation and s["finished"] == 4
    header = read_trace(out).header
    assert (header.kv_dtype, header.kv_rotation) == ("int8", rotation)


@pytest.mark.parametrize("rotation", ["hadamard", "calibrated"])
def test_float32_replay_with_rotation_reproduces_the_outputs(model, recorded, tmp_path, capsys,
                                                             rotation):
    """Rotation and K balance are exact in float32: greedy outputs equal the recording's."""
    assert read_trace(recorded).header.kv_rotation == "none"
    s = replay(capsys, model, recorded, tmp_path / "r.jsonl", "--kv-dtype", "float32",
               "--kv-rotation", rotation)
    assert s["kv_rotation"] == rotation
    assert s["outputs_identical"] is True and s["outputs_compared"] == 4


def test_a_live_rotation_change_is_in_the_trace(model, tmp_path):
    from kvscope.engine import LLM, EngineConfig
    from kvscope.engine.traces.recorder import start_trace

    llm = LLM(EngineConfig(model=str(model), kv_dtype="int8", num_kv_blocks=32))
    path = tmp_path / "t.jsonl"
    start_trace(llm.engine, str(path))
    llm.engine.reconfigure(kv_rotation="none")
    llm.engine.stop_trace()
    trace = read_trace(path)
    assert trace.header.kv_rotation == "calibrated"
    assert [e.kv_rotation for e in trace.of_type(Reconfigure)] == ["none"]


@pytest.mark.parametrize("options,anchors", [([], 4), (["--kv-anchor-tokens", "0"], 0)])
def test_int8_replay_records_the_anchor_tokens(model, recorded, tmp_path, capsys, options,
                                               anchors):
    """The header's config carries the anchor count; `--kv-anchor-tokens 0` is the A/B."""
    out = tmp_path / "r.jsonl"
    s = replay(capsys, model, recorded, out, "--kv-dtype", "int8", *options)
    assert s["finished"] == 4
    assert read_trace(out).header.config["kv_anchor_tokens"] == anchors
