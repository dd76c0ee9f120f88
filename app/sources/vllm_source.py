"""A vLLM server as a source: a worker thread scrapes /metrics and follows the KV events; the
window takes the newest state from the mailbox on its own timer, so Qt is never touched here.

Known from vLLM: queues, KV usage, preemptions, throughput, TTFT/ITL, the prefix-cache hit
rate (/metrics) and which content hashes are in the prefix cache (KV events); not known:
physical block ids, block tables, per-step batches and device memory.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvscope.app.sources import http_get
from kvscope.app.sources.source import (
    CHAT,
    KV_USAGE,
    LATENCY,
    PREEMPTIONS,
    PREFIX_CACHE,
    QUEUES,
    SETTINGS,
    THROUGHPUT,
    ChatError,
    PolledSource,
)
from kvscope.app.vllm import prometheus_text
from kvscope.app.vllm.openai_chat import OpenAIChat, OpenAIError
from kvscope.app.vllm.plot_feed import PlotFeed
from kvscope.app.vllm.prefix_cache import PrefixCache
from kvscope.app.vllm.server_sample import ServerSample, sample
from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber, SubscriberCounters

SCRAPE_INTERVAL_S = 1.0
SNAPSHOT_INTERVAL_S = 0.2  # the map is copied for the window at most this often
QUIET_CATCH_UP_S = 2.0  # a quiet stream asks for a replay of anything it may have lost
KNOWN = ("Known from a vLLM server: queues, KV usage, preemptions, throughput, TTFT/ITL and "
         "the prefix-cache hit rate (its /metrics); which content hashes are in the prefix "
         "cache, how they chain and their tokens (its KV events). Not known: physical block "
         "ids, which request holds which block, blocks of running requests that are not full "
         "yet, per-step batches (the plots average over a scrape interval) and device memory.")
NO_EVENTS = ("No KV events: start vLLM with --kv-events-config and pass --kv-events "
             "tcp://HOST:PORT to see its prefix cache.")
RESTART = "vLLM sets this when the server starts ({flag}); restart it to change it"
SETTINGS_SHOWN = (  # (title, vllm:cache_config_info label, the vLLM flag that sets it)
    ("KV block size", "block_size", "--block-size"),
    ("KV cache dtype", "cache_dtype", "--kv-cache-dtype"),
    ("KV blocks (GPU)", "num_gpu_blocks", "--gpu-memory-utilization / --num-gpu-blocks-override"),
    ("prefix caching", "enable_prefix_caching", "--enable-prefix-caching"),
    ("GPU memory share", "gpu_memory_utilization", "--gpu-memory-utilization"),
)
NOT_IN_METRICS = (("max running requests", "--max-num-seqs"),
                  ("token budget per step", "--max-num-batched-tokens"))


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


class VllmSource(PolledSource):
    kind = "vllm"
    capabilities = frozenset({KV_USAGE, PREFIX_CACHE, QUEUES, THROUGHPUT, LATENCY, PREEMPTIONS,
                              CHAT, SETTINGS})

    def __init__(self, target: VllmTarget, scrape_interval_s: float = SCRAPE_INTERVAL_S) -> None:
        super().__init__(target.base_url)
        self.target = target
        self.scrape_interval_s = scrape_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm", daemon=True)
        self.cache = PrefixCache()  # worker thread only
        self.feed = PlotFeed()  # worker thread only
        self.chat = OpenAIChat(target.base_url)
        self._model: str | None = None

    def known(self) -> str:
        return KNOWN if self.target.kv_events else KNOWN + " " + NO_EVENTS

    def settings_rows(self) -> list[tuple[str, str, str]]:
        """(key, title, why read-only) of the settings the window shows."""
        rows = [(key, title, RESTART.format(flag=flag)) for title, key, flag in SETTINGS_SHOWN]
        rows += [(title, title, RESTART.format(flag=flag) + "; its /metrics does not report it")
                 for title, flag in NOT_IN_METRICS]
        return rows

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def stream_chat(self, messages: list[dict], sampling: dict):
        try:
            if self._model is None:
                models = self.chat.models()
                if not models:
                    raise ChatError("the server lists no models")
                self._model = models[0]
            yield from self.chat.stream_chat(
                messages, self._model, max_tokens=int(sampling.get("max_tokens", 256)),
                temperature=float(sampling.get("temperature", 0.7)))
        except OpenAIError as exc:
            raise ChatError(str(exc)) from None

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
        copy = SubscriberCounters(**vars(counters))
        self.mailbox.post(cache=self.cache.snapshot(), events=copy)
        self.mailbox.set_lost(copy.missed)
        while self.mailbox.bad < copy.bad:  # the subscriber skipped a payload
            self.mailbox.count_bad("a KV-event payload that is not a vLLM event batch")

    def _scrape(self, previous):
        url = self.target.metrics_url
        try:
            reply = http_get.get(url, timeout=5, max_bytes=prometheus_text.MAX_BYTES)
            if reply.status != 200:
                raise http_get.Unreachable(f"{url}: HTTP {reply.status}")
            samples = prometheus_text.parse(reply.body.decode("utf-8", errors="replace"))
        except http_get.Unreachable as exc:
            self.mailbox.post(error=str(exc))
            return previous
        except (prometheus_text.MetricsError, http_get.BadPayload) as exc:
            self.mailbox.count_bad(f"{url}: {exc}")
            self.mailbox.post(error=None, scraped_ok=True)  # it answers: alive, but bad text
            return previous
        now = time.time()
        if previous is None:
            self.mailbox.post(error=None, scraped_ok=True)
            return samples, now
        s = sample(previous[0], samples, previous[1], now)
        self.mailbox.post(error=None, scraped_ok=True, samples=[s], **self._frames(s))
        return samples, now

    def _frames(self, s: ServerSample) -> dict:
        step, kv, stats = self.feed.frames_of(s)
        settings = dict(s.cache_config)
        settings.update({title: "not reported by vllm" for title, _ in NOT_IN_METRICS})
        hit = "—" if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.0f} %"
        facts = (f"{s.model or '?'} · {s.running or 0:.0f} running, {s.waiting or 0:.0f} "
                 f"waiting · prefix-cache hit rate {hit}")
        return {"steps": [step], "kv": [] if kv is None else [kv], "stats": [stats],
                "settings": settings, "facts": facts}
