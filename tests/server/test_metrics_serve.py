"""`kvscope serve --metrics-port`: /metrics scraped from a real server while requests run,
against the state stream's totals, and the `device` topic against ps (psutil) and /proc."""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_harness import Server, save_chat_model

# A small pool (prefix caching is on by default), so the run preempts and hits the cache.
ARGS = ["--block-size", "4", "--num-kv-blocks", "40", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--metrics-port", "0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_chat_model(tmp_path_factory.mktemp("chat"), seed=2)
    server = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    yield server
    server.stop()


def scrape(url: str) -> dict[str, float]:
    """Every sample as {name{label=value,...}: value}; the text must parse. Series that
    differ only by priority or preemption reason are summed (as dashboards do)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "device", "priority", "reason"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_metrics_url_is_loopback_and_announced(client, server):
    hello = client.hello()
    assert hello.metrics_url.startswith("http://127.0.0.1:")
    assert hello.metrics_url.endswith("/metrics")
    assert f"Prometheus metrics at {hello.metrics_url}" in server.log_text()
    names = scrape(hello.metrics_url)
    assert names["kvscope:kv_block_size"] == 4
    assert names["kvscope:kv_cache_total_blocks"] == 40
    assert names["kvscope:cache_config_info{block_size=4,cache_dtype=float32,num_gpu_blocks=40}"] \
        == 1


def test_counters_match_the_state_stream(client):
    url = client.hello().metrics_url
    client.subscribe(["step", "stats"])
    before = scrape(url)
    rng = np.random.default_rng(0)
    shared = rng.integers(32, 126, 12).tolist()  # a common prefix: prefix-cache hits
    prompts = [shared + rng.integers(32, 126, int(n)).tolist() for n in rng.integers(3, 20, 10)]
    params = {"max_tokens": 100, "ignore_eos": True}
    rids = [client.submit(p, params) for p in prompts]
    seen_running = 0.0
    with ThreadPoolExecutor(len(rids)) as pool:
        streams = [pool.submit(lambda r: list(client.stream(r, timeout=120)), r) for r in rids]
        while not all(s.done() for s in streams):
            during = scrape(url)
            seen_running = max(seen_running, during["kvscope:num_requests_running"])
        deltas = [s.result() for s in streams]
    received = sum(len(d.token_ids) for ds in deltas for d in ds)
    assert received == 100 * len(rids)
    assert seen_running >= 1  # a scrape while requests ran saw them

    snap = client.snapshot()
    step = snap.stats.step
    stats = client.wait_frame("stats", 10, lambda f: f.step == step)
    step_frame = client.wait_frame("step", 10, lambda f: f.step == step)
    after = _scrape_until(url, lambda s: s["kvscope:engine_steps_total"] == step)
    engine = stats.engine
    assert after["kvscope:prompt_tokens_total"] == engine.num_prompt_tokens \
        == step_frame.prompt_tokens_total
    assert after["kvscope:generation_tokens_total"] == engine.num_generated_tokens \
        == step_frame.generated_tokens_total
    assert after["kvscope:num_preemptions_total"] == engine.num_preemptions \
        == step_frame.preemptions_total > 0
    assert after["kvscope:prefix_cache_queries_total"] == engine.prefix_cache_queries
    assert after["kvscope:prefix_cache_hits_total"] == engine.prefix_cache_hits > 0
    assert after["kvscope:num_requests_running"] == after["kvscope:num_requests_waiting"] == 0
    assert after["kvscope:kv_cache_usage_perc"] == 0
    assert after["kvscope:kv_cache_cached_blocks"] == engine.num_cached_blocks > 0

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    n = len(rids)
    assert moved("kvscope:request_success_total{finished_reason=length}") == n
    assert moved("kvscope:time_to_first_token_seconds_count") == n
    assert moved("kvscope:e2e_request_latency_seconds_count") == n
    assert moved("kvscope:request_queue_time_seconds_count") == n
    assert moved("kvscope:request_prefill_time_seconds_count") == n
    assert moved("kvscope:request_decode_time_seconds_count") == n
    assert moved("kvscope:request_max_num_generation_tokens_sum") == 100 * n
    assert moved("kvscope:request_generation_tokens_sum") == received
    assert moved("kvscope:request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert moved("kvscope:inter_token_latency_seconds_count") == received - n
    assert moved("kvscope:generation_tokens_total") == received
    assert moved("kvscope:iteration_tokens_total_count") == \
        after["kvscope:engine_steps_total"] - before["kvscope:engine_steps_total"]
    # Histogram buckets are cumulative and end at the count.
    ttft_inf = after["kvscope:time_to_first_token_seconds_bucket{le=+Inf}"]
    assert ttft_inf == after["kvscope:time_to_first_token_seconds_count"]


def _scrape_until(url: str, done, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        sample = scrape(url)
        if done(sample) or time.monotonic() > deadline:
            return sample
        time.sleep(0.1)


def test_device_topic_and_gauges_match_ps(client):
    hello = client.hello()
    client.subscribe(["device"])
    frame = client.wait_frame("device", 10)
    frame = client.wait_frame("device", 10, lambda f: f.seq > frame.seq)  # a 1 Hz stream
    proc = psutil.Process(hello.pid)
    rss = proc.memory_info().rss
    assert frame.pid == hello.pid and frame.device == "cpu" and frame.process_source == "rss"
    assert frame.process_bytes == pytest.approx(rss, rel=0.05)
    assert frame.memory_total == psutil.virtual_memory().total
    assert frame.kv_pool_bytes > 0 and frame.weights_bytes > 0
    assert frame.weights_bytes + frame.kv_pool_bytes + frame.other_bytes == frame.process_bytes
    assert frame.gpu_utilization is None  # no NVML on a CPU engine: missing, not zero
    metrics = scrape(hello.metrics_url)
    assert metrics["kvscope:process_device_memory_bytes"] == pytest.approx(rss, rel=0.05)
    assert metrics["process_resident_memory_bytes"] == pytest.approx(rss, rel=0.05)
    assert metrics["kvscope:process_memory_breakdown_bytes{part=weights}"] == \
        frame.weights_bytes
    assert metrics["kvscope:process_memory_breakdown_bytes{part=kv_pool}"] == \
        frame.kv_pool_bytes
    assert "kvscope:gpu_utilization_ratio" not in metrics
    assert "kvscope:gpu_power_watts" not in metrics


# Every series vLLM's example Grafana dashboard
# (examples/online_serving/prometheus_grafana/grafana.json) queries, with the vllm: prefix
# replaced: the dashboard works once it reads `kvscope:`.
GRAFANA_SERIES = [
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "gpu_cache_usage_perc",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
]


def test_vllm_grafana_dashboard_series_are_all_there(client):
    url = client.hello().metrics_url
    rid = client.submit([72, 105, 33], {"max_tokens": 5, "ignore_eos": True})
    list(client.stream(rid, timeout=60))
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    # The dashboard filters every query on model_name.
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples
             if "model_name" in s.labels}
    missing = [n for n in GRAFANA_SERIES if "kvscope:" + n not in names]
    assert not missing
    metrics = scrape(url)
    assert metrics["kvscope:time_per_output_token_seconds_count"] == \
        metrics["kvscope:inter_token_latency_seconds_count"]
    assert metrics["kvscope:gpu_cache_usage_perc"] == metrics["kvscope:kv_cache_usage_perc"]
    assert metrics["kvscope:request_max_num_generation_tokens_count"] == \
        metrics["kvscope:e2e_request_latency_seconds_count"]


def test_metrics_bind_is_loopback_unless_allowed(capsys):
    from kvscope.engine.cli import serve as serve_cli

    assert serve_cli.main(["--port", "0", "--metrics-port", "0",
                           "--metrics-host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert serve_cli.main(["--port", "0", "--metrics-port", "70000"]) == 2
    assert "--metrics-port 70000" in capsys.readouterr().err
    args = serve_cli.build_parser().parse_args(["--host", "::1", "--metrics-port", "9"])
    assert serve_cli.metrics_address(args) == ("::1", 9)
    args = serve_cli.build_parser().parse_args(["--port", "0"])
    assert serve_cli.metrics_address(args) is None
