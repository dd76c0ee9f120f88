"""EngineClient: talk to a `kvscope serve` engine from plain Python (a script, a test, a GUI
worker thread). No Qt, no torch.

One background thread owns both sockets (ZeroMQ sockets are not thread-safe); public methods
may be called from any thread: they queue the encoded command, wake that thread through a
socket pair and wait for the reply with a timeout. Token deltas and state frames are
dispatched by the same thread into per-request queues, callbacks and a newest-frame-per-topic
cache. Silence from the engine (no heartbeat or any other message for `heartbeat_timeout`
seconds) marks it dead: waiting calls and streams raise EngineDead instead of hanging; an
engine never heard from at all is "not authorized or not reachable" (wrong or missing CURVE
keys look exactly like no engine: a refused client gets nothing).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeAlias, TypeVar, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.curve import secure_client_socket
from kvscope.ipc.endpoints import is_ipv6, state_endpoint_for
from kvscope.ipc.keys import ClientKeys
from kvscope.ipc.prompts import ChatPrompt, PromptInput, TextPrompt, TokenPrompt
from kvscope.ipc.settings import SettingsChange

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # "any dataclass instance": engine.SamplingParams
    from typing_extensions import Self  # typing.Self is 3.11+

POLL_S = 0.1  # how often the I/O thread looks at the clock when nothing arrives
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class EngineError(Exception):
    """The engine answered a command with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class EngineDead(ConnectionError):
    """No heartbeat (or anything else) from the engine for too long."""


class EngineTimeout(TimeoutError):
    """No reply in time, although the engine still sends heartbeats."""


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    last: m.Delta | None = None  # carries the final timings


# What submit() takes: a typed prompt (ipc.prompts), text, chat messages ({"role", "content"}
# dicts) or token ids.
Prompt = PromptInput | str | Iterable[int] | Iterable[dict[str, str]]
# And its sampling: ipc.messages.Sampling, a map of its fields or a dataclass with them.
SamplingArg: TypeAlias = "m.Sampling | Mapping[str, object] | DataclassInstance | None"
# What public methods hand the client thread through the outbox.
_Op = (tuple[Literal["send"], bytes] | tuple[Literal["sub", "unsub"], str]
       | tuple[Literal["close"], None])
_R = TypeVar("_R")


@dataclass
class _Call(Generic[_R]):
    future: Future[_R]
    result_type: type[_R]
    on_ok: Callable[[_R], None] | None = None


@dataclass
class _Stream:
    deltas: queue.SimpleQueue[m.Delta | BaseException] = field(
        default_factory=queue.SimpleQueue)
    callback: Callable[[m.Delta], None] | None = None


class EngineClient:
    def __init__(self, command_endpoint: str, state_endpoint: str | None = None, *,
                 timeout: float = 10.0, heartbeat_timeout: float = 2.5,
                 on_dead: Callable[[str], None] | None = None,
                 keys: ClientKeys | None = None) -> None:
        """keys: CURVE keys for an engine that requires them (ipc.keys.load_client_keys, or
        ipc.keys.client_keys_for(endpoint)); None speaks plain text."""
        self.command_endpoint = command_endpoint
        self.keys = keys
        self.state_endpoint = state_endpoint or state_endpoint_for(command_endpoint)
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.on_dead = on_dead
        self.max_message_bytes = m.DEFAULT_MAX_MESSAGE_BYTES
        self.dropped_deltas = 0  # deltas for requests this client does not follow
        self.bad_messages = 0
        self.last_bad_message: str | None = None  # why the newest refused frame was refused
        self.missed: dict[str, int] = dict.fromkeys(m.TOPICS, 0)  # frames lost, by seq gaps
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._frames = threading.Condition(self._lock)
        self._calls: dict[int, _Call[Any]] = {}  # Any: each call has its own result type
        self._streams: dict[str, _Stream] = {}
        self._latest: dict[str, codec.StateFrame] = {}
        self._frame_callbacks: dict[str, list[Callable[[str, object], None]]] = {}
        self._outbox: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        # Commands the DEALER would not take yet: it has no pipe while a refused handshake
        # is retried, and a blocking send there would stall this thread (and the heartbeat
        # check that turns silence into EngineDead).
        self._unsent: collections.deque[bytes] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_fd = self._wake_r.fileno()  # zmq.Poller reports plain sockets by fd
        self._wake_w.setblocking(False)
        self._last_seen = time.monotonic()
        self._heard = False  # anything at all from the engine yet (else: refused or away)
        self._refusal: str | None = None  # why the last handshake failed, if one did
        self._dead_reason: str | None = None
        self._closed = False
        self._ctx = zmq.Context()
        self._dealer, self._sub = self._connect()
        self._thread = threading.Thread(target=self._run, name="kvscope-client", daemon=True)
        self._thread.start()

    def _connect(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        dealer = self._ctx.socket(zmq.DEALER)
        # A fixed routing id: after a reconnect the engine still knows whose streams are whose.
        dealer.setsockopt(zmq.ROUTING_ID, b"kvscope-" + uuid.uuid4().bytes)
        # Handshake failures tell "refused" from "away" for the error message.
        self._monitor = dealer.get_monitor_socket(HANDSHAKE_FAILED)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 64)  # this thread drains it: a short queue is enough
        sub.subscribe(b"heartbeat")  # always: it is how a dead engine is noticed
        for sock, endpoint in ((dealer, self.command_endpoint), (sub, self.state_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, int(is_ipv6(endpoint)))
            secure_client_socket(sock, self.keys)
            sock.connect(endpoint)
        return dealer, sub

    # -- liveness --------------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def death_kind(self) -> str:
        """Why the client gives up, from what it recorded: "refused" (a handshake failed:
        CURVE keys, or the key was refused), "stopped" (the engine was heard, then went
        silent) or "unreachable" (nothing ever answered and no handshake was refused)."""
        if self._refusal:
            return "refused"
        return "stopped" if self._heard else "unreachable"

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._dead_reason is not None:
            raise EngineDead(self._dead_reason)

    # -- commands --------------------------------------------------------------------------
    def hello(self, timeout: float | None = None) -> m.HelloResult:
        result = self._call(m.Hello(id=0, protocol=m.PROTOCOL_VERSION, client="EngineClient"),
                            m.HelloResult, timeout)
        self.max_message_bytes = result.max_message_bytes
        return result

    def submit(self, prompt: Prompt, sampling: SamplingArg = None, *,
               request_id: str | None = None,
               on_delta: Callable[[m.Delta], None] | None = None,
               timeout: float | None = None, priority: int | None = None) -> str:
        """prompt: text, chat messages ([{"role", "content"}, ...]), token ids or an
        ipc.prompts TextPrompt / ChatPrompt / TokenPrompt; an empty or malformed one raises
        ValueError here, before anything is sent. sampling: None, a dict,
        ipc.messages.Sampling or any dataclass with those fields (engine.SamplingParams).
        priority: overrides sampling's (lower = sooner; counts under
        scheduling_policy "priority"). Deltas go to `on_delta` (called on the client thread:
        keep it short) or else are kept for `stream(request_id)`."""
        fields = _sampling(sampling)
        if priority is not None:
            fields = msgspec.structs.replace(fields, priority=priority)
        cmd = m.Submit.of(_typed_prompt(prompt), fields, request_id)
        opened = self._call(cmd, m.SubmitResult, timeout,
                            on_ok=lambda r: self._open_stream(r.request_id, on_delta))
        return opened.request_id

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[m.Delta]:
        """The request's deltas until the finished one. timeout: longest wait for the next
        delta (None: as long as the engine is alive)."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None or stream.callback is not None:
            raise KeyError(f"{request_id!r} was not submitted by this client for streaming")
        while True:
            delta = self._next_delta(stream, timeout)
            yield delta
            if delta.finished:
                with self._lock:
                    self._streams.pop(request_id, None)
                return

    def _next_delta(self, stream: _Stream, timeout: float | None) -> m.Delta:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = stream.deltas.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineTimeout(f"no delta for {timeout} s") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def generate(self, prompt: Prompt, sampling: SamplingArg = None,
                 timeout: float | None = None, priority: int | None = None) -> Completion:
        """Submit and collect the whole reply."""
        rid = self.submit(prompt, sampling, timeout=timeout, priority=priority)
        out = Completion(rid)
        for d in self.stream(rid, timeout=timeout):
            out.text += d.text
            out.token_ids += d.token_ids
            out.finish_reason, out.last = d.finish_reason, d
        return out

    def abort(self, request_id: str, timeout: float | None = None) -> m.AbortResult:
        return self._call(m.Abort(id=0, request_id=request_id), m.AbortResult, timeout)

    def reconfigure(self, change: SettingsChange | None = None, *,
                    timeout: float | None = None, **options: object) -> m.EngineSettings:
        """Change engine settings while it runs: an ipc.settings.SettingsChange, or its
        fields as keywords (`reconfigure(block_size=8)`), not both. Returns the configuration
        now in force. An unknown name or a bad value raises ValueError naming it before
        anything is sent; a change the engine cannot make raises EngineError("refused",
        reason), and the old configuration stays."""
        if change is not None and options:
            raise ValueError("give a SettingsChange or keyword options, not both")
        if change is None:
            change = SettingsChange.from_options(options)
        result = self._call(m.Reconfigure(id=0, changes=change), m.ReconfigureResult,
                            timeout)
        return result.config

    def snapshot(self, timeout: float | None = None) -> m.SnapshotResult:
        return self._call(m.Snapshot(id=0), m.SnapshotResult, timeout)

    def shutdown(self, timeout: float | None = None) -> m.ShutdownResult:
        return self._call(m.Shutdown(id=0), m.ShutdownResult, timeout)

    def trace_start(self, path: str, include_prompts: bool = True,
                    timeout: float | None = None) -> m.TraceResult:
        """Record the session to a new trace file; EngineError("refused") if it can't."""
        return self._call(m.TraceStart(id=0, path=path, include_prompts=include_prompts),
                          m.TraceResult, timeout)

    def trace_stop(self, timeout: float | None = None) -> m.TraceResult:
        return self._call(m.TraceStop(id=0), m.TraceResult, timeout)

    def _call(self, cmd: m.Command, result_type: type[_R], timeout: float | None,
              on_ok: Callable[[_R], None] | None = None) -> _R:
        self._check_alive()
        cmd.id = next(self._ids)
        payload = codec.encode(cmd)
        if len(payload) > self.max_message_bytes:
            raise ValueError(f"message of {len(payload)} bytes exceeds the engine's limit of "
                             f"{self.max_message_bytes}")
        call: _Call[_R] = _Call(Future(), result_type, on_ok)
        with self._lock:
            self._calls[cmd.id] = call
        self._post(("send", payload))
        try:
            return call.future.result(self.timeout if timeout is None else timeout)
        except FutureTimeout:
            self._check_alive()
            raise EngineTimeout(f"no reply to {type(cmd).__name__.lower()} in "
                                f"{self.timeout if timeout is None else timeout} s") from None
        finally:
            with self._lock:
                self._calls.pop(cmd.id, None)

    def _open_stream(self, request_id: str, callback: Callable[[m.Delta], None] | None
                     ) -> None:
        with self._lock:
            self._streams[request_id] = _Stream(callback=callback)

    # -- state stream ----------------------------------------------------------------------
    def subscribe(self, topics: Iterable[str] = m.TOPICS,
                  callback: Callable[[str, object], None] | None = None) -> None:
        """Receive these state topics; the newest frame of each is kept (`latest`), and
        `callback(topic, frame)` runs on the client thread for each frame."""
        for topic in _topics(topics):
            if callback is not None:
                with self._lock:
                    self._frame_callbacks.setdefault(topic, []).append(callback)
            self._post(("sub", topic))

    def unsubscribe(self, topics: Iterable[str]) -> None:
        for topic in _topics(topics):
            if topic != "heartbeat":
                self._post(("unsub", topic))

    def latest(self, topic: str) -> codec.StateFrame | None:
        with self._lock:
            return self._latest.get(topic)

    def wait_frame(self, topic: str, timeout: float | None = None,
                   predicate: Callable[[object], bool] | None = None) -> codec.StateFrame:
        """The first frame of topic newer than the one held now that satisfies predicate."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._frames:
            seen = self._latest.get(topic)
            while True:
                frame = self._latest.get(topic)
                # (not None: a topic's newest frame is only ever replaced by a newer one)
                if frame is not None and frame is not seen \
                        and (predicate is None or predicate(frame)):
                    return frame
                seen = frame
                left = deadline - time.monotonic()
                if left <= 0:
                    self._check_alive()
                    raise EngineTimeout(f"no {topic} frame in time")
                self._frames.wait(min(left, POLL_S))
                if self._dead_reason is not None:
                    raise EngineDead(self._dead_reason)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._post(("close", None))
        self._thread.join(5)
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, op: _Op) -> None:
        self._outbox.put(op)
        # The pipe is full of wake-ups already, or closing.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"!")

    # -- the client thread -----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while self._serve_once(poller):
                pass
        finally:
            self._dealer.disable_monitor()
            self._monitor.close()
            self._dealer.close()
            self._sub.close()
            self._fail_all(RuntimeError("the client is closed"))

    def _serve_once(self, poller: zmq.Poller) -> bool:
        events = dict(poller.poll(round(POLL_S * 1000)))
        self._send_unsent()
        if self._wake_fd in events and not self._drain_outbox():
            return False
        if self._dealer in events:
            self._drain(self._dealer, self._on_reply)
        if self._sub in events:
            self._drain(self._sub, self._on_state)
        if self._monitor in events:
            self._read_handshake_failures()
        self._check_heartbeat()
        return True

    def _drain_outbox(self) -> bool:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                op = self._outbox.get_nowait()
            except queue.Empty:
                return True
            # op[0], not an unpacked name: mypy narrows op[1] by comparing op[0] only
            if op[0] == "close":
                return False
            if op[0] == "send":
                self._unsent.append(op[1])
                self._send_unsent()
            elif op[0] == "sub":
                self._sub.subscribe(op[1].encode())
            elif op[0] == "unsub":
                self._sub.unsubscribe(op[1].encode())

    def _drain(self, sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None]) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._seen()
            try:
                handle(frames)
            except Exception:  # noqa: BLE001 - a bad frame or callback must not stop us
                self.bad_messages += 1
                traceback.print_exc(file=sys.stderr)

    def _seen(self) -> None:
        self._last_seen = time.monotonic()
        self._heard = True
        if self._dead_reason is not None:
            self._dead_reason = None  # it was only stalled; calls already failed stay failed

    def _on_reply(self, frames: list[bytes]) -> None:
        msg = codec.decode_reply(frames[-1])
        if isinstance(msg, m.Deltas):
            for d in msg.items:
                self._on_delta(d)
            return
        with self._lock:
            call = self._calls.get(msg.id) if msg.id is not None else None
        if call is None:
            self.bad_messages += 1  # the caller gave up, or an error about garbage
        elif isinstance(msg, m.Error):
            call.future.set_exception(EngineError(msg.code, msg.message))
        else:
            self._resolve(call, msg)

    @staticmethod
    def _resolve(call: _Call[Any], msg: m.Ok) -> None:
        try:
            result = codec.decode_result(msg.result, call.result_type)
            if call.on_ok is not None:
                call.on_ok(result)  # before any delta of a new request is read
        except msgspec.MsgspecError as exc:
            call.future.set_exception(EngineError(m.INVALID, f"bad result: {exc}"))
            return
        call.future.set_result(result)

    def _on_delta(self, delta: m.Delta) -> None:
        with self._lock:
            stream = self._streams.get(delta.request_id)
            if stream is not None and delta.finished and stream.callback is not None:
                del self._streams[delta.request_id]
        if stream is None:
            self.dropped_deltas += 1
        elif stream.callback is not None:
            stream.callback(delta)
        else:
            stream.deltas.put(delta)

    def _on_state(self, frames: list[bytes]) -> None:
        topic = frames[0].decode(errors="replace")
        try:
            frame = codec.decode_state(topic, frames[1])
        except codec.BadMessage as exc:
            self._refuse_frame(exc.message)
            return
        with self._frames:
            old = self._latest.get(topic)
            if old is not None and frame.seq > old.seq + 1:
                self.missed[topic] += frame.seq - old.seq - 1
            self._latest[topic] = frame
            callbacks = list(self._frame_callbacks.get(topic, ()))
            self._frames.notify_all()
        for cb in callbacks:
            cb(topic, frame)

    def _refuse_frame(self, why: str) -> None:
        """A state frame that is not what its topic says: counted, never shown to a view.
        Said once on stderr per reason (an engine of another build sends it ~30 times a s)."""
        self.bad_messages += 1
        if why != self.last_bad_message:
            print(f"kvscope: refused a state frame: {why}", file=sys.stderr)
        self.last_bad_message = why

    def _check_heartbeat(self) -> None:
        silent = time.monotonic() - self._last_seen
        if self._dead_reason is None and silent > self.heartbeat_timeout:
            self._dead_reason = (f"no heartbeat from the engine at {self.state_endpoint} "
                                 f"for {silent:.1f} s" if self._heard else
                                 self._never_answered(silent))
            self._fail_all(EngineDead(self._dead_reason))
            if self.on_dead is not None:
                self.on_dead(self._dead_reason)

    def _read_handshake_failures(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            why = self._why_refused(event["event"], event["value"])
            if self._refusal is None or event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._refusal = why  # a vaguer retry never hides the specific reason

    def _why_refused(self, event: int, value: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return ("it refused this client's public key (on the engine's machine: "
                    "`kvscope keys allow client.key`)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return ("it requires CURVE keys (attach with --keys DIR or --auth curve)"
                    if self.keys is None else "it speaks plain text, not CURVE")
        return ("the handshake failed: is the engine's public key the right one "
                "(`kvscope keys trust HOST server.key`)?" if self.keys is not None
                else "the handshake failed: does it require CURVE keys (attach with --keys "
                     "DIR or --auth curve)?")

    def _never_answered(self, silent: float) -> str:
        how = "with CURVE keys" if self.keys is not None else "in plain text (no keys)"
        why = self._refusal or ("is it running, and does it allow this client's key "
                                "(`kvscope keys allow`)?")
        return (f"not authorized or not reachable: nothing from the engine at "
                f"{self.command_endpoint} in {silent:.1f} s, connecting {how}: {why}")

    def _send_unsent(self) -> None:
        while self._unsent:
            try:
                self._dealer.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unsent.popleft()

    def _fail_all(self, exc: Exception) -> None:
        self._unsent.clear()  # their calls fail now: never run them later
        with self._frames:
            calls, self._calls = list(self._calls.values()), {}
            streams = list(self._streams.values())
            self._frames.notify_all()
        for call in calls:
            if not call.future.done():
                call.future.set_exception(exc)
        for stream in streams:
            if stream.callback is None:
                stream.deltas.put(exc)


def _typed_prompt(prompt: Prompt) -> PromptInput:
    """submit()'s prompt as ipc.prompts builds and checks it (ValueError when it is bad)."""
    if isinstance(prompt, (TextPrompt, ChatPrompt, TokenPrompt)):
        return prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    items: list[object] = list(prompt)
    if items and all(isinstance(x, dict) for x in items):
        chat = cast("list[dict[str, Any]]", items)  # every item is a dict: just checked
        return ChatPrompt([_chat_message(x) for x in chat])
    # Ids at or past the vocabulary's end only the engine can tell.
    return TokenPrompt(cast("list[int]", items))


def _chat_message(message: dict[str, Any]) -> m.ChatMessage:
    # A missing or odd role or content is built as it is (a Struct checks nothing when
    # built) for ChatPrompt to refuse by its index.
    return m.ChatMessage(message.get("role"), message.get("content"))  # type: ignore[arg-type]


def _sampling(sampling: SamplingArg) -> m.Sampling:
    if sampling is None:
        return m.Sampling()
    if isinstance(sampling, m.Sampling):
        return sampling
    if dataclasses.is_dataclass(sampling) and not isinstance(sampling, type):
        return msgspec.convert(dataclasses.asdict(sampling), m.Sampling)
    # A map is all SamplingArg leaves (mypy keeps a dataclass class, which the protocol also
    # matches: dict() refuses that one, as before).
    fields = cast("Mapping[str, object]", sampling)
    return msgspec.convert(dict(fields), m.Sampling)


def _topics(topics: Iterable[str]) -> list[str]:
    topics = [topics] if isinstance(topics, str) else list(topics)
    unknown = [t for t in topics if t not in m.TOPIC_TYPES]
    if unknown:
        raise ValueError(f"unknown topics {unknown}: expected some of {list(m.TOPICS)}")
    return topics
