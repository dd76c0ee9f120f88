"""The load generator aimed at an OpenAI-compatible URL: arrivals, streaming, and the TTFT /
ITL / throughput it reports, against a small scripted SSE server."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import random
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvscope.app.controls.load_stats import LoadStats, gamma_gap, percentile
from kvscope.app.controls.openai_load import OpenAILoadPanel

GAP_S = 0.03  # the scripted server's pause before each token


class Scripted(BaseHTTPRequestHandler):
    bodies: ClassVar[list] = []

    def log_message(self, *args):  # quiet
        pass

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "scripted-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != "Bearer sesame":
            self._json(401, {"error": {"message": "bad key", "type": "x", "param": None,
                                       "code": "invalid_api_key"}})
            return
        Scripted.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(GAP_S)
            chunk = {"choices": [{"index": 0, "text": "tok", "finish_reason": None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")


@pytest.fixture
def url():
    Scripted.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    thread.join(5)


def make_load(qtbot, url, key="sesame"):
    panel = OpenAILoadPanel()
    qtbot.addWidget(panel)
    panel.url.setText(url)
    panel.api_key.setText(key)
    panel.rate.setValue(40)
    panel.concurrency.setValue(3)
    panel.apply_values(prompt_words=(2, 4), max_tokens=(4, 4), seed=1)
    return panel


def test_url_load_streams_and_measures(qtbot, url):
    panel = make_load(qtbot, url)
    load = panel.load
    panel.button.setChecked(True)
    qtbot.waitUntil(lambda: load.stats.done >= 6, timeout=30000)
    panel.button.setChecked(False)
    assert not load.running and not load.in_flight
    assert load.model == "scripted-model"  # asked GET /models
    assert all(b["model"] == "scripted-model" and b["stream"] and b["max_tokens"] == 4
               for b in Scripted.bodies)
    s = load.stats
    assert s.failed == 0 and s.output_tokens == 4 * s.done
    assert min(s.ttft) >= GAP_S * 0.9
    assert statistics.median(s.itl) >= GAP_S * 0.8 and len(s.itl) >= 3 * s.done
    assert 0 < s.output_tokens_per_s < 3 * 4 / (4 * GAP_S) * 1.2  # at most 3 streams at once
    assert "TTFT p50" in panel.results.text() and "done" in panel.results.text()


def test_url_load_reports_a_refused_key(qtbot, url):
    panel = make_load(qtbot, url, key="wrong")
    panel.model.setText("given-model")
    panel.button.setChecked(True)
    qtbot.waitUntil(lambda: panel.load.stats.failed >= 2, timeout=30000)
    panel.button.setChecked(False)
    assert panel.load.stats.done == 0
    assert "HTTP 401: bad key" in panel.load.stats.errors[-1]
    assert "HTTP 401" in panel.results.text()


def test_gamma_arrivals_keep_the_rate_and_burstiness_spreads_them():
    rng = random.Random(0)
    spreads = {}
    for b in (0.25, 1.0, 4.0):
        gaps = [gamma_gap(rng, 5.0, b) for _ in range(20000)]
        assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
        spreads[b] = statistics.pstdev(gaps)
    assert spreads[0.25] > spreads[1.0] > spreads[4.0]
    assert spreads[1.0] == pytest.approx(0.2, rel=0.05)  # Poisson: sd = mean


def test_stats_summary():
    s = LoadStats()
    assert "—" in s.summary() and s.output_tokens_per_s is None
    s.on_sent(10.0)
    s.on_done(12.0, 0.5, [0.1, 0.3], 40)
    assert s.output_tokens_per_s == 20.0 and percentile(s.itl, 50) == 0.1
    assert percentile([], 50) is None
