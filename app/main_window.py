"""The kvscope window: the KV block map over the history row (batch plots | device panel) in
the middle, the chat and the side panel (controls, load, KV calculator, trace) in docks, the
engine status bar below. Owns the engine child (or attaches to an engine) and the frame clock
(app.frame_clock) that paces every repaint."""
from __future__ import annotations

import msgspec
from PySide6.QtCore import QRect, QSettings, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import QDockWidget, QMainWindow, QScrollArea, QSplitter, QTabWidget

from kvscope.app import settings as app_settings
from kvscope.app.blocks.block_map import BlockMap
from kvscope.app.bridge import EngineBridge
from kvscope.app.calculator.panel import KVCalculatorPanel
from kvscope.app.chat.panel import ChatPanel
from kvscope.app.chat.store import ChatStore
from kvscope.app.controls.load_generator import LoadGenerator, LoadGeneratorPanel
from kvscope.app.controls.panel import KEYS, ControlsPanel
from kvscope.app.device.panel import DevicePanel
from kvscope.app.engine_process import EngineProcess
from kvscope.app.engine_words import in_window_words
from kvscope.app.frame_clock import FrameClock, FrameJobs
from kvscope.app.model_menu import FileMenu
from kvscope.app.model_switch import ModelSwitcher
from kvscope.app.plots.batch_plots import BatchPlots
from kvscope.app.sources.kvscope_source import KvscopeSource
from kvscope.app.status_bar import EngineStatusBar
from kvscope.app.traces.panel import TracePanel, engine_args_from
from kvscope.app.wheel_guard import guard_wheel
from kvscope.ipc.messages import EngineSettings, HelloResult

WIDE = 1800  # around this width the chat and the side panel each get a column of their own
# Hysteresis: a window dragged to about WIDE does not flip between the two arrangements.
THREE_COLUMNS_FROM = 1850
TWO_COLUMNS_BELOW = 1750
MAP_SHARE = 0.66  # of the middle's height: the block map; the rest is the history row
CHAT_MIN_WIDTH = 300  # the chat's input row and reply headers stay whole
SIDE_MIN_WIDTH = 340  # the Engine tab's fields and its Apply button stay whole
MAP_MIN_HEIGHT = 260  # below its side panel's wish: its block table scrolls instead, and
# the window fits a 1280x720 screen's free area with a title bar and a panel
CHAT_WIDTH, SIDE_WIDTH = 380, 380  # the docks' widths in a new layout (three columns)


def default_size(screen) -> tuple[int, int]:
    """As much of the screen as it offers, up to 1920x1080, never more than it offers (room
    is left for a window manager's frame)."""
    if screen is None:
        return 1600, 960
    free = screen.availableGeometry()
    return (min(1920, free.width() - min(40, free.width() // 32)),
            min(1080, free.height() - min(60, free.height() // 12)))


def arrangement_for(width: int, current: str | None) -> str:
    """"three" (chat | map | controls) or "two" (chat and controls tabbed | map) for a window
    this wide; near WIDE the current arrangement stays (hysteresis)."""
    if width >= THREE_COLUMNS_FROM:
        return "three"
    if width < TWO_COLUMNS_BELOW:
        return "two"
    return current or ("three" if width >= WIDE else "two")


def fits(frame: QRect, free: QRect, slack: int = 8) -> bool:
    """Whether a window's frame lies within the screen's free area (a few pixels of a
    window manager's border may stick out)."""
    return free.adjusted(-slack, -slack, slack, slack).contains(frame)


def shown(widget) -> bool:
    """Whether any of the widget is on screen (a hidden tab or a collapsed splitter: no)."""
    return widget.isVisible() and not widget.visibleRegion().isEmpty()


def scrollable(panel) -> QScrollArea:
    """A side panel in a scroll area: a narrow dock scrolls it instead of widening itself."""
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setWidget(panel)
    return area


def applied_args(config: EngineSettings) -> list[str]:
    """Engine options that start a child with these settings (later options win)."""
    values = {k: getattr(config, k) for k in KEYS}
    args = engine_args_from(values, {})
    return args + ["--kv-anchor-tokens", str(config.kv_anchor_tokens)]


class MainWindow(QMainWindow):
    engineReady = Signal(object)  # HelloResult

    def __init__(self, *, engine_args: list[str] | None = None, attach: str | None = None,
                 attach_state: str | None = None, settings: QSettings | None = None,
                 heartbeat_timeout: float = 3.0, attach_keys=None) -> None:
        super().__init__()
        self.setWindowTitle("kvscope")
        self.setObjectName("kvscopeMainWindow")
        self.settings = settings if settings is not None else app_settings.default_settings()
        self.attach_endpoints = (attach, attach_state) if attach else None
        self.attach_keys = attach_keys  # ipc.keys.ClientKeys, or None for plain text
        self.hello: HelloResult | None = None
        self.closed = False
        # kvscope's own engine as a source: the ZeroMQ bridge, every capability
        self.source = KvscopeSource(attach, self, heartbeat_timeout=heartbeat_timeout)
        self.bridge: EngineBridge = self.source.bridge
        self.base_engine_args = app_settings.with_http_port(engine_args or [], self.settings)
        self.engine = None if attach else EngineProcess(list(self.base_engine_args), self)
        self.applied: EngineSettings | None = None  # the last ReconfigureResult's settings
        self.restarted = False

        self.chat = ChatPanel(ChatStore())  # conversations saved in the user data folder
        self.block_map = BlockMap()
        self.plots = BatchPlots()
        self.device_panel = DevicePanel()
        self.controls = ControlsPanel()
        self.load = LoadGenerator(self)
        self.load_panel = LoadGeneratorPanel(self.load)
        self.kv_calculator = KVCalculatorPanel()
        self.trace_panel = TracePanel(self.bridge, self.replay_engine_args)
        self.status = EngineStatusBar(self)
        self.setStatusBar(self.status)

        self.arrangement: str | None = None  # "three" or "two" columns, see arrangement_for
        self._lay_out()
        self.wheel_guard = guard_wheel(self.side_tabs)  # the wheel scrolls the side panels
        self._menus()
        # File > Open model…; settings applied to this model in an earlier session come back
        self.models = ModelSwitcher(self)
        self.file_menu = FileMenu(self)
        self.restored_settings = self.models.restore_at_start()
        self.resize(*default_size(self.screen()))
        self.center_on_screen()

        self._wire()
        self._shortcuts()
        if self.chat.warnings:  # a cut last line, or a conversation file refused
            self.status.showMessage("chats: " + "; ".join(self.chat.warnings), 15000)
        self.clock = FrameClock(FrameJobs(every_tick=[self._tick_fast],
                                          plots=[self._tick_plots],
                                          labels=[self._tick_labels]), self)
        self.clock.intervalChanged.connect(self.bridge.set_drain_interval)  # one frame rate
        # No saved layout: lay out for the size the window has when it first shows.
        self.needs_default_layout = self.settings.value("window/state") is None
        app_settings.restore(self, self.settings)
        if not self.needs_default_layout and not (
                app_settings.layout_is_for(self.settings, self.screen()) and self.fits_screen()):
            self.discard_saved_layout()  # saved on a larger screen, or a clipped one

    # -- layout ---------------------------------------------------------------------------------
    def _lay_out(self) -> None:
        """The block map owns the middle; the history row sits under it; chat and controls
        are docks (side by side on a wide window, tabbed on the left otherwise)."""
        self.history_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.history_splitter.addWidget(self.plots)
        self.history_splitter.addWidget(self.device_panel)
        self.history_splitter.setStretchFactor(0, 1)  # a wider window widens the plots
        self.history_splitter.setCollapsible(1, False)
        self.views_splitter = QSplitter(Qt.Orientation.Vertical)
        self.views_splitter.addWidget(self.block_map)
        self.block_map.setMinimumHeight(MAP_MIN_HEIGHT)
        self.views_splitter.addWidget(self.history_splitter)
        self.views_splitter.setStretchFactor(0, 1)  # a taller window grows the map
        self.views_splitter.setCollapsible(0, False)
        self.setCentralWidget(self.views_splitter)
        self.side_tabs = QTabWidget()
        self.side_tabs.setUsesScrollButtons(True)
        for panel, name in ((self.controls, "Engine"), (self.load_panel, "Load"),
                            (self.kv_calculator, "KV calculator"), (self.trace_panel, "Trace")):
            self.side_tabs.addTab(scrollable(panel), name)
        self.chat_dock = self._dock("Chat", "chatDock", self.chat)
        self.side_dock = self._dock("Controls", "controlsDock", self.side_tabs)
        # Tabbed to begin with, the narrowest arrangement: showing the window must not widen it
        # (showEvent then arranges for the real width).
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.chat_dock)
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.side_dock)
        self.tabifyDockWidget(self.chat_dock, self.side_dock)

    def _dock(self, title: str, name: str, widget) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        dock.setMinimumWidth(CHAT_MIN_WIDTH if name == "chatDock" else SIDE_MIN_WIDTH)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        return dock

    def _menus(self) -> None:
        view = self.menuBar().addMenu("&View")
        view.addAction(self.chat_dock.toggleViewAction())
        view.addAction(self.side_dock.toggleViewAction())
        view.addSeparator()
        self.reset_layout_action = QAction("&Reset layout", self)
        self.reset_layout_action.setStatusTip("Dock, size and split the window as on a first "
                                              "start, for this screen")
        self.reset_layout_action.triggered.connect(self.reset_layout)
        view.addAction(self.reset_layout_action)

    def showEvent(self, event) -> None:
        if self.needs_default_layout:
            self.needs_default_layout = False
            self.default_layout(self.width(), self.height())
        elif self.arrangement is None:  # a restored layout: which one, and is it right here
            self.arrangement = self.current_arrangement()
            self.arrange(arrangement_for(self.width(), self.arrangement))
        super().showEvent(event)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        if self.arrangement is not None:
            self.arrange(arrangement_for(event.size().width(), self.arrangement))

    def current_arrangement(self) -> str:
        """The docks as they are now: tabbed together ("two") or in columns ("three")."""
        return "two" if self.side_dock in self.tabifiedDockWidgets(self.chat_dock) else "three"

    def arrange(self, arrangement: str) -> None:
        """Put the docks in three columns or tab them in one; a no-op when they already are."""
        if arrangement == self.arrangement:
            return
        self.arrangement = arrangement
        for dock in (self.chat_dock, self.side_dock):
            dock.setFloating(False)
        if arrangement == "three":
            self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.chat_dock)
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.side_dock)
            self.resizeDocks([self.chat_dock, self.side_dock], [CHAT_WIDTH, SIDE_WIDTH],
                             Qt.Orientation.Horizontal)
        else:
            self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.side_dock)
            self.tabifyDockWidget(self.chat_dock, self.side_dock)
            self.chat_dock.raise_()
            width = max(SIDE_MIN_WIDTH, min(420, self.width() // 4))
            self.resizeDocks([self.chat_dock], [width], Qt.Orientation.Horizontal)

    def default_layout(self, width: int, height: int) -> None:
        """Place the docks and split the middle for a window of this size (no saved layout)."""
        self.arrangement = None
        self.arrange(arrangement_for(width, None))
        map_height = int(MAP_SHARE * height)
        self.views_splitter.setSizes([map_height, height - map_height])
        self.history_splitter.setSizes([width, 340])

    def center_on_screen(self) -> None:
        screen = self.screen()
        if screen is not None:
            free = screen.availableGeometry()
            self.move(free.x() + max(0, (free.width() - self.width()) // 2),
                      free.y() + max(0, (free.height() - self.height()) // 2))

    def fits_screen(self) -> bool:
        """Whether the whole window, frame included, is on the screen's free area."""
        screen = self.screen()
        return screen is None or fits(self.frameGeometry(), screen.availableGeometry())

    def discard_saved_layout(self) -> None:
        """Forget the saved geometry and docks; the window lays out anew for this screen."""
        app_settings.forget_layout(self.settings)
        size = default_size(self.screen())
        # First the docks (a restored or current three columns would keep the window wide),
        # then the narrower minimum is in force before the resize meets it.
        self.arrangement = None
        self.arrange(arrangement_for(size[0], None))
        self.layout().activate()
        self.resize(*size)
        self.center_on_screen()
        self.needs_default_layout = True

    def reset_layout(self) -> None:
        """View > Reset layout: the first start's size, docks and splits, for this screen."""
        self.discard_saved_layout()
        if self.isVisible():
            self.needs_default_layout = False
            self.chat_dock.show()
            self.side_dock.show()
            self.default_layout(self.width(), self.height())

    # -- wiring ---------------------------------------------------------------------------------
    def _wire(self) -> None:
        b = self.bridge
        b.stateReceived.connect(self.on_state)
        b.deltasReceived.connect(self.chat.on_deltas)
        b.deltasReceived.connect(self.load.on_deltas)
        b.helloReceived.connect(self.on_hello)
        b.engineDied.connect(self.on_engine_dead)
        b.engineRevived.connect(self.on_engine_revived)
        b.submitFailed.connect(self.chat.on_submit_failed)
        b.submitFailed.connect(self.load.on_submit_failed)
        b.reconfigured.connect(self.on_reconfigured)
        b.reconfigureRefused.connect(self.controls.show_refused)
        b.commandFailed.connect(self.on_command_failed)
        self.chat.submitRequested.connect(b.submit)
        self.chat.abortRequested.connect(b.abort)
        self.chat.requestSelected.connect(self.block_map.select_request)
        self.chat.noticed.connect(lambda text: self.status.showMessage(text, 6000))
        self.load.submitRequested.connect(b.submit)
        self.load.abortRequested.connect(b.abort)
        self.controls.reconfigureRequested.connect(b.reconfigure)
        # One time window for all history plots; set_window ignores a no-op, so no echo loop.
        self.plots.windowChanged.connect(self.device_panel.set_window)
        self.device_panel.windowChanged.connect(self.plots.set_window)
        self.status.restartRequested.connect(self.restart_engine)
        self.status.stateChanged.connect(
            lambda state: state == "dead" and self.on_engine_dead(self.status.dead_reason))
        if self.engine is not None:
            self.engine.ready.connect(self.bridge.attach)
            self.engine.failed.connect(self.on_engine_failed)
            self.engine.exitedBecause.connect(self.on_engine_dead)
            self.engine.progressed.connect(self.on_engine_progress)

    def _shortcuts(self) -> None:
        for keys, slot in ((Qt.Key.Key_Escape, self.chat.stop),
                           (QKeySequence.StandardKey.New, self.chat.new_conversation),
                           ("Ctrl+L", lambda: self.load_panel.set_running(not self.load.running)),
                           ("Ctrl+Q", self.close)):
            shortcut = QShortcut(QKeySequence(keys), self)
            shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
            shortcut.activated.connect(slot)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the local engine child, or attach to the given one."""
        self.clock.start()
        self.status.set_mode(self.attach_endpoints[0] if self.attach_endpoints else None,
                             self.attach_keys is not None)
        # What the user sends before the engine answers is held and goes out once it does.
        self.chat.set_engine_loading("the engine is starting")
        if self.engine is not None:
            self.status.mark_connecting("starting the engine (loading the model)…")
            self.engine.start()
        else:
            self.status.mark_connecting(f"attaching to {self.attach_endpoints[0]}…")
            self.bridge.attach(*self.attach_endpoints, keys=self.attach_keys)

    def restart_engine(self) -> None:
        self.bridge.detach()
        self.chat.fail_all("the engine was restarted")
        self.load.fail_all()
        self.plots.clear()
        self.device_panel.clear()
        self.hello = None
        self.restarted = True
        if self.engine is not None and self.applied is not None:
            self.engine.engine_args = self.base_engine_args + applied_args(self.applied)
        self.controls.show_unknown()
        self.start()

    def on_engine_revived(self) -> None:
        """The engine answers again (an attached serve restarted): ask who it is, since its
        settings may have changed; on_hello re-enables the controls and refreshes the views.
        Nothing here resizes the window."""
        if self.closed:
            return
        self.status.mark_connecting("the engine is back: asking for its settings…")
        self.device_panel.clear()
        self.restarted = True
        self.bridge.request_hello()

    def shutdown(self) -> None:
        """Stop timers, threads and the engine child; idempotent."""
        if self.closed:
            return
        self.closed = True
        app_settings.save(self, self.settings)
        self.chat.save()  # the shown conversation's prompt and sampling, if changed
        if self.chat.store is not None:
            self.chat.store.close()
        self.load.stop(abort=False)
        self.clock.stop()
        self.status.stop_watching()
        self.trace_panel.stop()
        self.bridge.close()
        if self.engine is not None:
            self.engine.stop()

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)

    # -- engine facts ---------------------------------------------------------------------------
    def on_hello(self, hello: HelloResult) -> None:
        self.hello = hello
        if self.restarted:
            self.controls.show_restarted(hello.config)
        else:
            self.controls.show_config(hello.config)
        self.restarted = False
        self.chat.set_engine_alive(True, "")
        self.chat.set_context_limit(hello.max_model_len)
        self.kv_calculator.set_running_model(hello.config.model)
        self.status.show_hello(hello)
        self.status.start_watching()
        self.repaint_views()
        self.refresh_labels()
        self.engineReady.emit(hello)

    def replay_engine_args(self) -> list[str]:
        """The Engine tab's settings (as the controls show them) as replay CLI options."""
        # engine_args_from (app.traces) reads the settings as a plain dict
        config = msgspec.structs.asdict(self.hello.config) if self.hello is not None else {}
        values = self.controls.values().changed() if self.controls.config is not None else {}
        return engine_args_from(values, config)

    def on_state(self, topic: str, frame) -> None:
        if topic == "blocks":
            self.block_map.show_blocks(frame)
            self.chat.on_blocks(frame)
            self.plots.show_blocks(frame)
        elif topic == "step":
            self.plots.show_step(frame)
        elif topic == "stats":
            self.status.show_stats(frame)
            self.block_map.show_stats(frame)
            self.plots.show_stats(frame)
            self.kv_calculator.set_engine_kv(frame.engine.kv_bytes_per_token,
                                             frame.engine.kv_dtype)
            self.kv_calculator.fits.set_engine_block_size(frame.engine.block_size)
            self.kv_calculator.fits.set_engine_max_seqs(frame.config.max_num_seqs)
        elif topic == "device":
            self.device_panel.show_device(frame)
            self.kv_calculator.fits.set_device(frame)
        elif topic == "heartbeat":
            self.status.show_heartbeat(frame)
            self.clock.set_busy(frame.busy)

    def on_reconfigured(self, config: EngineSettings) -> None:
        self.applied = config  # a restart starts the new child with these
        self.models.remember_applied(config)  # and a later session on this model
        self.controls.show_applied(config)

    def on_engine_dead(self, reason: str) -> None:
        """Everything says the engine is gone; the reason is said once, in full, in the status
        bar (its first line there, the rest in the tooltip), and short elsewhere."""
        if self.closed:
            return
        headline, _, details = reason.partition("\n")
        self.status.mark_dead(headline, exited=True)  # the first reason stays
        if details and self.status.dead_reason == headline:
            self.status.engine_label.setToolTip(f"engine is dead: {headline}\n{details}")
        self.chat.set_engine_alive(False, self.status.dead_reason)
        self.kv_calculator.fits.set_device(None)  # that device's free memory is no longer known
        self.device_panel.mark_stale("engine dead")
        # What it left on screen stays, greyed and marked old, until a new engine's first frame.
        self.block_map.mark_stale(self.status.dead_reason)
        self.plots.mark_stale(self.status.dead_reason)
        self.chat.fail_all(f"engine died: {headline}")
        self.load.fail_all()
        if self.controls.busy:
            self.controls.show_refused(f"engine died: {reason}")
        self.controls.show_unknown()

    def on_engine_progress(self, progress) -> None:
        """The engine child's start, as it says it goes (app.engine_progress.Progress)."""
        if self.closed or self.hello is not None:
            return
        text = f"starting the engine: {progress.text}"
        self.status.show_loading(text + "…")
        self.chat.set_engine_loading(text)

    def on_engine_failed(self, message: str) -> None:
        self.on_engine_dead(in_window_words(message))

    def on_command_failed(self, command: str, message: str) -> None:
        self.status.showMessage(f"{command} failed: {message}", 8000)

    # -- frames -----------------------------------------------------------------------------------
    # The clock's jobs skip views that are off screen (a collapsed splitter, a floating dock
    # closed): their data keeps accumulating and they repaint when they come back.
    def frame_tick(self) -> None:
        """One tick of the frame clock, as its timer runs it (benchmarks, tests)."""
        self.clock.tick()

    def _tick_fast(self) -> None:
        if shown(self.block_map):
            self.block_map.refresh()
        if shown(self.device_panel):
            self.device_panel.refresh_bar()

    def _tick_plots(self) -> None:
        if shown(self.plots):
            self.plots.refresh()
        if shown(self.device_panel):
            self.device_panel.refresh_plots()

    def _tick_labels(self) -> None:
        if shown(self.block_map):
            self.block_map.refresh_labels()
        if shown(self.device_panel):
            self.device_panel.refresh_labels()
        if shown(self.chat):
            self.chat.flush_replies()
            self.chat.refresh_labels()
        self.status.show_stream(self.bridge.stream_counts(), self.clock.hz)

    def repaint_views(self) -> None:
        """Every view with new data, now, on screen or not (a screenshot, a test)."""
        self.block_map.refresh()
        self.plots.refresh()
        self.device_panel.refresh()

    def refresh_labels(self) -> None:
        """Every label, now."""
        self.block_map.refresh_labels()
        self.device_panel.refresh_labels()
        self.chat.flush_replies()
        self.chat.refresh_labels()
        self.status.show_stream(self.bridge.stream_counts(), self.clock.hz)
