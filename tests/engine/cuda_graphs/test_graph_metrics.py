"""The decode graphs' /metrics families and the step frame's path, from an engine's stats."""
from __future__ import annotations

import msgspec

from kvscope.engine.server.metrics_graphs import graph_families
from kvscope.ipc import messages as m


def stats(**kw) -> m.EngineStats:
    base = dict(num_kv_blocks=8, block_size=4, kv_dtype="float32", kv_rotation="none",
                kv_rotation_matrix=None, kv_bytes_per_token=8, kv_anchor_tokens=0,
                kv_anchor_bytes=0, kv_cache_bytes=256, num_free_blocks=8, num_cached_blocks=0,
                num_used_blocks=0, num_running=0, num_waiting=0, num_preemptions=0,
                num_steps=3, num_prompt_tokens=0, num_generated_tokens=0,
                prefix_cache_queries=0, prefix_cache_hits=0, max_model_len=64, device="cuda",
                dtype="bfloat16", weights="dense")
    return m.EngineStats(**base, **kw)


def samples(s: m.EngineStats) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in graph_families("kvscope:", s, {"model_name": "x"}):
        out.setdefault(family.name, []).extend(family.samples)
    return out


def test_graphs_on_report_capture_memory_and_paths():
    got = samples(stats(cuda_graphs="on (cuda)", cuda_graph_sizes=[1, 2, 4],
                        cuda_graph_capture_s=1.5, cuda_graph_bytes=3 << 20,
                        steps_by_path={"graph:4": 7, "eager:prefill": 2}))
    assert got["kvscope:cuda_graphs_enabled"][0].value == 1
    assert got["kvscope:cuda_graph_capture_seconds"][0].value == 1.5
    assert got["kvscope:cuda_graph_memory_bytes"][0].value == 3 << 20
    assert got["kvscope:cuda_graph_buckets"][0].value == 3
    paths = {s.labels["path"]: s.value for s in got["kvscope:steps_by_path"]
             if s.name.endswith("_total")}
    assert paths == {"graph:4": 7, "eager:prefill": 2}


def test_graphs_off_say_why():
    got = samples(stats(cuda_graphs="off", cuda_graphs_reason="self-check failed: x"))
    sample = got["kvscope:cuda_graphs_enabled"][0]
    assert sample.value == 0 and sample.labels["reason"] == "self-check failed: x"


def test_an_older_peer_without_the_fields_decodes():
    old = msgspec.msgpack.encode({"seq": 1, "time": 0.0, "step": 1, "duration_s": 0.1,
                                  "scheduled": [], "batch_size": 0, "num_prefill_tokens": 0,
                                  "num_decode_tokens": 0, "num_scheduled_tokens": 0,
                                  "token_budget": 8, "num_running": 0, "num_waiting": 0,
                                  "num_preempted": 0, "preemptions_total": 0,
                                  "prompt_tokens_total": 0, "generated_tokens_total": 0,
                                  "history": [], "history_dropped_total": 0})
    assert msgspec.msgpack.decode(old, type=m.StepFrame).step_path == ""
