"""The ZeroMQ <-> Qt bridge: engine state and token deltas in, commands out.

Threads:
* EngineClient's own I/O thread receives frames and deltas; its callbacks only drop them
  into a Mailbox (newest frame per topic, deltas in order) and never touch Qt objects.
* A QTimer on the GUI thread drains the mailbox ~30 times a second and emits plain signals,
  so a burst of 10k frames costs the GUI one frame per topic per tick.
* Commands that wait for a reply (hello, submit, reconfigure, ...) run on a worker QThread;
  their outcomes come back as queued signals.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import msgspec
from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from kvscope.ipc import EngineClient, EngineError, EngineTimeout
from kvscope.ipc.messages import TOPICS
from kvscope.ipc.settings import SettingsChange

DRAIN_INTERVAL_MS = 33
HELLO_ATTEMPTS, HELLO_TIMEOUT_S = 4, 15


class Mailbox:
    """Thread-safe hand-over from the client thread: newest frame per topic + all deltas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames: dict[str, object] = {}
        self._deltas: list = []
        self.frames_in = 0

    def put_frame(self, topic: str, frame) -> None:
        with self._lock:
            self._frames[topic] = carry_preemptions(self._frames.get(topic), frame)
            self.frames_in += 1

    def put_delta(self, delta) -> None:
        with self._lock:
            self._deltas.append(delta)

    def pending(self) -> int:
        """Frames waiting for the next drain (one per topic at most)."""
        with self._lock:
            return len(self._frames)

    def take(self) -> tuple[dict[str, object], list]:
        with self._lock:
            frames, self._frames = self._frames, {}
            deltas, self._deltas = self._deltas, []
        return frames, deltas


MAX_CARRIED_PREEMPTIONS = 256


def carry_preemptions(replaced, frame):
    """A blocks frame replaced before the window saw it hands its preemptions on to the newer
    one: they happened between frames and exist nowhere else (the map flashes them)."""
    old = getattr(replaced, "preemptions", None)
    if not old:
        return frame
    merged = (list(old) + list(frame.preemptions))[-MAX_CARRIED_PREEMPTIONS:]
    return msgspec.structs.replace(frame, preemptions=merged)


@dataclass(frozen=True)
class StreamCounts:
    """The state stream as the window saw it: nothing is dropped silently.

    received: frames that reached this process; shown: the newest-per-topic frames handed to
    the views; coalesced: received but replaced by a newer frame of the same topic before the
    window's next tick (received - shown); lost: frames the engine published that never
    arrived (gaps in the per-topic sequence numbers)."""
    received: int
    shown: int
    coalesced: int
    lost: int


def plain_prompt(messages: list[dict]) -> str:
    """A chat as plain text, for models without a chat template (tiny test checkpoints)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


class CommandWorker(QObject):
    """Runs the blocking EngineClient calls on its own thread."""

    helloReceived = Signal(object)
    submitted = Signal(str)  # request id
    submitFailed = Signal(str, str)  # request id, message
    reconfigured = Signal(object)  # ipc.messages.EngineSettings: the config now in force
    reconfigureRefused = Signal(str)
    commandFailed = Signal(str, str)  # command, message
    traceChanged = Signal(object)  # ipc.messages.TraceResult

    def __init__(self, mailbox: Mailbox) -> None:
        super().__init__()
        self.mailbox = mailbox
        self.client: EngineClient | None = None

    @Slot()
    def hello(self) -> None:
        for attempt in range(HELLO_ATTEMPTS):
            try:
                self.helloReceived.emit(self.client.hello(timeout=HELLO_TIMEOUT_S))
                return
            except EngineTimeout as exc:  # a busy machine: ask again
                if attempt == HELLO_ATTEMPTS - 1:
                    self.commandFailed.emit("hello", _message(exc))
            except Exception as exc:  # noqa: BLE001 - reported to the user
                self.commandFailed.emit("hello", _message(exc))
                return

    @Slot(str, object, object)
    def submit(self, request_id: str, prompt, sampling) -> None:
        try:
            try:
                self._submit(request_id, prompt, sampling)
            except EngineError as exc:
                if not (exc.code == "bad_request" and "chat template" in exc.message
                        and isinstance(prompt, list)):
                    raise
                self._submit(request_id, plain_prompt(prompt), sampling)
            self.submitted.emit(request_id)
        except Exception as exc:  # noqa: BLE001
            self.submitFailed.emit(request_id, _message(exc))

    def _submit(self, request_id, prompt, sampling) -> None:
        self.client.submit(prompt, sampling, request_id=request_id,
                           on_delta=self.mailbox.put_delta)

    @Slot(str)
    def abort(self, request_id: str) -> None:
        try:
            self.client.abort(request_id)
        except Exception as exc:  # noqa: BLE001
            self.commandFailed.emit("abort", _message(exc))

    @Slot(object)
    def reconfigure(self, change: SettingsChange) -> None:
        try:
            self.reconfigured.emit(self.client.reconfigure(change, timeout=120))
        except EngineError as exc:
            self.reconfigureRefused.emit(exc.message)
        except Exception as exc:  # noqa: BLE001
            self.reconfigureRefused.emit(_message(exc))

    @Slot(str, bool)
    def trace_start(self, path: str, include_prompts: bool) -> None:
        try:
            self.traceChanged.emit(self.client.trace_start(path, include_prompts))
        except Exception as exc:  # noqa: BLE001
            self.commandFailed.emit("trace_start", _message(exc))

    @Slot()
    def trace_stop(self) -> None:
        try:
            self.traceChanged.emit(self.client.trace_stop())
        except Exception as exc:  # noqa: BLE001
            self.commandFailed.emit("trace_stop", _message(exc))


def _lost(client) -> int:
    """Frames a client saw go missing (sequence gaps); a source without sequence numbers
    (a test double, another engine's adapter) cannot tell, and says 0."""
    return sum(getattr(client, "missed", {}).values()) if client is not None else 0


def death_kind(client) -> str:
    """EngineClient.death_kind; a source that does not record it (a test double, another
    engine's adapter) says "unreachable"."""
    return getattr(client, "death_kind", "unreachable")


DEATH_PREFIX = {"refused": "key refused", "stopped": "engine stopped answering",
                "unreachable": "engine unreachable"}


def death_message(client) -> str:
    """The client's own reason, led by what kind of failure it is."""
    reason = client.dead_reason or "the engine stopped"
    kind = death_kind(client)
    if kind == "refused":
        return f"{DEATH_PREFIX[kind]}: {reason}"
    if kind == "unreachable":
        where = getattr(client, "command_endpoint", "") or "its endpoint"
        hint = (" (with CURVE on, a wrong server key looks the same)"
                if getattr(client, "keys", None) is not None else "")
        return f"{DEATH_PREFIX[kind]}: nothing answered at {where}{hint}"
    return f"{DEATH_PREFIX[kind]}: {reason}"


def _message(exc: Exception) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__


class EngineBridge(QObject):
    """The GUI's one handle on an engine. Signals are facts; methods are commands.

    It never shuts an engine down: closing it only detaches. The window stops the engine
    child it started itself (EngineProcess.stop: SIGTERM, which `kvscope serve` handles
    as a clean shutdown), and an engine it attached to keeps serving its other clients."""

    stateReceived = Signal(str, object)  # topic, newest frame
    deltasReceived = Signal(list)  # ipc.messages.Delta, in arrival order
    helloReceived = Signal(object)
    engineDied = Signal(str)
    engineRevived = Signal()
    submitted = Signal(str)
    submitFailed = Signal(str, str)
    reconfigured = Signal(object)  # ipc.messages.EngineSettings
    reconfigureRefused = Signal(str)
    commandFailed = Signal(str, str)
    traceChanged = Signal(object)  # ipc.messages.TraceResult: recording or not, path, bytes

    _helloRequested = Signal()
    _submitRequested = Signal(str, object, object)
    _abortRequested = Signal(str)
    _reconfigureRequested = Signal(object)
    _traceStartRequested = Signal(str, bool)
    _traceStopRequested = Signal()

    def __init__(self, parent: QObject | None = None, *, heartbeat_timeout: float = 3.0,
                 client_factory=EngineClient) -> None:
        super().__init__(parent)
        self.heartbeat_timeout = heartbeat_timeout
        self.client_factory = client_factory
        self.client: EngineClient | None = None
        self.mailbox = Mailbox()
        self.frames_emitted = 0
        self.lost_before = 0  # frames lost by clients already detached
        self._dead = False
        self._thread = QThread()
        self._thread.setObjectName("kvscope-commands")
        self._worker = CommandWorker(self.mailbox)
        self._worker.moveToThread(self._thread)
        for name in ("helloReceived", "submitted", "submitFailed", "reconfigured",
                     "reconfigureRefused", "commandFailed", "traceChanged"):
            getattr(self._worker, name).connect(getattr(self, name))
        self._helloRequested.connect(self._worker.hello)
        self._submitRequested.connect(self._worker.submit)
        self._abortRequested.connect(self._worker.abort)
        self._reconfigureRequested.connect(self._worker.reconfigure)
        self._traceStartRequested.connect(self._worker.trace_start)
        self._traceStopRequested.connect(self._worker.trace_stop)
        self._thread.start()
        self._timer = QTimer(self)
        self._timer.setInterval(DRAIN_INTERVAL_MS)
        self._timer.timeout.connect(self.drain)

    @property
    def connected(self) -> bool:
        return self.client is not None

    @property
    def dead(self) -> bool:
        return self._dead

    # -- commands ---------------------------------------------------------------------------
    def attach(self, command_endpoint: str, state_endpoint: str | None = None,
               keys=None) -> None:
        """keys: ipc.keys.ClientKeys for an engine that requires CURVE; None: plain text."""
        self.detach()
        curve = {"keys": keys} if keys is not None else {}
        self.client = self.client_factory(command_endpoint, state_endpoint,
                                          heartbeat_timeout=self.heartbeat_timeout, **curve)
        self.client.subscribe(TOPICS, callback=self.mailbox.put_frame)
        self._worker.client = self.client
        self._dead = False
        self._timer.start()
        self._helloRequested.emit()

    def request_hello(self) -> None:
        """Ask the engine who it is again (after it came back: its settings may differ)."""
        if self.client is not None:
            self._helloRequested.emit()

    def submit(self, request_id: str, prompt, sampling: dict) -> None:
        if self.client is None:
            self.submitFailed.emit(request_id, "no engine is connected")
            return
        self._submitRequested.emit(request_id, prompt, sampling)

    def abort(self, request_id: str) -> None:
        if self.client is not None:
            self._abortRequested.emit(request_id)

    def reconfigure(self, change: SettingsChange) -> None:
        if self.client is None:
            self.reconfigureRefused.emit("no engine is connected")
            return
        self._reconfigureRequested.emit(change)

    def trace_start(self, path: str, include_prompts: bool = True) -> None:
        if self.client is None:
            self.commandFailed.emit("trace_start", "no engine is connected")
            return
        self._traceStartRequested.emit(path, include_prompts)

    def trace_stop(self) -> None:
        if self.client is None:
            self.commandFailed.emit("trace_stop", "no engine is connected")
            return
        self._traceStopRequested.emit()

    def set_drain_interval(self, ms: int) -> None:
        """Hand frames to the views this often (the window's frame rate)."""
        if ms != self._timer.interval():
            self._timer.setInterval(ms)

    def stream_counts(self) -> StreamCounts:
        received = self.mailbox.frames_in
        lost = self.lost_before + _lost(self.client)
        return StreamCounts(received, self.frames_emitted,
                            received - self.frames_emitted - self.mailbox.pending(), lost)

    def drain(self) -> None:
        """Emit the newest frame of each topic and the deltas since the last drain."""
        frames, deltas = self.mailbox.take()
        for topic, frame in frames.items():
            self.frames_emitted += 1
            self.stateReceived.emit(topic, frame)
        if deltas:
            self.deltasReceived.emit(deltas)
        if self.client is not None:
            dead = self.client.dead
            if dead and not self._dead:
                self._dead = True
                self.engineDied.emit(death_message(self.client))
            elif self._dead and not dead:
                self._dead = False
                self.engineRevived.emit()

    def detach(self) -> None:
        self._timer.stop()
        if self.client is not None:
            client, self.client = self.client, None
            self.lost_before += _lost(client)
            self._worker.client = None
            client.close()

    def close(self) -> None:
        """Stop the timer, the client thread and the worker thread (blocks briefly)."""
        self.detach()
        self._thread.quit()
        self._thread.wait(10_000)


class ChatRuns:
    """Chats with a polled source, each on its own Python thread. The threads only append
    Deltas and failures here; SourceBridge.drain hands them to the views on the GUI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.deltas: list = []
        self.failures: list[tuple[str, str]] = []
        self.aborted: set[str] = set()
        self.threads: list[threading.Thread] = []

    def start(self, source, request_id: str, messages: list, sampling: dict) -> None:
        thread = threading.Thread(target=self._run, args=(source, request_id, messages,
                                                          sampling),
                                  name=f"kvscope-chat-{request_id}", daemon=True)
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def _run(self, source, request_id: str, messages: list, sampling: dict) -> None:
        from kvscope.ipc.messages import Delta

        n = 0
        try:
            for piece in source.stream_chat(list(messages), dict(sampling)):
                if request_id in self.aborted:
                    break
                n += 1
                with self._lock:
                    self.deltas.append(Delta(request_id=request_id, token_ids=[], text=piece,
                                             num_output_tokens=n))
            reason = "abort" if request_id in self.aborted else "stop"
            with self._lock:
                self.deltas.append(Delta(request_id=request_id, token_ids=[], text="",
                                         finished=True, finish_reason=reason,
                                         num_output_tokens=n))
        except Exception as exc:  # noqa: BLE001 - a ChatError or a broken stream: shown
            with self._lock:
                self.failures.append((request_id, _message(exc)))

    def take(self) -> tuple[list, list[tuple[str, str]]]:
        with self._lock:
            deltas, self.deltas = self.deltas, []
            failures, self.failures = self.failures, []
        return deltas, failures

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


class SourceBridge(QObject):
    """The GUI's handle on a polled source (app.sources.source.PolledSource: vLLM,
    llama-server). Its worker threads post into the source's mailbox; a QTimer here takes the
    newest state on the GUI thread and emits it, so no thread but the GUI's touches Qt."""

    updated = Signal(object)  # app.sources.source.SourceUpdate
    deltasReceived = Signal(list)  # ipc.messages.Delta of chats sent through the source
    submitFailed = Signal(str, str)
    engineDied = Signal(str)
    engineRevived = Signal()

    def __init__(self, source, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.source = source
        self.chats = ChatRuns()
        self._dead: bool | None = None  # None: not heard from yet
        self._started = False
        self._timer = QTimer(self)
        self._timer.setInterval(DRAIN_INTERVAL_MS)
        self._timer.timeout.connect(self.drain)

    @property
    def dead(self) -> bool:
        return bool(self._dead)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.source.start()
        self._timer.start()

    def set_drain_interval(self, ms: int) -> None:
        if ms != self._timer.interval():
            self._timer.setInterval(ms)

    def submit(self, request_id: str, prompt, sampling: dict) -> None:
        if self._dead:
            self.submitFailed.emit(request_id, f"{self.source.kind} is unreachable")
            return
        self.chats.start(self.source, request_id, prompt, sampling)

    def abort(self, request_id: str) -> None:
        self.chats.aborted.add(request_id)

    def stream_counts(self):
        return self.source.counts()

    def drain(self) -> None:
        update = self.source.take()
        self.updated.emit(update)
        deltas, failures = self.chats.take()
        if deltas:
            self.deltasReceived.emit(deltas)
        for request_id, message in failures:
            self.submitFailed.emit(request_id, message)
        if update.error and self._dead is not True:
            self._dead = True
            self.engineDied.emit(update.error)
        elif update.scraped_ok and not update.error and self._dead is not False:
            was_dead, self._dead = self._dead, False
            if was_dead:
                self.engineRevived.emit()

    def close(self) -> None:
        self._timer.stop()
        self.source.stop()
        self.chats.join(2)
