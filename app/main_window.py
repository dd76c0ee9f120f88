"""The kvscope window: chat | block map and device panel over batch plots, a side panel
(controls, load, KV calculator) and the engine status bar. Owns the engine child (or attaches
to an engine) and the two repaint clocks: images and curves at ~30 Hz, text labels at 4 Hz."""
from __future__ import annotations

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QDockWidget, QMainWindow, QSplitter, QTabWidget

from app import settings as app_settings
from app.blocks.block_map import BlockMap
from app.bridge import EngineBridge
from app.calculator.panel import KVCalculatorPanel
from app.chat.panel import ChatPanel
from app.controls.load_generator import LoadGenerator, LoadGeneratorPanel
from app.controls.panel import ControlsPanel
from app.device.panel import DevicePanel
from app.engine_process import EngineProcess
from app.plots.batch_plots import BatchPlots
from app.status_bar import EngineStatusBar
from app.traces.panel import TracePanel, engine_args_from

REPAINT_MS = 33
LABELS_MS = 250


def default_size(screen) -> tuple[int, int]:
    """1600x960, or more of a big screen (chat, block map, device panel and the side panel
    all want width), never more than the screen offers."""
    if screen is None:
        return 1600, 960
    free = screen.availableGeometry()
    return max(1600, min(1920, free.width() - 40)), max(960, min(1080, free.height() - 60))


class MainWindow(QMainWindow):
    engineReady = Signal(object)  # HelloResult

    def __init__(self, *, engine_args: list[str] | None = None, attach: str | None = None,
                 attach_state: str | None = None, settings: QSettings | None = None,
                 heartbeat_timeout: float = 3.0) -> None:
        super().__init__()
        self.setWindowTitle("kvscope")
        self.setObjectName("kvscopeMainWindow")
        self.settings = settings if settings is not None else app_settings.default_settings()
        self.attach_endpoints = (attach, attach_state) if attach else None
        self.hello = None
        self.closed = False
        self.bridge = EngineBridge(self, heartbeat_timeout=heartbeat_timeout)
        self.engine = None if attach else EngineProcess(engine_args, self)

        self.chat = ChatPanel()
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

        self.top_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.top_splitter.addWidget(self.block_map)
        self.top_splitter.addWidget(self.device_panel)
        self.top_splitter.setSizes([680, 340])
        self.top_splitter.setStretchFactor(0, 1)  # a wider window widens the map, not the panel
        self.top_splitter.setCollapsible(1, False)
        self.right_splitter = QSplitter(Qt.Orientation.Vertical)
        self.right_splitter.addWidget(self.top_splitter)
        self.right_splitter.addWidget(self.plots)
        self.right_splitter.setSizes([520, 420])
        self.main_splitter = QSplitter(Qt.Orientation.Horizontal)
        self.main_splitter.addWidget(self.chat)
        self.main_splitter.addWidget(self.right_splitter)
        self.main_splitter.setSizes([360, 1100])
        self.main_splitter.setStretchFactor(1, 1)
        self.setCentralWidget(self.main_splitter)
        self.side_tabs = QTabWidget()
        self.side_tabs.addTab(self.controls, "Engine")
        self.side_tabs.addTab(self.load_panel, "Load")
        self.side_tabs.addTab(self.kv_calculator, "KV calculator")
        self.side_tabs.addTab(self.trace_panel, "Trace")
        self.side_dock = QDockWidget("Controls", self)
        self.side_dock.setObjectName("controlsDock")
        self.side_dock.setWidget(self.side_tabs)
        self.side_dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                                   | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.side_dock)
        # As narrow as its tabs allow: the width is worth more to the map and device panel.
        self.resizeDocks([self.side_dock], [self.side_dock.minimumSizeHint().width()],
                         Qt.Orientation.Horizontal)
        self.resize(*default_size(self.screen()))

        self._wire()
        self._shortcuts()
        self.repaint_timer = QTimer(self)
        self.repaint_timer.setInterval(REPAINT_MS)
        self.repaint_timer.timeout.connect(self.repaint_views)
        self.labels_timer = QTimer(self)
        self.labels_timer.setInterval(LABELS_MS)
        self.labels_timer.timeout.connect(self.refresh_labels)
        app_settings.restore(self, self.settings)

    # -- wiring ---------------------------------------------------------------------------------
    def _wire(self) -> None:
        b = self.bridge
        b.stateReceived.connect(self.on_state)
        b.deltasReceived.connect(self.chat.on_deltas)
        b.deltasReceived.connect(self.load.on_deltas)
        b.helloReceived.connect(self.on_hello)
        b.engineDied.connect(self.on_engine_dead)
        b.submitFailed.connect(self.chat.on_submit_failed)
        b.submitFailed.connect(self.load.on_submit_failed)
        b.reconfigured.connect(self.on_reconfigured)
        b.reconfigureRefused.connect(self.controls.show_refused)
        b.commandFailed.connect(self.on_command_failed)
        self.chat.submitRequested.connect(b.submit)
        self.chat.abortRequested.connect(b.abort)
        self.chat.requestSelected.connect(self.block_map.select_request)
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
            self.engine.exited.connect(
                lambda code: self.on_engine_dead(f"the engine process exited (code {code})"))

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
        self.repaint_timer.start()
        self.labels_timer.start()
        if self.engine is not None:
            self.status.mark_connecting("starting the engine (loading the model)…")
            self.engine.start()
        else:
            self.status.mark_connecting(f"attaching to {self.attach_endpoints[0]}…")
            self.bridge.attach(*self.attach_endpoints)

    def restart_engine(self) -> None:
        self.bridge.detach()
        self.chat.fail_all("the engine was restarted")
        self.load.fail_all()
        self.plots.clear()
        self.device_panel.clear()
        self.hello = None
        self.controls.set_enabled(False)
        self.start()

    def shutdown(self) -> None:
        """Stop timers, threads and the engine child; idempotent."""
        if self.closed:
            return
        self.closed = True
        app_settings.save(self, self.settings)
        self.load.stop(abort=False)
        self.repaint_timer.stop()
        self.labels_timer.stop()
        self.status.stop_watching()
        self.trace_panel.stop()
        self.bridge.close()
        if self.engine is not None:
            self.engine.stop()

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)

    # -- engine facts ---------------------------------------------------------------------------
    def on_hello(self, hello) -> None:
        self.hello = hello
        self.controls.show_config(hello.config)
        self.kv_calculator.set_running_model(str(hello.config.get("model", "")))
        self.status.show_hello(hello)
        self.status.start_watching()
        self.engineReady.emit(hello)

    def replay_engine_args(self) -> list[str]:
        """The Engine tab's settings (as the controls show them) as replay CLI options."""
        config = self.hello.config if self.hello is not None else {}
        values = self.controls.values() if self.controls.config else {}
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
            self.kv_calculator.set_engine_kv(frame.engine.get("kv_bytes_per_token"),
                                             frame.engine.get("kv_dtype"))
            self.kv_calculator.fits.set_engine_block_size(frame.engine.get("block_size"))
            self.kv_calculator.fits.set_engine_max_seqs(frame.config.get("max_num_seqs"))
        elif topic == "device":
            self.device_panel.show_device(frame)
            self.kv_calculator.fits.set_device(frame)
        elif topic == "heartbeat":
            self.status.show_heartbeat(frame)

    def on_reconfigured(self, config: dict) -> None:
        self.controls.show_applied(config)

    def on_engine_dead(self, reason: str) -> None:
        if self.closed:
            return
        self.status.mark_dead(reason)
        self.kv_calculator.fits.set_device(None)  # that device's free memory is no longer known
        self.device_panel.mark_stale("engine dead")
        self.chat.fail_all(f"engine died: {reason}")
        self.load.fail_all()
        if self.controls.busy:
            self.controls.show_refused(f"engine died: {reason}")
        self.controls.set_enabled(False)

    def on_engine_failed(self, message: str) -> None:
        self.on_engine_dead(message)

    def on_command_failed(self, command: str, message: str) -> None:
        self.status.showMessage(f"{command} failed: {message}", 8000)

    # -- clocks ---------------------------------------------------------------------------------
    def repaint_views(self) -> None:
        self.block_map.refresh()
        self.plots.refresh()
        self.device_panel.refresh()

    def refresh_labels(self) -> None:
        self.block_map.refresh_labels()
        self.device_panel.refresh_labels()
        self.chat.refresh_labels()
