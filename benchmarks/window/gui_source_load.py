"""gui_bench --source vllm|llama-server: the window's CPU while it watches an HTTP engine
under load. The window runs as its own process (`kvscope --attach URL --engine KIND`,
offscreen); its share of a core over --seconds is read with psutil, as (b) does for kvscope.

Without --url it watches this checkout's fakes made of the engines' real payloads
(tests/app/fake_llama_server.py with moving slots and growing counters; tests/app/fake_vllm.py
with a KV-event stream of --events-hz batches a second). With --url it watches that server
and drives --load concurrent streaming chats through its OpenAI API meanwhile."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_fake(kind: str, events_hz: float):
    """(url, extra window options, stop) of a fake engine under load (a checkout only)."""
    sys.path.insert(0, str(REPO))
    if kind == "llama-server":
        from tests.app.fake_llama_server import FakeLlamaServer

        fake = FakeLlamaServer()
        fake.live = True
        return fake.url, [], fake.stop
    from tests.app.fake_vllm import FakeVllmHttp

    http, events = FakeVllmHttp(), LiveKvEvents(events_hz)

    def stop() -> None:
        events.stop()
        http.stop()
    return http.url, ["--kv-events", events.endpoint, "--kv-events-replay",
                      events.replay_endpoint], stop


class LiveKvEvents:
    """vLLM's KV-event PUB and replay ROUTER (its wire format, as tests/app/fake_vllm.py),
    publishing a busy prefix cache live: `hz` batches a second over 24 prompt chains, the
    oldest blocks evicted; replay answers from what was published."""

    CHAINS, KEEP = 24, 400

    def __init__(self, hz: float) -> None:
        import msgspec
        import zmq

        self.encode, self.zmq = msgspec.msgpack.encode, zmq
        self.ctx = zmq.Context()
        self.pub, self.replay = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.interval = 1.0 / hz
        self.sent: list[bytes] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def batch(self, i: int) -> list:
        from tests.app.fake_vllm import h, removed, stored

        depth = i // self.CHAINS
        block = h(1 + i)
        parent = None if depth == 0 else h(1 + i - self.CHAINS)
        events = [stored([block], parent, list(range(16)))]
        if i >= self.KEEP:
            events.append(removed([h(1 + i - self.KEEP)]))
        return events

    def _run(self) -> None:
        end = (-1).to_bytes(8, "big", signed=True)
        next_t, i = time.monotonic(), 0
        while not self._stop.is_set():
            if self.replay.poll(2):
                client, _, start = self.replay.recv_multipart()
                for seq in range(int.from_bytes(start, "big"), len(self.sent)):
                    self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"),
                                                self.sent[seq]])
                self.replay.send_multipart([client, b"", end, b""])
            while time.monotonic() >= next_t:
                payload = self.encode([time.time(), self.batch(i), 0])
                self.sent.append(payload)
                self.pub.send_multipart([b"", i.to_bytes(8, "big"), payload])
                i, next_t = i + 1, next_t + self.interval

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


def chat_load(url: str, clients: int, stop: threading.Event, max_tokens: int) -> list[int]:
    """`clients` threads streaming chats until `stop`; the list counts replies per client."""
    from kvscope.app.vllm.openai_chat import OpenAIChat, OpenAIError

    done = [0] * clients

    def run(i: int) -> None:
        chat = OpenAIChat(url, timeout=30)
        model = (chat.models() or ["default"])[0]
        while not stop.is_set():
            try:
                list(chat.stream_chat([{"role": "user", "content": f"Count to {20 + i}."}],
                                      model, max_tokens=max_tokens, temperature=0.0))
                done[i] += 1
            except OpenAIError:
                time.sleep(0.5)

    for i in range(clients):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    return done


def source_cost(kind: str, url: str | None, seconds: float, load: int, events_hz: float,
                max_tokens: int = 64, settle_s: float = 6.0) -> dict:
    import psutil

    stop_fake = None
    extra: list[str] = []
    if url is None:
        url, extra, stop_fake = start_fake(kind, events_hz)
    stop = threading.Event()
    replies = chat_load(url, load, stop, max_tokens) if load and stop_fake is None else []
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "--attach", url, "--engine", kind,
                             *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle_s)  # Qt, the first polls, the first paints
        if proc.poll() is not None:
            raise SystemExit(f"the window process exited ({proc.returncode})")
        p = psutil.Process(proc.pid)
        t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
        time.sleep(seconds)
        cpu, wall = sum(p.cpu_times()[:2]) - c0, time.monotonic() - t0
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if stop_fake is not None:
            stop_fake()
    return {"source": kind, "url": url, "fake": stop_fake is not None, "seconds": wall,
            "window_cpu_s": cpu, "window_core_share": cpu / wall,
            "chat_clients": len(replies), "chat_replies": sum(replies),
            "events_hz": events_hz if kind == "vllm" and stop_fake is not None else None}


def format_source(r: dict) -> str:
    what = "fake (real payload shapes)" if r["fake"] else r["url"]
    load = (f"{r['chat_clients']} chat clients, {r['chat_replies']} replies" if r["chat_clients"]
            else "moving slots/counters" + (f", {r['events_hz']:.0f} KV-event batches/s"
                                            if r["events_hz"] else ""))
    return (f"window watching {r['source']} at {what} ({load}): "
            f"{100 * r['window_core_share']:.1f} % of a core over {r['seconds']:.0f} s")
