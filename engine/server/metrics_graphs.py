"""/metrics for the decode graphs (issue 54): on or off and why, capture time and memory,
and the steps run on each path (a graph bucket, or eager and why)."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvscope.ipc import messages as m


def graph_families(prefix: str, stats: m.EngineStats, labels: dict[str, str]
                   ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    names, values = list(labels), list(labels.values())
    on = GaugeMetricFamily(prefix + "cuda_graphs_enabled",
                           "1 when decode steps replay captured graphs; 0 and the reason "
                           "(enforce_eager, no CUDA, a failed capture or self-check) when not.",
                           labels=[*names, "status", "reason"])
    on.add_metric([*values, stats.cuda_graphs, stats.cuda_graphs_reason],
                  0 if stats.cuda_graphs == "off" else 1)
    yield on
    for key, doc, value in (
            ("cuda_graph_capture_seconds", "Time the decode graphs took to capture.",
             stats.cuda_graph_capture_s),
            ("cuda_graph_memory_bytes", "Device memory the decode graphs' pool holds.",
             stats.cuda_graph_bytes),
            ("cuda_graph_buckets", "Batch-size buckets captured.",
             len(stats.cuda_graph_sizes))):
        gauge = GaugeMetricFamily(prefix + key, doc, labels=names)
        gauge.add_metric(values, value)
        yield gauge
    steps = CounterMetricFamily(prefix + "steps_by_path",
                                "Engine steps by path: graph:<bucket>, or eager:<why>.",
                                labels=[*names, "path"])
    for path, count in sorted(stats.steps_by_path.items()):
        steps.add_metric([*values, path], count)
    yield steps
