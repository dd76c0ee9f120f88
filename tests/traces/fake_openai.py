"""A fake OpenAI-compatible server (threaded http.server, HTTP/1.1, chunked SSE) whose replies
follow a plan per request: status, the pieces and the delay before each, usage or none, a
disconnect or malformed event after N pieces, an idle keep-alive connection it drops."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"


@dataclass
class Plan:
    status: int = 200
    error: str = "bad"
    pieces: list[str] = field(default_factory=lambda: ["a", "b", "c"])
    delays: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # before each piece
    usage: bool = True
    finish_reason: str = "length"
    disconnect_after: int | None = None  # close the connection after this many pieces
    malformed_after: int | None = None  # send a bad event after this many pieces
    content_type: str = "text/event-stream"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAI

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/version" and self.server.version:
            self._json(200, {"version": "9.9-fake"})
        else:
            self._json(404, {"error": {"message": f"no {self.path}"}})

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        self.requests_here = getattr(self, "requests_here", 0) + 1
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.server.drop_idle and self.requests_here > 1:
            self.server.dropped += 1
            self.close_connection = True  # read the request, answer nothing: a dropped idle link
            return
        self.server.bodies.append(body)
        if self.server.auth and self.headers.get("Authorization") != self.server.auth:
            self._json(401, {"error": {"message": "wrong key"}})
            return
        plan = self.server.plan(body)
        if plan.status != 200:
            self._json(plan.status, {"error": {"message": plan.error, "type": "x"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", plan.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        for i, (piece, delay) in enumerate(zip(plan.pieces, plan.delays, strict=True)):
            if plan.disconnect_after == i:
                self.close_connection = True
                self.wfile.flush()
                return  # no terminating chunk: an incomplete body
            if plan.malformed_after == i:
                self._chunk(b"data: {not json\n\n")
            time.sleep(delay)
            last = i == len(plan.pieces) - 1
            choice = ({"index": 0, "delta": {"content": piece}} if chat
                      else {"index": 0, "text": piece})
            choice["finish_reason"] = plan.finish_reason if last else None
            self._chunk(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        if plan.usage and body.get("stream_options", {}).get("include_usage"):
            n = len(plan.pieces)
            usage = {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": n,
                     "total_tokens": n}
            self._chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                        + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


class FakeOpenAI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, plan=None, auth: str | None = None, version: bool = True,
                 drop_idle: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.plan = plan or (lambda body: Plan())
        self.auth = f"Bearer {auth}" if auth else None
        self.version = version
        self.drop_idle = drop_idle
        self.dropped = 0
        self.bodies: list[dict] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up on purpose (a timeout test): nothing to report

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
