"""`kvscope --attach-vllm URL`: the window over a vLLM server.

The batch plots come from its /metrics, the prefix-cache map from its KV events, the chat
from its OpenAI API; the settings kvscope could change on its own engine are shown read-only.
A header says what is known of a vLLM server and what is not.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QLabel, QSplitter, QVBoxLayout, QWidget

from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.app.vllm.chat_box import ChatBox
from kvscope.app.vllm.map_view import PrefixMapView
from kvscope.app.vllm.openai_chat import OpenAIChat
from kvscope.app.vllm.plot_feed import PlotFeed
from kvscope.app.vllm.prefix_cache import CacheSnapshot
from kvscope.app.vllm.read_only_controls import ReadOnlyControls
from kvscope.app.vllm.source import SourceUpdate, VllmSource, VllmTarget

REFRESH_MS = 33
KNOWN = ("Known from a vLLM server: queues, KV usage, preemptions, throughput, TTFT/ITL and "
         "the prefix-cache hit rate (its /metrics); which content hashes are in the prefix "
         "cache, how they chain and their tokens (its KV events). Not known: physical block "
         "ids, which request holds which block, blocks of running requests that are not full "
         "yet, per-step batches (the plots average over a scrape interval) and device memory.")
NO_EVENTS = ("No KV events: start vLLM with --kv-events-config and pass --kv-events "
             "tcp://HOST:PORT to see its prefix cache.")


class VllmWindow(QWidget):
    def __init__(self, target: VllmTarget, parent: QWidget | None = None,
                 scrape_interval_s: float = 1.0) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"kvscope — vLLM at {target.base_url}")
        self.target = target
        self.source = VllmSource(target, scrape_interval_s)
        self.feed = PlotFeed()
        self.capacity: int | None = None
        self.last_cache: CacheSnapshot | None = None
        self.last_events = None  # the KV-event subscriber's counters
        self._drawn_capacity: int | None = None
        self.header = QLabel(f"vLLM at {target.base_url} — connecting…")
        self.header.setObjectName("panelTitle")
        self.known = QLabel(KNOWN if target.kv_events else KNOWN + " " + NO_EVENTS)
        self.known.setWordWrap(True)
        self.plots = BatchPlots()
        self.map = PrefixMapView()
        self.cache_text = QLabel("prefix cache: waiting for KV events" if target.kv_events
                                 else "prefix cache: no KV events")
        self.cache_text.setWordWrap(True)
        self.controls = ReadOnlyControls()
        self.chat = ChatBox(OpenAIChat(target.base_url))
        right = QWidget()
        r = QVBoxLayout(right)
        r.setContentsMargins(0, 0, 0, 0)
        title = QLabel("Prefix cache (from KV events: content hashes, not physical blocks)")
        title.setObjectName("panelTitle")
        r.addWidget(title)
        r.addWidget(self.map, 2)
        r.addWidget(self.cache_text)
        r.addWidget(self.controls)
        r.addWidget(self.chat, 2)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.plots)
        split.addWidget(right)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.addWidget(self.header)
        layout.addWidget(self.known)
        layout.addWidget(split, 1)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)

    def start(self) -> None:
        self.source.start()
        self.timer.start(REFRESH_MS)

    def refresh(self) -> None:
        self.show_update(self.source.take())
        self.chat.refresh()
        self.plots.refresh()

    def show_update(self, update: SourceUpdate) -> None:
        for s in update.samples:
            step, kv, stats = self.feed.frames_of(s)
            self.plots.show_step(step)
            if kv is not None:
                self.plots.show_blocks(kv)
            self.plots.show_stats(stats)
            self.capacity = s.num_blocks or self.capacity
            self.controls.show_config(s.cache_config)
            hit = "—" if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.0f} %"
            self.header.setText(f"vLLM at {self.target.base_url} · {s.model or '?'} · "
                                f"{s.running or 0:.0f} running, {s.waiting or 0:.0f} waiting · "
                                f"prefix-cache hit rate {hit}")
        if update.error:
            self.header.setText(f"vLLM at {self.target.base_url} — {update.error}")
        capacity_learned = update.samples and self.capacity != self._drawn_capacity
        if update.cache is not None or (capacity_learned and self.last_cache is not None):
            self.last_cache = update.cache or self.last_cache
            self.last_events = update.events or self.last_events
            self._drawn_capacity = self.capacity
            self.map.show_cache(self.last_cache, self.capacity)
            self.cache_text.setText(describe_cache(self.last_cache, self.capacity,
                                                   self.last_events))

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)

    def shutdown(self) -> None:
        self.timer.stop()
        self.source.stop()
        self.chat.close_worker()


def describe_cache(c: CacheSnapshot, capacity: int | None, events) -> str:
    of = f" of {capacity} in the pool" if capacity else ""
    parts = [(f"{c.num_blocks} blocks cached{of} ({c.num_tokens} tokens) in {c.num_chains} "
              f"chains, longest {c.longest_chain}"),
             f"stored {c.stored_total}, removed {c.removed_total}, cleared {c.cleared_total}×"]
    if c.unknown_removed:
        parts.append(f"{c.unknown_removed} removals of blocks stored before kvscope attached")
    if events is not None:
        parts.append(f"{events.received} batches ({events.replayed} replayed, "
                     f"{events.missed} lost, {events.bad} bad)")
    if c.mediums:
        parts.append("medium " + "/".join(c.mediums))
    return " · ".join(parts)
