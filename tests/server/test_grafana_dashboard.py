"""resources/grafana/kvscope.json only queries series that `kvscope serve --metrics-port`
exports: every metric name in every panel's PromQL is checked against an in-process
EngineMetrics scrape (no server), with a CUDA-like device sample so the NVML gauges exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.server.metrics import EngineMetrics, EngineState, FinishedRequest
from kvscope.ipc import messages as m
from kvscope.testing.frames import engine_stats

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "resources" / "grafana" / "kvscope.json"
PROMETHEUS_YML = ROOT / "resources" / "grafana" / "prometheus.yml"
DATASOURCE = "${DS_PROMETHEUS}"
MODEL_FILTER = 'model_name="$model_name"'
GiB = 1 << 30

# A metric name and, if there is one, the label selector right after it. Digits count
# (`e2e_request_latency_seconds`); `process_*` only where it is not the tail of a
# `kvscope:process_*` name.
METRIC = re.compile(r"(kvscope:[a-zA-Z0-9_:]+|(?<![\w:])process_[a-z0-9_]+)(\{[^}]*\})?")

# LLMEngine.stats() mid-run: 512 blocks of 16 tokens, 300 used, 40 prefix-cached.
STATS = engine_stats(
    num_kv_blocks=512, block_size=16, kv_dtype="bfloat16",
    kv_bytes_per_token=18432, kv_cache_bytes=512 * 16 * 18432,
    num_free_blocks=212, num_cached_blocks=40, num_used_blocks=300,
    num_preemptions=3, num_steps=1234, num_running=7, num_waiting=2,
    num_prompt_tokens=4100, num_generated_tokens=9000,
    prefix_cache_queries=4100, prefix_cache_hits=1600, max_model_len=4096,
    device="cuda:0", dtype="bfloat16",
)
# snapshots.block_totals() for the same state.
KV_TOTALS = {
    "used": 300, "free": 172, "cached": 40, "tokens_stored": 4700,
    "internal_waste_slots": 300 * 16 - 4700, "reserved_max_len_blocks": 7 * 256,
    "reserved_request_blocks": 7 * 80,
}


def cuda_frame() -> m.DeviceFrame:
    """A CUDA device sample with every optional (NVML, allocator) field set."""
    return m.DeviceFrame(
        seq=5, time=1000.0, pid=4242, device="cuda:0", name="NVIDIA H200",
        memory_total=141 * GiB, memory_used=30 * GiB, memory_free=111 * GiB,
        process_bytes=29 * GiB, process_source="nvml",
        weights_bytes=15 * GiB, kv_pool_bytes=10 * GiB, kv_used_bytes=6 * GiB,
        kv_cached_bytes=1 * GiB, activations_bytes=2 * GiB, allocator_free_bytes=1 * GiB,
        other_bytes=1 * GiB, gpu_utilization=87.0, memory_utilization=54.0,
        memory_clock_mhz=2619.0, memory_clock_max_mhz=3201.0, temperature_c=61.0,
        power_w=412.5, power_limit_w=700.0, cpu_percent=103.0, num_cpus=16,
        system_cpu_percent=9.5)


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every exported sample name -> the label names it carries."""
    frame = cuda_frame()
    unset = [f.name for f in msgspec.structs.fields(frame) if getattr(frame, f.name) is None]
    assert not unset, f"set these DeviceFrame fields in cuda_frame(): {unset}"
    metrics = EngineMetrics("default", 4096, 512)
    metrics.publish(EngineState(STATS, dict(KV_TOTALS), frame))
    for seconds in (0.05, 0.12, 0.3):
        metrics.on_latency("ttft", seconds)
    for seconds in (0.011, 0.013, 0.02, 0.015):
        metrics.on_latency("itl", seconds)
    for tokens in (512, 7, 7, 300):
        metrics.on_step(tokens)
    metrics.on_finished("stop", FinishedRequest(10.0, 10.2, 10.4, 12.0, 600, 120, 256))
    metrics.on_finished("length", FinishedRequest(11.0, 11.1, 11.3, 15.0, 40, 256, 256))
    metrics.on_finished("abort", FinishedRequest(12.0, None, None, 12.5, 90, 0, 128))
    text = generate_latest(metrics.registry).decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(node: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in node.get("panels", []):
        out.append(panel)
        out.extend(all_panels(panel))
    return out


def exprs(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [(p.get("title", "?"), t["expr"]) for p in all_panels(board)
            for t in p.get("targets", []) if "expr" in t]


def test_dashboard_parses_and_panels_are_well_formed():
    board = dashboard()
    assert 35 <= board["schemaVersion"] <= 45
    panels = all_panels(board)
    assert len(panels) > 20
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p.get("title"), f"panel {p['id']} has no title"
        assert p.get("datasource", {}).get("uid") == DATASOURCE, p["title"]
        for t in p.get("targets", []):
            assert t.get("datasource", {}).get("uid") == DATASOURCE, p["title"]
    assert all(p.get("description") for p in panels if p["type"] != "row")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query"
    assert model["query"]["query"] == 'label_values({__name__=~"kvscope:.*"}, model_name)'
    assert model["datasource"]["uid"] == DATASOURCE


def test_dashboard_covers_each_section():
    board = dashboard()
    rows = [p["title"] for p in all_panels(board) if p["type"] == "row"]
    assert rows == ["Requests", "Latency", "Throughput", "KV cache", "Device"]
    units = {p["title"]: p["fieldConfig"]["defaults"].get("unit")
             for p in all_panels(board) if p["type"] != "row"}
    assert units["KV cache usage"] == "percentunit"
    assert units["Engine memory breakdown"] == "bytes"
    assert units["GPU memory clock"] == "hertz"
    assert units["GPU power"] == "watt"
    assert units["GPU temperature"] == "celsius"
    assert units["Time to first token"] == "s"
    text = "\n".join(e for _, e in exprs(board))
    # kv_pool overlaps kv_used + kv_cached: it is only shown as the difference.
    breakdown = [e for e in text.split("\n") if "process_memory_breakdown_bytes" in e]
    assert all("kv_pool" not in e or 'part="kv_pool"' in e for e in breakdown)
    assert 'part=~"weights|kv_used|kv_cached|activations|allocator_free|other"' in text


def test_every_queried_metric_is_exported(exported):
    missing = sorted({(title, name) for title, expr in exprs(dashboard())
                      for name, _ in METRIC.findall(expr) if name not in exported})
    assert not missing, f"the dashboard queries series kvscope does not export: {missing}"


def test_every_query_filters_on_the_model(exported):
    for title, expr in exprs(dashboard()):
        for open_, close in ("()", "[]", "{}"):
            assert expr.count(open_) == expr.count(close), (title, expr)
        assert MODEL_FILTER in expr, (title, expr)
        found = METRIC.findall(expr)
        assert found, (title, expr)
        for name, selector in found:
            if "model_name" in exported.get(name, ()):
                assert MODEL_FILTER in selector, (title, name, expr)


def test_the_test_catches_a_misspelled_metric(exported):
    """A query on a name kvscope does not export is reported."""
    assert "process_resident_memory_bytes" in exported  # ProcessCollector, no model
    wrong = 'rate(kvscope:kv_cache_usage_percent{model_name="$model_name"}[5m])'
    assert [n for n, _ in METRIC.findall(wrong) if n not in exported] == \
        ["kvscope:kv_cache_usage_percent"]
    assert METRIC.findall("rate(kvscope:e2e_request_latency_seconds_sum{x=\"y\"}[1m])") == \
        [("kvscope:e2e_request_latency_seconds_sum", '{x="y"}')]
    # kvscope:process_* names are matched whole, not as a bare process_* name.
    assert [n for n, _ in METRIC.findall("kvscope:process_device_memory_bytes{a=\"b\"}")] == \
        ["kvscope:process_device_memory_bytes"]


def test_prometheus_config_scrapes_the_metrics_port():
    text = PROMETHEUS_YML.read_text()
    assert "kvscope serve --metrics-port 9100" in text
    assert "job_name: kvscope" in text
    assert '"127.0.0.1:9100"' in text
    assert "scrape_interval: 5s" in text
