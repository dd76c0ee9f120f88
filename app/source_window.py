"""The window over an engine kvscope does not run (vLLM, llama-server), built from the same
views as kvscope's own: the map in the middle (llama-server: one row per slot; vLLM: its
prefix cache), the batch plots and the device panel's place under it, the chat (the same
ChatPanel, through the engine's OpenAI API) and the settings in docks, a status bar naming
the engine. Its chats are saved as the main window's are (app.chat.store), in a folder of
their own per engine kind and address, and come back when that engine is attached again.
What the source does not report says so in place; nothing is drawn as zero.

It takes any app.sources.source.PolledSource and never imports a source module: the launcher
(app.main) builds the source; app.bridge.SourceBridge hands its state over on the GUI thread.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDockWidget,
    QLabel,
    QMainWindow,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.bridge import SourceBridge
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.chat.store import ChatStore, attached_folder
from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.app.remote.prefix_map import PrefixMapView, describe_cache
from kvscope.app.remote.read_only import NotReported, ReadOnlySettings
from kvscope.app.remote.slot_map import SlotMap
from kvscope.app.remote.source_status import SourceStatusBar
from kvscope.app.sources.source import (
    DEVICE,
    KV_USAGE,
    LATENCY,
    PREFIX_CACHE,
    SLOTS,
    STEPS,
    TRACES,
    not_reported,
)

SLOT_TITLE = ("Slots — context fill per slot ({kind} reports no block table and no KV bytes: "
              "one row per slot, filled to the tokens in its KV, coloured by its task)")
PREFIX_TITLE = "Prefix cache (from KV events: content hashes, not physical blocks)"
NO_MAP = "Block map: {missing}"


class SourceWindow(QMainWindow):
    engineReady = Signal()  # the first answer from the engine

    def __init__(self, source, parent: QWidget | None = None,
                 store: ChatStore | None = None) -> None:
        super().__init__(parent)
        self.source = source
        kind = source.kind
        self.setWindowTitle(f"kvscope — {source.label}")
        self.bridge = SourceBridge(source, self)
        self.closed = False
        self.ready = False
        self.capacity: int | None = None
        self.last_cache = None
        self.last_events = None
        self.last_slots = None
        self.facts = ""
        self.notice = ""

        self.header = QLabel(f"{source.label} — connecting…")
        self.header.setObjectName("panelTitle")
        self.header.setWordWrap(True)
        self.known = QLabel(source.known())
        self.known.setWordWrap(True)
        self.notice_label = QLabel("")
        self.notice_label.setWordWrap(True)
        self.notice_label.setStyleSheet("color: #c8a050;")
        self.notice_label.hide()
        self.map_title = QLabel()
        self.map_title.setObjectName("panelTitle")
        self.map_title.setWordWrap(True)
        self.cache_text = QLabel("")
        self.cache_text.setWordWrap(True)
        self.slot_map = self.prefix_map = None
        if source.has(SLOTS):
            self.slot_map = SlotMap(kind)
            self.map_widget = self.slot_map
            self.map_title.setText(SLOT_TITLE.format(kind=kind))
        elif source.has(PREFIX_CACHE):
            self.prefix_map = PrefixMapView()
            self.map_widget = self.prefix_map
            self.map_title.setText(PREFIX_TITLE)
            self.cache_text.setText("prefix cache: waiting for KV events"
                                    if getattr(source, "target", None) is not None
                                    and source.target.kv_events else "prefix cache: no KV events")
        else:
            self.map_widget = NotReported(NO_MAP.format(missing=source.missing("block table")))
        self.plots = BatchPlots()
        self._mark_plots()
        self.device_panel = NotReported(source.missing("device memory") if not source.has(DEVICE)
                                        else "")
        self.chat = ChatPanel(store if store is not None else
                              ChatStore(attached_folder(kind, getattr(source, "url", ""))))
        # A remote engine's chat goes in without a priority: the toggle would promise nothing.
        self.chat.interactive.setEnabled(False)
        self.chat.interactive.setToolTip(f"{kind}: the window's chat is sent without a "
                                         "priority, as any other client's")
        self.controls = ReadOnlySettings(kind, source.settings_rows(), source.read_only_reason())
        self.traces = NotReported(source.missing("traces") + " — kvscope records and replays "
                                  "traces of its own engine" if not source.has(TRACES) else "")
        self.status = SourceStatusBar(source.label)
        self.setStatusBar(self.status)
        self._lay_out()
        self._wire()

    def _mark_plots(self) -> None:
        kind = self.source.kind
        if not self.source.has(KV_USAGE):
            self.plots.mark_not_reported("kv", f"KV usage % — {not_reported(kind)}")
        if not self.source.has(LATENCY):
            self.plots.mark_not_reported("latency", f"latency — {not_reported(kind)}")
        if not self.source.has(STEPS):
            self.plots.mark_not_reported(
                "batch", "batch tokens / decode call (averaged over a scrape; per-step "
                f"batches {not_reported(kind)})")

    def _lay_out(self) -> None:
        top = QWidget()
        t = QVBoxLayout(top)
        t.setContentsMargins(4, 4, 4, 4)
        for w in (self.header, self.known, self.notice_label, self.map_title):
            t.addWidget(w)
        t.addWidget(self.map_widget, 1)
        t.addWidget(self.cache_text)
        history = QSplitter(Qt.Orientation.Horizontal)
        history.addWidget(self.plots)
        history.addWidget(self.device_panel)
        history.setStretchFactor(0, 3)
        history.setStretchFactor(1, 1)
        middle = QSplitter(Qt.Orientation.Vertical)
        middle.addWidget(top)
        middle.addWidget(history)
        middle.setStretchFactor(0, 1)
        middle.setStretchFactor(1, 1)
        self.setCentralWidget(middle)
        side = QTabWidget()
        side.addTab(self.controls, "Engine")
        side.addTab(self.traces, "Trace")
        self.chat_dock = self._dock("Chat", "chatDock", self.chat)
        self.side_dock = self._dock("Controls", "controlsDock", side)
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.chat_dock)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.side_dock)
        self.resizeDocks([self.chat_dock, self.side_dock], [360, 360], Qt.Orientation.Horizontal)

    def _dock(self, title: str, name: str, widget) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        dock.setMinimumWidth(300)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        return dock

    def _wire(self) -> None:
        b = self.bridge
        b.updated.connect(self.show_update)
        b.deltasReceived.connect(self.chat.on_deltas)
        b.submitFailed.connect(self.chat.on_submit_failed)
        b.engineDied.connect(self.on_engine_dead)
        b.engineRevived.connect(self.on_engine_revived)
        self.chat.submitRequested.connect(b.submit)
        self.chat.abortRequested.connect(b.abort)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.bridge.start()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.chat.save()  # the shown conversation's prompt and sampling, if changed
        if self.chat.store is not None:
            self.chat.store.close()
        self.bridge.close()

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)

    # -- engine facts ---------------------------------------------------------------------------
    def on_engine_dead(self, reason: str) -> None:
        self.status.mark_dead(reason)
        self.header.setText(f"{self.source.label} — DEAD: {reason}")
        self.chat.set_engine_alive(False, f"{self.source.kind} is unreachable: {reason}")
        self.chat.fail_all(f"{self.source.kind} went away: {reason}")
        if self.slot_map is not None:
            self.slot_map.mark_stale(f"{self.source.kind} is unreachable: {reason}")
        self.plots.mark_stale(reason)  # its last rates stay, greyed, until it reports again

    def on_engine_revived(self) -> None:
        self.status.mark_alive()
        self.chat.set_engine_alive(True, "")

    def show_update(self, u) -> None:
        """One drain's worth (SourceUpdate): plot frames in order, the rest newest only. Most
        drains bring nothing (a server polled once a second): they cost no repaint."""
        if not changed(u) and (u.error is not None) == (self.status.state == "dead"):
            return
        for step in u.steps:
            self.plots.show_step(step)
        for kv in u.kv:
            self.plots.show_blocks(kv)
        for stats in u.stats:
            self.plots.show_stats(stats)
        for s in u.samples:
            self.capacity = getattr(s, "num_blocks", None) or self.capacity
        if u.settings is not None:
            self.controls.show_settings(u.settings)
        if u.notice is not None:
            self.notice = u.notice
            self.notice_label.setText(u.notice)
            self.notice_label.setVisible(bool(u.notice))
        if u.bad is not None:
            self.status.show_bad(u.bad)
        if u.slots is not None and self.slot_map is not None:
            self.last_slots = u.slots
            self.slot_map.show_slots(u.slots)
        if self.prefix_map is not None:
            self._show_cache(u)
        if u.scraped_ok and not u.error:
            if self.status.state != "alive":
                self.status.mark_alive()
                self.chat.set_engine_alive(True, "")
            if u.facts is not None:
                self.facts = u.facts
            self.header.setText(f"{self.source.label} · {self.facts}" if self.facts
                                else self.source.label)
            if not self.ready:
                self.ready = True
                self.engineReady.emit()
        self.repaint_views()

    def _show_cache(self, u) -> None:
        capacity_learned = bool(u.samples) and self.capacity is not None
        if u.cache is None and not (capacity_learned and self.last_cache is not None):
            return
        self.last_cache = u.cache or self.last_cache
        self.last_events = u.events or self.last_events
        self.prefix_map.show_cache(self.last_cache, self.capacity)
        self.cache_text.setText(describe_cache(self.last_cache, self.capacity,
                                               self.last_events))

    # -- frames ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Take the newest state now and repaint (a screenshot, a test, a benchmark tick)."""
        self.bridge.drain()
        self.repaint_views()

    def repaint_views(self) -> None:
        self.plots.refresh()
        self.chat.flush_replies()
        self.chat.refresh_labels()
        self.status.show_stream(self.bridge.stream_counts())

    def frame_tick(self) -> None:
        self.repaint_views()


def changed(u) -> bool:
    """Whether a SourceUpdate carries anything to draw."""
    return bool(u.steps or u.kv or u.stats or u.samples or u.scraped_ok) or any(
        v is not None for v in (u.cache, u.events, u.slots, u.settings, u.facts, u.notice, u.bad))
