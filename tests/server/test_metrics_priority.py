"""/metrics by priority (issue 26), in process: the latency histograms' `priority` label and
its bound, preemptions by reason, waiting requests per priority, and a dashboard that still
reads one series where it read one before."""
from __future__ import annotations

import json
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.server.metrics import EngineMetrics, EngineState, FinishedRequest
from kvscope.engine.server.metrics_priority import (
    MAX_PRIORITY_LABELS,
    OTHER,
    SchedulerCounts,
    scheduler_counts,
)
from kvscope.testing.frames import engine_stats
from tests.server.test_grafana_dashboard import DASHBOARD, exprs

STATS = engine_stats(num_kv_blocks=64, block_size=16, num_used_blocks=10, num_preemptions=5,
                     num_waiting=3)


def samples(metrics: EngineMetrics) -> list:
    text = generate_latest(metrics.registry).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def value(metrics: EngineMetrics, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples(metrics)
               if s.name == name and labels.items() <= s.labels.items())


def test_latency_histograms_carry_the_priority():
    metrics = EngineMetrics("default", 256, 64)
    metrics.on_latency("ttft", 0.05, -1)
    metrics.on_latency("ttft", 0.5)
    metrics.on_latency("ttft", 0.7, 0)
    for gap in (0.01, 0.02):
        metrics.on_latency("itl", gap, -1)
    metrics.on_finished("stop", FinishedRequest(1.0, 1.25, 1.3, 2.0, 10, 5, 5, priority=-1))
    metrics.on_finished("stop", FinishedRequest(1.0, 3.0, 3.1, 4.0, 10, 5, 5))
    ttft = "kvscope:time_to_first_token_seconds_count"
    assert value(metrics, ttft, priority="-1") == 1
    assert value(metrics, ttft, priority="0") == 2
    assert value(metrics, "kvscope:time_to_first_token_seconds_sum", priority="-1") == 0.05
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert value(metrics, f"kvscope:{name}_count", priority="-1") == 2
        assert value(metrics, f"kvscope:{name}_count", priority="0") == 0  # made up front
    assert value(metrics, "kvscope:request_queue_time_seconds_sum", priority="-1") == 0.25
    assert value(metrics, "kvscope:request_queue_time_seconds_sum", priority="0") == 2.0
    assert value(metrics, "kvscope:e2e_request_latency_seconds_sum", priority="-1") == 1.0
    # Per-step and size histograms have no priority: it would say nothing there.
    assert all("priority" not in s.labels for s in samples(metrics)
               if s.name.startswith(("kvscope:request_prefill", "kvscope:iteration_tokens")))


def test_the_priority_label_set_is_bounded():
    metrics = EngineMetrics("default", 256, 64)
    priorities = range(-40, 0)
    for p in priorities:
        metrics.on_latency("ttft", 0.1, p)
    got = {s.labels["priority"]: s.value for s in samples(metrics)
           if s.name == "kvscope:time_to_first_token_seconds_count"}
    assert len(got) == MAX_PRIORITY_LABELS + 1  # "0", 15 others, and "other"
    assert got[OTHER] == len(priorities) - (MAX_PRIORITY_LABELS - 1)
    assert sum(got.values()) == len(priorities)  # nothing is lost, only pooled
    assert got["-40"] == 1 and "-1" not in got  # first come, first labelled


def test_preemptions_by_reason_and_waiting_by_priority():
    metrics = EngineMetrics("default", 256, 64)
    counts = SchedulerCounts({"memory": 2, "priority": 3}, recomputed_tokens=40,
                             waiting_by_priority={-1: 1, 0: 2}, interrupted_steps=7)
    metrics.publish(EngineState(STATS, None, None, counts))
    name = "kvscope:num_preemptions_total"
    assert value(metrics, name, reason="memory") == 2
    assert value(metrics, name, reason="priority") == 3
    assert value(metrics, name) == 5 == STATS.num_preemptions  # the reasons add up
    assert value(metrics, "kvscope:recomputed_tokens_total") == 40
    assert value(metrics, "kvscope:interrupted_steps_total") == 7
    waiting = {s.labels["priority"]: s.value for s in samples(metrics)
               if s.name == "kvscope:num_requests_waiting_by_priority"}
    assert waiting == {"-1": 1, "0": 2}
    assert sum(waiting.values()) == value(metrics, "kvscope:num_requests_waiting")


def test_without_the_schedulers_counts_every_preemption_is_a_memory_one():
    metrics = EngineMetrics("default", 256, 64)
    metrics.publish(EngineState(STATS, None, None))
    name = "kvscope:num_preemptions_total"
    assert value(metrics, name, reason="memory") == 5
    assert value(metrics, name, reason="priority") == 0  # the series exists from the start


def test_scheduler_counts_copies_the_schedulers_counters(tmp_path):
    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.testing.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "llama", seed=0)
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=32,
                                    max_num_seqs=1))
    for k, priority in enumerate((3, -2, 3, 0)):
        engine.add_request([5 + k] * 6, SamplingParams(max_tokens=2, priority=priority))
    engine.step()  # one runs, the other three wait
    sched = engine.scheduler
    got = scheduler_counts(sched)
    assert sum(got.waiting_by_priority.values()) == len(sched.waiting) == 3
    assert got.waiting_by_priority == sched.waiting_by_priority()
    assert got.preemptions_by_reason == sched.preemptions_by_reason
    assert got.preemptions_by_reason is not sched.preemptions_by_reason  # a copy
    assert got.recomputed_tokens == sched.recomputed_tokens


LABELLED = ("time_to_first_token_seconds", "inter_token_latency_seconds",
            "e2e_request_latency_seconds", "request_queue_time_seconds", "num_preemptions")


def test_the_dashboard_sums_over_the_new_labels():
    """A panel that read one series per model still does: every query of a metric that got
    a priority or reason label aggregates it away (`sum by (le)` or `sum(...)`)."""
    board = json.loads(DASHBOARD.read_text())
    checked = 0
    for title, expr in exprs(board):
        for name in LABELLED:
            for hit in re.finditer(rf"rate\(kvscope:{name}\w*\{{", expr):
                before = expr[:hit.start()].rstrip()
                assert before.endswith(("sum(", "sum by (le) (")), (title, expr)
                checked += 1
    assert checked >= 10
