"""`kvscope serve --metrics-port`: the ready line means /metrics already serves every family
the engine state feeds (a scraper started on `ready` must not see a partial page)."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvscope.ipc import EngineClient
from tests.support.server_harness import Server, save_chat_model

# The families that used to appear only after the engine thread's first refresh.
STATE_FAMILIES = ("kvscope:num_requests_running", "kvscope:num_requests_waiting",
                  "kvscope:kv_cache_usage_perc", "kvscope:num_preemptions_total",
                  "kvscope:kv_cache_free_blocks", "kvscope:device_memory_total_bytes")


def test_metrics_serve_every_family_at_ready(tmp_path):
    model = save_chat_model(tmp_path / "chat", seed=3)
    server = Server(model, tmp_path / "serve.log", "--num-kv-blocks", "24", "--block-size", "4",
                    "--metrics-port", "0")
    try:
        # The URL comes from the log line printed before `ready`; scrape at once, before any
        # command could wake the engine thread.
        line = next(x for x in server.log_text().splitlines() if "Prometheus metrics at" in x)
        url = line.rsplit(" ", 1)[1]
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        names |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        missing = [n for n in STATE_FAMILIES if n not in names]
        assert not missing, f"/metrics at ready lacks {missing}"
        running = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "kvscope:num_requests_running"]
        assert running == [0.0]  # the engine's real (idle) state, not a placeholder
        client = EngineClient(server.command, server.state)
        try:
            assert client.hello(timeout=30).metrics_url == url
        finally:
            client.close()
    finally:
        server.stop()
