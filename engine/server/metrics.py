"""Prometheus metrics for `kvscope serve --metrics-port`, with vLLM's names (prefix `kvscope:`
instead of `vllm:`) where the meaning matches, so a vLLM Grafana dashboard works after a
search-and-replace of the prefix.

The engine thread is the only writer: it observes latency histograms as tokens are routed and
hands over an `EngineState` (stats dict, KV waste, device sample) by swapping one reference.
The HTTP thread only reads that reference at scrape time, so counters and gauges come from the
very numbers the state stream publishes and a scrape never touches the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvscope.engine.server.metrics_graphs import graph_families
from kvscope.engine.server.metrics_moe import ExpertLoad, moe_families
from kvscope.engine.server.metrics_prefix import prefixed
from kvscope.engine.server.metrics_priority import (
    PriorityLabels,
    SchedulerCounts,
    labelled_waiting,
    priority_families,
)
from kvscope.engine.server.metrics_spec import spec_families
from kvscope.engine.server.metrics_tiers import tier_families
from kvscope.ipc import messages as m

PREFIX = "kvscope:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' heatmaps line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM buckets token counts."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


def model_label(model: str) -> str:
    """The name dashboards filter on: the embedded model's name for "default"."""
    if model == "default":
        return "SmolLM2-135M-Instruct"
    return Path(model).name or model


@dataclass(frozen=True)
class FinishedRequest:
    """One request's life in monotonic seconds; None for a phase it never reached."""
    arrived: float
    scheduled: float | None  # first scheduled (end of queueing)
    first_token: float | None
    finished: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    priority: int = 0


@dataclass(frozen=True)
class EngineState:
    stats: m.EngineStats  # LLMEngine.stats()
    kv_totals: dict | None  # snapshots.block_totals(): used, cached, internal waste, ...
    device: m.DeviceFrame | None
    scheduler: SchedulerCounts | None = None  # metrics_priority.scheduler_counts()
    # scheduler.waiting_by_priority under its label values (EngineMetrics.publish fills it).
    waiting_by_priority: dict[str, int] = dataclasses.field(default_factory=dict)
    experts: ExpertLoad | None = None  # a mixture of experts' load (metrics_moe.expert_load)


# Histograms with a `priority` label (a request's own latencies); the others are per step
# or per request size, where the priority says nothing new.
BY_PRIORITY = ("time_to_first_token_seconds", "inter_token_latency_seconds",
               "time_per_output_token_seconds", "e2e_request_latency_seconds",
               "request_queue_time_seconds")


class EngineMetrics:
    def __init__(self, model: str, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.model_name = model_label(model)
        self.registry = CollectorRegistry()
        self.state: EngineState | None = None
        self.server = None
        name = [self.model_name]
        self.priority_label = PriorityLabels()

        def histogram(key: str, doc: str, buckets):
            if key in BY_PRIORITY:
                return _ByPriority(Histogram(PREFIX + key, doc, ["model_name", "priority"],
                                             registry=self.registry, buckets=buckets),
                                   self.model_name, self.priority_label)
            return Histogram(PREFIX + key, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(*name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        # vLLM's older name for the same samples; its example Grafana dashboard reads it.
        self.tpot = histogram("time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the same "
                              "samples as inter_token_latency_seconds).", ITL_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens",
                                    "Number of prefill tokens processed.",
                                    token_buckets(max_model_len))
        self.output_len = histogram("request_generation_tokens",
                                    "Number of generation tokens processed.",
                                    token_buckets(max_model_len))
        self.max_tokens = histogram("request_max_num_generation_tokens",
                                    "Histogram of maximum number of requested generation "
                                    "tokens.", token_buckets(max_model_len))
        self.iteration = histogram("iteration_tokens_total",
                                   "Histogram of number of tokens per engine_step.",
                                   token_buckets(max_num_batched_tokens))
        self.success = Counter(PREFIX + "request_success", "Count of successfully processed "
                               "requests.", ["model_name", "finished_reason"],
                               registry=self.registry)
        self.registry.register(_StateCollector(self))
        # process_resident_memory_bytes, process_cpu_seconds_total, ...: what ps would say.
        self.registry.register(ProcessCollector(registry=None))

    # -- engine thread -----------------------------------------------------------------------
    def publish(self, state: EngineState) -> None:
        if state.scheduler is not None:  # labels are handed out on this thread only
            state = replace(state, waiting_by_priority=labelled_waiting(
                state.scheduler.waiting_by_priority, self.priority_label))
        self.state = state  # one reference swap: a scrape sees the old state or the new one

    def on_latency(self, kind: str, seconds: float, priority: int = 0) -> None:
        if kind == "ttft":
            self.ttft.observe(seconds, priority)
        else:
            self.itl.observe(seconds, priority)
            self.tpot.observe(seconds, priority)

    def on_step(self, num_tokens: int) -> None:
        self.iteration.observe(num_tokens)

    def on_finished(self, reason: str, r: FinishedRequest) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(r.finished - r.arrived, r.priority)
        if r.scheduled is not None:
            self.queue.observe(r.scheduled - r.arrived, r.priority)
        for histogram, start, end in ((self.prefill, r.scheduled, r.first_token),
                                      (self.decode, r.first_token, r.finished)):
            if start is not None and end is not None:
                histogram.observe(end - start)
        self.prompt_len.observe(r.prompt_tokens)
        self.output_len.observe(r.output_tokens)
        self.max_tokens.observe(r.max_tokens)

    # -- HTTP --------------------------------------------------------------------------------
    def serve(self, host: str, port: int, prefix: str = "kvscope") -> str:
        """Serve /metrics on host:port (0 picks a free port), names under `prefix:`; returns
        its URL."""
        self.server, _ = start_http_server(port, addr=host,
                                           registry=prefixed(self.registry, PREFIX, prefix))
        bound = self.server.server_port
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}/metrics"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _ByPriority:
    """A histogram's children by priority, for this model (the default one made up front,
    so the series exist before the first request)."""

    def __init__(self, histogram: Histogram, model: str, label: PriorityLabels) -> None:
        self.histogram, self.model, self.label = histogram, model, label
        self.children = {"0": histogram.labels(model, "0")}

    def observe(self, seconds: float, priority: int = 0) -> None:
        key = self.label(priority)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.histogram.labels(self.model, key)
        child.observe(seconds)


class _StateCollector(Collector):
    """Counters and gauges read from the engine's last published state at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        state = self.metrics.state
        if state is None:
            return []
        labels = {"model_name": self.metrics.model_name}
        out = list(engine_families(state.stats, labels))
        counts = state.scheduler or SchedulerCounts({"memory": state.stats.num_preemptions})
        out.extend(priority_families(PREFIX, counts, state.waiting_by_priority, labels))
        out.extend(spec_families(PREFIX, state.stats, labels))
        if state.experts is not None:
            out.extend(moe_families(PREFIX, state.experts, labels))
        out.extend(tier_families(PREFIX, state.stats, labels))
        out.extend(graph_families(PREFIX, state.stats, labels))
        if state.kv_totals is not None:
            out.extend(kv_families(state.kv_totals, state.stats, labels))
        if state.device is not None:
            out.extend(device_families(state.device, labels))
        return out


def _family(kind, key: str, doc: str, value, labels: dict, unit: str = ""):
    family = kind(PREFIX + key, doc, labels=list(labels), unit=unit)
    family.add_metric(list(labels.values()), value)
    return family


def engine_families(stats: m.EngineStats, labels: dict):
    g, c = GaugeMetricFamily, CounterMetricFamily
    blocks = max(1, stats.num_kv_blocks)
    yield _family(g, "num_requests_running",
                  "Number of requests in model execution batches.", stats.num_running, labels)
    yield _family(g, "num_requests_waiting", "Number of requests waiting to be processed.",
                  stats.num_waiting, labels)
    yield _family(g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  stats.num_used_blocks / blocks, labels)
    yield _family(g, "gpu_cache_usage_perc", "KV-cache usage (vLLM's older name, which its "
                  "example dashboard reads). 1 means 100 percent usage.",
                  stats.num_used_blocks / blocks, labels)
    yield _family(c, "prompt_tokens", "Number of prefill tokens processed.",
                  stats.num_prompt_tokens, labels)
    yield _family(c, "generation_tokens", "Number of generation tokens processed.",
                  stats.num_generated_tokens, labels)
    yield _family(c, "prefix_cache_queries",
                  "Prefix cache queries, in terms of number of queried tokens.",
                  stats.prefix_cache_queries, labels)
    yield _family(c, "prefix_cache_hits",
                  "Prefix cache hits, in terms of number of cached tokens.",
                  stats.prefix_cache_hits, labels)
    yield _family(c, "engine_steps", "Engine steps run.", stats.num_steps, labels)
    yield _family(g, "kv_cache_cached_blocks", "Free KV blocks still holding a prefix-cache "
                  "entry (reusable until evicted).", stats.num_cached_blocks, labels)
    yield _family(g, "kv_cache_free_blocks", "KV blocks holding nothing (cached ones not "
                  "counted).", stats.num_kv_blocks - stats.num_used_blocks
                  - stats.num_cached_blocks, labels)
    yield _family(g, "kv_cache_total_blocks", "KV blocks in the pool.", stats.num_kv_blocks,
                  labels)
    yield _family(g, "kv_block_size", "Tokens per KV block.", stats.block_size, labels)
    yield _family(g, "kv_cache_pool_bytes", "Bytes of the KV pool, scale caches included.",
                  stats.kv_cache_bytes, labels)
    info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache "
                             "configuration.", labels=[*labels, "block_size", "cache_dtype",
                                                       "num_gpu_blocks"])
    info.add_metric([*labels.values(), str(stats.block_size), str(stats.kv_dtype),
                     str(stats.num_kv_blocks)], 1)
    yield info


def kv_families(totals: dict, stats: m.EngineStats, labels: dict):
    allocated = totals["used"] * stats.block_size
    yield _family(GaugeMetricFamily, "kv_internal_waste_ratio",
                  "Allocated KV slots not holding a token (the tails of last blocks), over "
                  "all allocated slots.", totals["internal_waste_slots"] / max(1, allocated),
                  labels)
    yield _family(GaugeMetricFamily, "kv_cache_tokens", "Tokens stored in the KV pool.",
                  totals["tokens_stored"], labels)


_DEVICE_GAUGES = (  # (DeviceFrame field, metric, help, scale)
    ("memory_total", "device_memory_total_bytes",
     "Memory of the engine's device (system RAM on CPU).", 1),
    ("memory_used", "device_memory_used_bytes", "Device memory in use by every process.", 1),
    ("memory_free", "device_memory_free_bytes", "Device memory free to allocate.", 1),
    ("process_bytes", "process_device_memory_bytes",
     "Device memory the engine process holds (NVML or allocator on CUDA, RSS on CPU).", 1),
    ("gpu_utilization", "gpu_utilization_ratio",
     "Share of time a kernel ran on the GPU (NVML).", 0.01),
    ("memory_utilization", "gpu_memory_bandwidth_utilization_ratio",
     "Share of time device memory was read or written (NVML).", 0.01),
    ("memory_clock_mhz", "gpu_memory_clock_hertz", "Memory clock (NVML).", 1e6),
    ("memory_clock_max_mhz", "gpu_memory_clock_max_hertz", "Highest memory clock (NVML).", 1e6),
    ("temperature_c", "gpu_temperature_celsius", "GPU temperature (NVML).", 1),
    ("power_w", "gpu_power_watts", "GPU power draw (NVML).", 1),
    ("power_limit_w", "gpu_power_limit_watts", "Enforced GPU power limit (NVML).", 1),
    ("cpu_percent", "engine_cpu_utilization_ratio",
     "CPU time the engine process used, per second (1 = one core busy).", 0.01),
)
_PARTS = ("weights", "kv_pool", "kv_used", "kv_cached", "activations", "allocator_free", "other")


def device_families(frame: m.DeviceFrame, labels: dict):
    with_device = {**labels, "device": frame.device}
    for field, key, doc, scale in _DEVICE_GAUGES:
        value = getattr(frame, field)
        if value is not None:  # NVML absent: the series is missing, not zero
            yield _family(GaugeMetricFamily, key, doc, value * scale, with_device)
    parts = GaugeMetricFamily(PREFIX + "process_memory_breakdown_bytes",
                              "What the engine holds on its device, by part (kv_used and "
                              "kv_cached are parts of kv_pool).",
                              labels=[*with_device, "part"])
    for part in _PARTS:
        value = getattr(frame, part + "_bytes")
        if value is not None:
            parts.add_metric([*with_device.values(), part], value)
    yield parts
