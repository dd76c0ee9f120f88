"""A fake llama.cpp `llama-server` made of its real payloads: /slots, /props and /metrics as
tools/server writes them (tests/fixtures/llama_server_*, see the note there), /health, and an
OpenAI chat that streams server-sent events. Switches make it misbehave: /slots off (the 501
llama-server sends when started with --no-slots), /metrics off, malformed payloads, a slow
reply, and stop()/start() on the same port (the server goes away and comes back)."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SLOTS = json.loads((FIXTURES / "llama_server_slots.json").read_text())
PROPS = json.loads((FIXTURES / "llama_server_props.json").read_text())
METRICS = [(FIXTURES / f"llama_server_metrics_{i}.txt").read_text() for i in (0, 1)]
REPLY = ["Slots ", "hold ", "one ", "context ", "each."]
NO_SLOTS = {"error": {"code": 501, "message": "This server does not support slots endpoint. "
                      "Start it with `--slots`", "type": "not_supported_error"}}
NO_METRICS = {"error": {"code": 501, "message": "This server does not support metrics "
                        "endpoint. Start it with `--metrics`", "type": "not_supported_error"}}


class _Handler(BaseHTTPRequestHandler):
    server: _Http

    def log_message(self, *args) -> None:
        pass

    def handle(self) -> None:
        # the client may give up first (a stalled reply past its timeout)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()

    def do_GET(self) -> None:
        fake = self.server.fake
        if fake.delay_s:
            fake.wake.wait(fake.delay_s)  # a stalled server; stop() ends the stall
        path = self.path.split("?")[0]
        fake.hits[path] = fake.hits.get(path, 0) + 1
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/props":
            self._json(200, PROPS) if fake.bad != "props" else self._raw(200, b"[1, 2")
        elif path == "/slots":
            if not fake.slots_enabled:
                self._json(501, NO_SLOTS)
            elif fake.bad == "slots":
                self._json(200, {"slots": "not a list"})
            else:
                self._json(200, fake.live_slots() if fake.live else fake.slots)
        elif path == "/metrics":
            if not fake.metrics_enabled:
                self._json(501, NO_METRICS)
            elif fake.bad == "metrics":
                self._raw(200, b'llamacpp:requests_processing{a="b} 1\n', "text/plain")
            else:
                text = fake.live_metrics() if fake.live else METRICS[min(fake.scrapes, 1)]
                fake.scrapes += 1
                self._raw(200, text.encode(), "text/plain; version=0.0.4")
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": PROPS["model_alias"], "object": "model", "owned_by": "llamacpp"}]})
        else:
            self._json(404, {"error": {"code": 404, "message": "File Not Found",
                                       "type": "not_found_error"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        self.server.fake.chats.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in REPLY:
            chunk = {"choices": [{"index": 0, "delta": {"content": piece},
                                  "finish_reason": None}], "object": "chat.completion.chunk"}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, code: int, body) -> None:
        self._raw(code, json.dumps(body).encode(), "application/json; charset=utf-8")

    def _raw(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Http(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handlers: none outlives the fake
    allow_reuse_address = True

    def __init__(self, fake: FakeLlamaServer, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.fake = fake


class FakeLlamaServer:
    def __init__(self, *, slots_enabled: bool = True, metrics_enabled: bool = True) -> None:
        self.slots_enabled, self.metrics_enabled = slots_enabled, metrics_enabled
        self.bad: str | None = None  # "slots" | "metrics" | "props": answer garbage there
        self.delay_s = 0.0
        self.wake = threading.Event()
        self.slots = SLOTS
        self.live = False  # counters and slot fill move with time (benchmarks, screenshots)
        self.started = time.monotonic()
        self.scrapes = 0
        self.hits: dict[str, int] = {}
        self.chats: list[dict] = []
        self.port = 0
        self.http: _Http | None = None
        self.start()

    def live_metrics(self) -> str:
        """A busy server (live=True): counters that grow with time, as under load."""
        t = time.monotonic() - self.started
        values = {"prompt_tokens_total": 2000 * t, "tokens_predicted_total": 150 * t,
                  "n_decode_total": 60 * t, "requests_processing": 3, "requests_deferred": 1}
        lines = []
        for line in METRICS[1].splitlines():
            name = line.split(" ")[0].removeprefix("llamacpp:")
            lines.append(f"llamacpp:{name} {values[name]}" if name in values else line)
        return "\n".join(lines) + "\n"

    def live_slots(self) -> list:
        t = time.monotonic() - self.started

        def moved(s: dict) -> dict:
            step = 40 * t if s["is_processing"] else 0
            decoded = [{**n, "n_decoded": n["n_decoded"] + int(step)} for n in s["next_token"]]
            return {**s, "n_prompt_tokens": int((s["n_prompt_tokens"] + step) % s["n_ctx"]),
                    "next_token": decoded}
        return [moved(s) if "id_task" in s else s for s in self.slots]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.wake.clear()
        self.http = _Http(self, self.port)
        self.port = self.http.server_port
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.wake.set()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.thread.join(5)
            self.http = None
