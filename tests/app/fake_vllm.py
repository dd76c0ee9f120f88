"""A fake vLLM server made of vLLM's real formats: /metrics text recorded in vLLM v1's shape
(tests/fixtures/vllm_metrics_*.txt), an OpenAI chat endpoint that streams server-sent events,
and a KV-event publisher whose msgpack is built by hand from vLLM's documented schema (maps
tagged by "type" inside a [ts, events, rank] array), with vLLM's PUB framing and replay."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import zmq

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
METRICS = [(FIXTURES / f"vllm_metrics_{i}.txt").read_text() for i in (0, 1)]
REPLY = ["Paged ", "KV ", "caches ", "waste ", "little."]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes, parent, tokens, block_size=16) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def removed(hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")  # vLLM's default hashes: 32 bytes of sha256


# Two prompts sharing a system prompt of two blocks, one eviction, then a second chain.
SCRIPT = [
    [stored([h(1), h(2)], None, list(range(32)))],
    [stored([h(3)], h(2), list(range(100, 116)))],
    [stored([h(4), h(5)], h(2), list(range(200, 232)))],
    [removed([h(3)])],
    [stored([h(6)], None, list(range(300, 316)))],
]


class _Handler(BaseHTTPRequestHandler):
    server: FakeVllmHttp

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/metrics":
            text = METRICS[min(self.server.scrapes, 1)]
            self.server.scrapes += 1
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [
                {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model"}]}).encode(),
                "application/json")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        self.server.chats.append(body)
        if self.path != "/v1/chat/completions" or not body.get("stream"):
            self._send(400, b'{"error": "expected a streaming chat"}', "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, piece in enumerate(REPLY):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": piece},
                                  "finish_reason": None if i < len(REPLY) - 1 else "stop"}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class FakeVllmHttp(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.scrapes = 0
        self.chats: list[dict] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class FakeKvEvents:
    """PUB + replay ROUTER, as vLLM's ZmqEventPublisher: the script's batches are buffered and
    answered to replays at once; then published live, one every `interval_s`."""

    def __init__(self, script=SCRIPT, topic: str = "", interval_s: float = 0.05) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.buffer = [(seq, msgspec.msgpack.encode([1700000000.0 + seq, events, 0]))
                       for seq, events in enumerate(script)]
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_live, live = time.monotonic(), 0
        while not self._stop.is_set():
            if self.replay.poll(10):
                client, _, start = self.replay.recv_multipart()
                first = int.from_bytes(start, "big")
                for seq, payload in self.buffer:
                    if seq >= first:
                        self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                self.replay.send_multipart([client, b"", END_SEQ, b""])
            if time.monotonic() >= next_live and live < len(self.buffer):
                seq, payload = self.buffer[live]
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                live, next_live = live + 1, time.monotonic() + self.interval_s

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)
