"""Expert load of a mixture of experts (issue 55): the step frame's expert_load and /metrics'
per-expert series, from a real engine running a tiny Mixtral; a dense model sends neither."""
from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server import snapshots
from kvscope.engine.server.metrics import EngineMetrics, EngineState
from kvscope.engine.server.metrics_moe import ExpertLoad, expert_load
from kvscope.engine.server.metrics_prefix import prefixed
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.testing.frames import engine_stats
from kvscope.testing.tiny_models import save_tiny_model


def engine_of(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                  weights="dense", kv_dtype="float32", block_size=4,
                                  num_kv_blocks=64, max_model_len=128))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral", seed=3)


def samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("expert")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_step_frames_carry_each_steps_tokens_per_expert(mixtral):
    engine = engine_of(mixtral)
    model = engine.model
    per_token = model.moe.top_k * sum(model.moe.sparse_layers)  # routings per token
    log = snapshots.StepLog()
    for i, n in enumerate((7, 12, 3)):
        engine.add_request(list(range(10 + i, 10 + i + n)),
                           SamplingParams(max_tokens=4, ignore_eos=True), f"r{i}")
    seen = 0
    while engine.has_unfinished():
        result = engine.step()
        if not result.ran:
            continue
        log.record(engine, result.scheduled, {}, 0.01)
        frame = msgspec.msgpack.decode(codec.encode(log.frame(engine, 1)), type=m.StepFrame)
        assert frame.expert_load is not None
        assert len(frame.expert_load) == model.moe.num_experts
        assert sum(frame.expert_load) == frame.num_scheduled_tokens * per_token
        seen += frame.num_scheduled_tokens
    assert sum(expert_load(engine).total) == seen * per_token


def test_a_dense_model_sends_no_expert_load(tmp_path):
    engine = engine_of(save_tiny_model(tmp_path / "llama", "llama"))
    log = snapshots.StepLog()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), "a")
    result = engine.step()
    log.record(engine, result.scheduled, {}, 0.01)
    assert log.frame(engine, 1).expert_load is None
    assert expert_load(engine) is None


def test_metrics_export_tokens_per_expert_on_both_prefixes():
    metrics = EngineMetrics("default", 256, 64)
    metrics.publish(EngineState(engine_stats(), None, None,
                                experts=ExpertLoad(last_step=[3, 0, 1], total=[10, 4, 2])))
    for prefix, registry in (("kvscope", metrics.registry),
                             ("vllm", prefixed(metrics.registry, "kvscope:", "vllm"))):
        got = samples(registry)
        assert [got[(f"{prefix}:moe_expert_tokens_total", str(e))] for e in range(3)] == \
            [10, 4, 2]
        assert [got[(f"{prefix}:moe_expert_tokens_last_step", str(e))] for e in range(3)] == \
            [3, 0, 1]


def test_a_dense_models_metrics_have_no_expert_series():
    metrics = EngineMetrics("default", 256, 64)
    metrics.publish(EngineState(engine_stats(), None, None))
    assert not any("moe_expert" in name for name, _ in samples(metrics.registry))
