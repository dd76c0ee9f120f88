"""The vLLM server as a source: a worker thread scrapes /metrics and follows the KV events; the
window takes the newest state from its mailbox on its own timer, so Qt is never touched here.
"""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvscope.app.vllm import prometheus_text
from kvscope.app.vllm.prefix_cache import CacheSnapshot, PrefixCache
from kvscope.app.vllm.server_sample import ServerSample, sample
from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber, SubscriberCounters

SCRAPE_INTERVAL_S = 1.0
SNAPSHOT_INTERVAL_S = 0.2  # the map is copied for the window at most this often
QUIET_CATCH_UP_S = 2.0  # a quiet stream asks for a replay of anything it may have lost


@dataclass
class SourceUpdate:
    samples: list[ServerSample] = field(default_factory=list)  # new since the last take
    cache: CacheSnapshot | None = None  # newest, when it changed
    events: SubscriberCounters | None = None
    error: str | None = None  # newest problem; None once things work again
    scraped_ok: bool = False


@dataclass(frozen=True)
class VllmTarget:
    base_url: str  # http://HOST:8000
    kv_events: str | None = None  # tcp://HOST:5557
    kv_events_replay: str | None = None
    topic: str = ""

    @property
    def metrics_url(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/metrics") else base + "/metrics"


class VllmSource:
    def __init__(self, target: VllmTarget, scrape_interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.target = target
        self.scrape_interval_s = scrape_interval_s
        self._lock = threading.Lock()
        self._pending = SourceUpdate()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm", daemon=True)
        self.cache = PrefixCache()  # worker thread only

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def take(self) -> SourceUpdate:
        with self._lock:
            update, self._pending = self._pending, SourceUpdate(error=self._pending.error)
        return update

    # -- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        t = self.target
        sub = KVEventSubscriber(t.kv_events, t.kv_events_replay, t.topic) if t.kv_events else None
        previous: tuple[prometheus_text.Samples, float] | None = None
        next_scrape = next_snapshot = 0.0
        last_event = time.monotonic()
        dirty = False
        try:
            if sub is not None:
                dirty = self._apply(sub.replay_from(0))  # what the server still buffers
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_scrape:
                    previous = self._scrape(previous)
                    next_scrape = now + self.scrape_interval_s
                if sub is None:
                    self._stop.wait(max(0.0, next_scrape - time.monotonic()))
                    continue
                got = sub.poll(50)
                if got:
                    last_event = time.monotonic()
                elif time.monotonic() - last_event > QUIET_CATCH_UP_S:
                    got, last_event = sub.catch_up(), time.monotonic()
                dirty |= self._apply(got)
                if dirty and time.monotonic() >= next_snapshot:
                    self._publish_cache(sub.counters)
                    dirty, next_snapshot = False, time.monotonic() + SNAPSHOT_INTERVAL_S
        finally:
            if sub is not None:
                sub.close()

    def _apply(self, batches) -> bool:
        for _, batch in batches:
            self.cache.apply(batch)
        return bool(batches)

    def _publish_cache(self, counters: SubscriberCounters) -> None:
        snapshot = self.cache.snapshot()
        with self._lock:
            self._pending.cache = snapshot
            self._pending.events = SubscriberCounters(**vars(counters))

    def _scrape(self, previous):
        url = self.target.metrics_url
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                body = reply.read(prometheus_text.MAX_BYTES + 1)
            samples = prometheus_text.parse(body.decode("utf-8", errors="replace"))
        except (urllib.error.URLError, OSError, prometheus_text.MetricsError) as exc:
            with self._lock:
                self._pending.error = f"{url}: {exc}"
            return previous
        now = time.time()
        with self._lock:
            self._pending.error = None
            self._pending.scraped_ok = True
            if previous is not None:
                self._pending.samples.append(sample(previous[0], samples, previous[1], now))
        return samples, now
