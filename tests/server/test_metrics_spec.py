"""/metrics for speculative decoding under vLLM's names, on both prefixes, from a real
engine's counters."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.server.metrics import EngineMetrics, EngineState
from kvscope.engine.server.metrics_prefix import prefixed
from kvscope.testing.frames import engine_stats

STATS = engine_stats(num_kv_blocks=64, block_size=16, spec_method="ngram", spec_num_drafts=10,
                     spec_num_draft_tokens=40, spec_num_accepted_tokens=17,
                     spec_accepted_per_pos=[8, 5, 3, 1])


def samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("position")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_spec_decode_counters_on_both_prefixes():
    metrics = EngineMetrics("default", 256, 64)
    metrics.publish(EngineState(STATS, None, None))
    for prefix, registry in (("kvscope", metrics.registry),
                             ("vllm", prefixed(metrics.registry, "kvscope:", "vllm"))):
        got = samples(registry)
        assert got[(f"{prefix}:spec_decode_num_drafts_total", None)] == 10
        assert got[(f"{prefix}:spec_decode_num_draft_tokens_total", None)] == 40
        assert got[(f"{prefix}:spec_decode_num_accepted_tokens_total", None)] == 17
        per_pos = [got[(f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
                   for i in range(4)]
        assert per_pos == [8, 5, 3, 1]
    assert STATS.spec_mean_acceptance_length == 2.7  # 1 + 17 / 10
