"""Engine status: device, model, dtypes, block size, blocks, preemptions by reason, a notice
when the model runs off the fast decode path, and alive / idle / dead from the heartbeat. A
few times a second it checks how long ago the last heartbeat came."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QLabel, QPushButton, QSizePolicy, QStatusBar, QWidget

from kvscope.app import stale
from kvscope.app.elided_label import ElidedLabel
from kvscope.app.fmt import human_bytes
from kvscope.app.spec_text import engine_spec_text
from kvscope.ipc.messages import EngineStats, HelloResult, StatsFrame

DEAD_AFTER_S = 3.0
CHECK_MS = 250
STATES = ("connecting", "alive", "idle", "busy", "dead")
REASON_ORDER = ("memory", "priority")  # then any other reason, by name
PREEMPTION_TIP = (
    "Running requests the scheduler preempted since the engine started, by reason. memory: "
    "the KV pool ran dry and a running request gave its blocks back; priority: a more urgent "
    "waiting request displaced it (scheduling: priority). A preempted request is recomputed "
    "later (prefix-cache hits spare part of that).")
INTERRUPT_TIP = (
    " Steps interrupted: steps of less urgent work that stopped midway because a more urgent "
    "request (such as this window's chat) arrived; their work is done again.")


class EngineStatusBar(QStatusBar):
    restartRequested = Signal()
    stateChanged = Signal(str)

    def __init__(self, parent: QWidget | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(parent)
        self.clock = clock
        self.state = "connecting"
        self.last_heartbeat: float | None = None
        self.busy = False
        self.dead_reason = ""
        self.exited = False  # dead because its process ended (not only silent)
        self.state_label = QLabel()
        self.state_label.setObjectName("engineState")
        # Elides: a long death reason or model path must not widen the window (issue 23, 4).
        self.engine_label = ElidedLabel("engine: starting…")
        self.blocks_label = QLabel("")
        self.preemptions_label = QLabel("")
        self.preemptions_label.setObjectName("preemptionsLabel")
        self.preemptions_label.hide()
        # The engine's decode-path notice (EngineSettings.decode_path_notice): one line, elided.
        self.notice_label = ElidedLabel("")
        self.notice_label.setObjectName("decodeNotice")
        self.notice_label.hide()
        self.metrics_label = QLabel("")
        self.metrics_label.setObjectName("metricsLabel")
        self.metrics_label.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse)  # to paste into Prometheus' config
        self.metrics_label.hide()
        self.stream_label = QLabel("")
        self.stream_label.setObjectName("streamLabel")
        self.stream_label.setToolTip(
            "The engine's state stream as this window saw it. received: frames that arrived; "
            "coalesced: replaced by a newer frame of the same topic before the next repaint "
            "(the window draws the newest state, at the frame rate shown); lost: published by "
            "the engine but never received (gaps in the sequence numbers)")
        self.restart_button = QPushButton("Restart engine")
        self.restart_button.setObjectName("restartButton")
        self.restart_button.clicked.connect(self.restartRequested)
        self.restart_button.hide()
        self.mode_label = ElidedLabel("local engine")  # a long endpoint must not widen it
        self.mode_label.setObjectName("engineMode")
        # Its full text when there is room, shrinking (elided) before the window would widen.
        self.mode_label.setSizePolicy(QSizePolicy.Policy.Preferred,
                                      QSizePolicy.Policy.Preferred)
        self.addWidget(self.state_label)
        self.addWidget(self.mode_label)
        self.addWidget(self.engine_label, 1)
        self.addWidget(self.notice_label, 1)
        self.addPermanentWidget(self.stream_label)
        self.addPermanentWidget(self.metrics_label)
        self.addPermanentWidget(self.preemptions_label)
        self.addPermanentWidget(self.blocks_label)
        self.addPermanentWidget(self.restart_button)
        self.timer = QTimer(self)
        self.timer.setInterval(CHECK_MS)
        self.timer.timeout.connect(self.check_heartbeat)
        self._set_state("connecting")

    def set_mode(self, attached: str | None, curve: bool = False) -> None:
        """Say whether this window runs its own engine or is attached to one (endpoint, auth);
        attached, Restart can only reconnect, and the button says so."""
        if attached is None:
            self.mode_label.setText("local engine")
            self.restart_button.setText("Restart engine")
            self.restart_button.setToolTip("Start the engine child again, with the settings "
                                           "last applied")
            return
        auth = "CURVE auth on" if curve else "no auth (plain text)"
        self.mode_label.setText(f"attached to {attached} · {auth}")
        self.restart_button.setText("Reconnect")
        self.restart_button.setToolTip("This window does not own the engine: reconnect to it")

    def start_watching(self) -> None:
        self.last_heartbeat = self.clock()
        self.timer.start()

    def stop_watching(self) -> None:
        self.timer.stop()

    def show_hello(self, hello: HelloResult) -> None:
        url, api = hello.metrics_url, hello.http_url
        parts = [f"metrics: {url}"] * bool(url) + [f"OpenAI API: {api}"] * bool(api)
        self.metrics_label.setText(" · ".join(parts))
        self.metrics_label.setToolTip("Prometheus scrapes the metrics URL; any OpenAI client "
                                      "(Open WebUI, editors, scripts) can use the API URL"
                                      if parts else "")
        self.metrics_label.setVisible(bool(parts))
        self.show_notice(hello.config)

    def show_heartbeat(self, hb) -> None:
        if self.state == "dead" and self.exited:  # sent before its process died: stale
            return
        self.last_heartbeat = self.clock()
        self.busy = hb.busy
        if not self.timer.isActive():
            self.timer.start()
        self._set_state("busy" if hb.busy else "idle")

    def show_stats(self, stats: StatsFrame) -> None:
        e = stats.engine
        if self.state == "dead":  # the reason stays in view (a frame in flight came after it)
            return
        self.engine_label.setText(
            f"{e.device} · {model_name(stats.config.model)} · {e.dtype} · KV "
            f"{e.kv_dtype}{rotation_text(e)}{anchors_text(e)} · block {e.block_size} · "
            f"{human_bytes(e.kv_cache_bytes)} KV · up {stats.uptime_s:.0f} s")
        http = stats.server.http_in_flight
        self._mark_stale(False)
        self.blocks_label.setText(f"blocks {e.num_free_blocks} free / {e.num_kv_blocks} total"
                                  + (f" · {http} via HTTP" if http else "")
                                  + engine_spec_text(e))
        self.show_preemptions(getattr(stats, "preemptions_by_reason", None) or {},
                              getattr(stats, "recomputed_tokens", 0),
                              getattr(stats, "interrupted_steps", 0))
        self.show_notice(stats.config)

    def show_preemptions(self, by_reason: dict[str, int], recomputed_tokens: int = 0,
                         interrupted_steps: int = 0) -> None:
        """"preempted: 3 memory · 1 priority · 2 steps interrupted" (hidden until the first
        preemption or interrupted step)."""
        text = " · ".join(t for t in (preemptions_text(by_reason),
                                      interrupted_text(interrupted_steps)) if t)
        if text != self.preemptions_label.text():
            self.preemptions_label.setText(text)
        tip = PREEMPTION_TIP + (f" Tokens recomputed so far: {recomputed_tokens:,}."
                                if recomputed_tokens else "") + INTERRUPT_TIP
        if tip != self.preemptions_label.toolTip():
            self.preemptions_label.setToolTip(tip)
        self.preemptions_label.setVisible(bool(text))

    def show_notice(self, config) -> None:
        """The engine's decode-path notice (an engine without the field: none)."""
        notice = getattr(config, "decode_path_notice", "") or ""
        text = f"⚠ {notice}" if notice else ""
        if text != self.notice_label.text():
            self.notice_label.setText(text)
            self.notice_label.setToolTip(notice)
        self.notice_label.setVisible(bool(text))

    def show_stream(self, counts, fps: float) -> None:
        """The state stream's counts (app.bridge.StreamCounts) and the window's frame rate."""
        text = (f"{counts.received:,} frames · {counts.coalesced:,} coalesced · "
                f"{counts.lost:,} lost · {fps:.0f} fps")
        if self.stream_label.text() != text:
            self.stream_label.setText(text)

    def check_heartbeat(self) -> None:
        if self.state == "dead" or self.last_heartbeat is None:
            return
        silent = self.clock() - self.last_heartbeat
        if silent > DEAD_AFTER_S:
            self.mark_dead(f"no heartbeat for {silent:.1f} s")

    def mark_dead(self, reason: str, exited: bool = False) -> None:
        """The first reason stays while dead: a later "no heartbeat" says less than "killed
        by SIGKILL"; only a new state (connecting, alive) replaces it. exited: the engine's
        process is gone, so frames still queued from it change nothing (after a silence
        alone, a heartbeat brings the engine back)."""
        self.exited = self.exited or exited
        if self.state == "dead" and self.dead_reason:
            return
        self.dead_reason = reason
        self._set_state("dead")

    def mark_connecting(self, text: str = "starting the engine…") -> None:
        self.last_heartbeat = None
        self.engine_label.setText(text)
        self._set_state("connecting")

    def show_loading(self, text: str) -> None:
        """What the engine does while it starts (converting the model: 42 %); only while
        connecting, so a late line never hides a live engine's facts or a death's reason."""
        if self.state == "connecting":
            self.engine_label.setText(text)

    def _set_state(self, state: str) -> None:
        label = {"connecting": "● connecting", "idle": "● idle", "busy": "● running",
                 "alive": "● alive", "dead": "● DEAD"}[state]
        self.state_label.setText(label)
        if self.state_label.property("state") != state:  # a re-polish per heartbeat adds up
            self.state_label.setProperty("state", state)
            self.state_label.style().unpolish(self.state_label)
            self.state_label.style().polish(self.state_label)
        self.restart_button.setVisible(state == "dead")
        # Nothing streams from a dead engine: its room goes to the reason (cut at 1280 px).
        self.stream_label.setVisible(state != "dead")
        if state in ("dead", "connecting"):  # what the last engine said, until a new one does
            self._mark_stale(True)
        if state == "dead":
            self.engine_label.setText(f"engine is dead: {self.dead_reason}")
        elif state == "connecting":
            self.dead_reason = ""
            self.exited = False
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state)


    def _mark_stale(self, old: bool) -> None:
        """The pool, preemption and endpoint labels of an engine that is gone: greyed and
        said to be old (old=True), or live again."""
        for label in (self.blocks_label, self.preemptions_label, self.metrics_label):
            stale.mark(label, old)
            text = stale.plain(label.text()) if old else stale.live(label.text())
            if text != label.text():
                label.setText(text)


def preemptions_text(by_reason: dict[str, int]) -> str:
    """"preempted: 3 memory · 1 priority"; "" when nothing was preempted."""
    counts = {r: n for r, n in by_reason.items() if n > 0}
    if not counts:
        return ""
    order = [r for r in REASON_ORDER if r in counts] + sorted(set(counts) - set(REASON_ORDER))
    return "preempted: " + " · ".join(f"{counts[r]} {r}" for r in order)


def interrupted_text(steps: int) -> str:
    return f"{steps} step{'s' if steps != 1 else ''} interrupted" if steps > 0 else ""


def model_name(model: str) -> str:
    """EngineSettings.model as the user knows it: the embedded model by name, else the
    checkpoint's folder or file name."""
    return "SmolLM2-135M-Instruct (embedded)" if model == "default" else Path(model).name


def rotation_text(engine_stats: EngineStats) -> str:
    """' + Hadamard' (or the matrix the head dim got) when the engine stores K/V rotated, and
    ' + K balance' when the keys are also calibrated (kv_rotation "calibrated")."""
    if engine_stats.kv_rotation == "none":
        return ""
    text = f" + {engine_stats.kv_rotation_matrix or 'Hadamard'}"
    return text + " + K balance" if engine_stats.kv_rotation == "calibrated" else text


def anchors_text(engine_stats: EngineStats) -> str:
    """' + 4 exact' when a 1-byte pool keeps its openings' first positions exact
    (EngineConfig.kv_anchor_tokens)."""
    n = engine_stats.kv_anchor_tokens
    return f" + {n} exact" if n > 0 else ""
