"""`kvscope serve`'s ZeroMQ side: a command ROUTER, a state PUB, and the step loop.

Two threads, so a slow or hostile client never stalls a step:

* the I/O thread (io_thread.py) owns every socket. It decodes and validates commands
  (garbage is answered or dropped right there, the engine never sees it), queues good ones
  for the engine thread, forwards what it produced, tracks subscriptions, sends heartbeats.
* the engine thread owns the LLMEngine. Between steps it takes queued commands, runs a step,
  routes the token deltas to their submitters and builds the state frames of subscribed
  topics, each at most `state_hz` times a second and within a CPU budget. It hands frames to
  the I/O thread over an inproc PAIR with no high-water mark, so it never waits on a socket.
"""
from __future__ import annotations

import os
import queue
import statistics
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import msgspec
import zmq

import kvscope.engine as engine_pkg
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server import snapshots
from kvscope.engine.server.io_thread import HEARTBEAT_S, WAKE, ClientGone, IOThread
from kvscope.engine.server.metrics import EngineMetrics, FinishedRequest
from kvscope.engine.server.metrics_feed import DEVICE_INTERVAL, MetricsFeed
from kvscope.engine.server.trace_paths import default_trace_dir, prepare_trace_dir, trace_path_under
from kvscope.engine.traces.recorder import start_trace
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.curve import ServerAuth

MAX_STATE_BACKLOG = 4  # state frames not yet forwarded before the engine skips a round
MAX_COMMANDS_PER_STEP = 256
RECENT_FINISHED = 4096  # ids remembered so a late abort is "already finished", not unknown


class CommandError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


_STOP = object()
STATE_TOPICS = ("step", "blocks", "stats", "device")  # built by the engine thread
PUBLISH_BUDGET = 0.01  # share of the engine thread each state topic may take at most
STATS_INTERVAL = 0.1  # rates and percentiles move slowly: 10 Hz is plenty


TOPIC_INTERVAL = {"stats": STATS_INTERVAL, "device": DEVICE_INTERVAL}  # others: 1/state_hz


COST_SAMPLES = 8  # frame build costs remembered per topic


@dataclass
class _Published:
    at: float = float("-inf")  # monotonic time of the last frame
    version: int = 0  # state version it showed
    gap: float = 0.0  # least time to the next one
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))

    def spaced_after(self, cost: float, interval: float) -> None:
        """Set the gap to the next frame from this frame's build cost (engine-thread CPU
        seconds): the median of the last few costs, none until three are known. One slow
        build (the first warms caches; a busy machine preempts the thread) must not leave
        the map dark for seconds while a short reply runs; a pool that is costly to show
        every time still gets fewer frames."""
        self.costs.append(cost)
        typical = statistics.median(self.costs) if len(self.costs) >= 3 else 0.0
        self.gap = max(interval, typical / PUBLISH_BUDGET)


class EngineServer:
    def __init__(self, engine, command_endpoint: str, state_endpoint: str, *,
                 max_message_bytes: int = m.DEFAULT_MAX_MESSAGE_BYTES, state_hz: float = 30.0,
                 max_pending_requests: int = 4096, metrics: EngineMetrics | None = None,
                 metrics_url: str | None = None, kv_events=None,
                 auth: ServerAuth | None = None, trace_dir: Path | None = None) -> None:
        """auth: CURVE keys for every socket (None: plain text). trace_dir: where trace
        commands may write (None: the user's data folder)."""
        self.engine = engine
        self.kv_events = kv_events  # a kv_events.CacheEventFeed, flushed after each step
        self.auth, self.trace_dir = auth, trace_dir
        self.prometheus, self.metrics_url = metrics, metrics_url
        self.http_url: str | None = None  # the OpenAI API's base URL, once it is served
        self.feed = MetricsFeed(engine, metrics)
        self.max_message_bytes = max_message_bytes
        self.state_interval = 1.0 / state_hz
        self.max_pending_requests = max_pending_requests
        self.ctx = zmq.Context()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.io = IOThread(self, command_endpoint, state_endpoint)
        self.endpoints = self.io.endpoints
        self.out = self.ctx.socket(zmq.PAIR)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(self.io.inproc)
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0}
        self.owners: dict[str, bytes] = {}
        self.streamed: dict[str, int] = {}  # output tokens streamed per live request
        self.first_scheduled: dict[str, float] = {}
        self.recent: OrderedDict[str, str] = OrderedDict()  # finished id -> reason
        self.steplog = snapshots.StepLog()
        self.metrics = snapshots.Metrics()
        self.topic_seq = dict.fromkeys(m.TOPICS, 0)
        self.state_sent = 0
        self.publish_s = 0.0  # engine-thread time spent building state frames
        # State versions: bumped on every change; a topic is stale when its frame is older.
        self.version = 1
        self.published = {t: _Published() for t in STATE_TOPICS}
        self.stopping = self.failed = False
        self.thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)
        self.done = threading.Event()

    # -- lifecycle (main thread) -----------------------------------------------------------
    def start(self, engine_thread: bool = True) -> tuple[str, str]:
        """Serve: the I/O thread starts, and the step loop in its own thread, or, with
        engine_thread=False, in the caller's when it calls run().

        Step the engine from the thread that built it (`kvscope serve` does, by running the
        loop on its main thread): every thread that runs torch or kvscope kernels becomes an
        OpenMP master with its own pool, and once libgomp manages more threads than there
        are cores it stops its threads spinning between parallel regions (its throttled
        spin count, 100 rounds), so each of a step's hundreds of regions pays a futex
        wake-up. Built on the main thread and stepped on another, one chat decoded at half
        the speed on 2 cores (docs/threads.md)."""
        # /metrics gets the engine's state before anyone is told the server is up, so a
        # scrape right after `ready` already sees every family (the engine thread is not
        # running yet: no race on the engine).
        self.feed.refresh(self.version)
        self.io.start()
        if engine_thread:
            self.thread.start()
        return self.endpoints

    def run(self) -> None:
        """The step loop in the calling thread, until request_stop() (start(False) first)."""
        self._run()

    def enqueue(self, who, cmd) -> None:
        """Queue a client's command for the engine thread (any thread). A request of higher
        priority than the step now running may cut that step short (engine.model.step_interrupt)."""
        self.commands.put((who, cmd))
        # Queued first: a step armed after this offer was read takes the request in before
        # it schedules, so a late offer can never cut short the step that carries it.
        if isinstance(cmd, m.Submit):
            self.engine.interrupt.offer(cmd.sampling.priority)

    def request_stop(self) -> None:
        """Safe from a signal handler: the engine thread aborts in-flight requests and exits."""
        self.commands.put(_STOP)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def close(self) -> None:
        self.request_stop()
        if self.thread.is_alive():
            self.thread.join(10)
        self.io.join(10)
        if not (self.thread.is_alive() or self.io.is_alive()):
            if self.auth is not None:
                self.auth.release(self.ctx)  # its thread holds sockets of ctx too
            self.ctx.term()  # (a wedged thread still holds sockets: term would hang)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopping:
                self._take_commands(block=not self.engine.has_unfinished())
                if self.stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
                if self.kv_events is not None:
                    self.kv_events.flush()
                self._maybe_publish()
                self.feed.refresh(self.version)
            self._abort_all()
            self._refuse_queued()
        except BaseException:  # noqa: BLE001 - report, then stop cleanly below
            self.failed = True
            traceback.print_exc()
        finally:
            self.out.send(b"S")
            self.out.close(linger=1000)
            self.io.join(5)
            self.done.set()

    def _take_commands(self, block: bool) -> None:
        timeout = None
        if block:
            timeout = max(0.001, min(HEARTBEAT_S, self._next_publish() - time.monotonic()))
        for _ in range(MAX_COMMANDS_PER_STEP):
            try:
                item = self.commands.get(timeout=timeout) if timeout else \
                    self.commands.get_nowait()
            except queue.Empty:
                return
            timeout = None
            self._dispatch(item)
            if self.stopping:
                return

    def _dispatch(self, item) -> None:
        if item is _STOP:
            self.stopping = True
        elif item is WAKE:
            self.version += 1  # a new subscriber: give it the full state now
        elif isinstance(item, ClientGone):
            for rid in [r for r, who in self.owners.items() if who == item.identity]:
                self.engine.abort_request(rid)
                self._forget(rid, "abort")
        else:
            self._command(*item)

    def _step(self) -> None:
        engine = self.engine
        start = time.monotonic()
        try:
            result = engine.step()
        except Exception:  # noqa: BLE001 - a failing step must not take the server down
            traceback.print_exc()
            self._abort_all(reason="error")
            return
        if result.ran:
            self.steplog.record(engine, result.scheduled, self.streamed,
                                time.monotonic() - start)
            if self.prometheus is not None:
                self.prometheus.on_step(sum(s.num_tokens for s in result.scheduled))
            for s in result.scheduled:
                self.first_scheduled.setdefault(s.seq.request_id, start)
        self._route(result.outputs)
        self.version += 1

    # -- deltas ----------------------------------------------------------------------------
    def _route(self, deltas) -> None:
        now = time.monotonic()
        by_client: dict[bytes, list[m.Delta]] = {}
        for d in deltas:
            seq = self.engine.requests.get(d.request_id)
            who = self.owners.get(d.request_id)
            if seq is None or who is None:
                continue
            if d.token_ids:
                latency = self.metrics.on_tokens(seq, now)
                if latency is not None and self.prometheus is not None:
                    self.prometheus.on_latency(*latency, seq.params.priority)
                self.streamed[d.request_id] = self.streamed.get(d.request_id, 0) + \
                    len(d.token_ids)
            by_client.setdefault(who, []).append(self._delta(seq, d.token_ids, d.text,
                                                             d.finish_reason if d.finished
                                                             else None))
            if d.finished:
                self.engine.pop_output(d.request_id)
                self._forget(d.request_id, d.finish_reason or "stop", seq)
        for who, items in by_client.items():
            self._send(who, m.Deltas(items))

    def _delta(self, seq, token_ids, text, reason) -> m.Delta:
        first = self.first_scheduled.get(seq.request_id)
        return m.Delta(
            request_id=seq.request_id, token_ids=list(token_ids), text=text,
            finished=reason is not None, finish_reason=reason,
            queued_s=None if first is None else first - seq.arrival_time,
            ttft_s=None if seq.first_token_time is None
            else seq.first_token_time - seq.arrival_time,
            num_output_tokens=seq.num_output_tokens, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
            num_host_cached_tokens=seq.num_host_cached_tokens,
            num_disk_cached_tokens=seq.num_disk_cached_tokens,
            **self.engine.spec.delta_fields(seq))

    def _forget(self, rid: str, reason: str, seq=None) -> None:
        """rid ended (finished, aborted, its client gone): drop what the server kept on it."""
        seq = seq if seq is not None else self.engine.requests.get(rid)
        first = self.first_scheduled.pop(rid, None)
        if self.prometheus is not None and seq is not None and rid in self.owners:
            self.prometheus.on_finished(reason, FinishedRequest(
                seq.arrival_time, first, seq.first_token_time, time.monotonic(),
                seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens,
                seq.params.priority))
        self.owners.pop(rid, None)
        self.streamed.pop(rid, None)
        self.metrics.forget(rid)
        if seq is not None and seq.is_finished and rid in self.engine.requests:
            self.engine.pop_output(rid)  # the engine keeps finished requests until popped
        self.recent[rid] = reason
        if len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)
        self.counters["aborted" if reason == "abort" else "finished"] += 1

    def _abort_all(self, reason: str = "abort") -> list[str]:
        """Finish every live request, telling its submitter (shutdown, or a failed step)."""
        aborted = []
        for rid, who in list(self.owners.items()):
            seq = self.engine.requests.get(rid)
            if seq is not None and not seq.is_finished:
                self.engine.scheduler.finish(seq, reason)
            if seq is not None:
                self._send(who, m.Deltas([self._delta(seq, [], "", reason)]))
            self._forget(rid, reason)
            aborted.append(rid)
        return aborted

    def _refuse_queued(self) -> None:
        while True:
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                who, cmd = item
                self._send(who, m.Error(cmd.id, m.SHUTTING_DOWN, "the engine is shutting down"))

    # -- commands --------------------------------------------------------------------------
    def _command(self, who: bytes, cmd) -> None:
        try:
            result = self.HANDLERS[type(cmd)](self, who, cmd)
            reply = m.Ok(cmd.id, msgspec.Raw(codec.encode(result)))
        except CommandError as exc:
            reply = m.Error(cmd.id, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug answers this call, nothing else
            traceback.print_exc()
            reply = m.Error(cmd.id, m.INTERNAL, f"{type(exc).__name__}: {exc}")
        if isinstance(reply, m.Error):
            self.counters["errors"] += 1
        self._send(who, reply)
        self.version += 1

    def _cmd_hello(self, who, cmd: m.Hello) -> m.HelloResult:
        if cmd.protocol != m.PROTOCOL_VERSION:
            raise CommandError(m.VERSION_MISMATCH, f"the engine speaks protocol "
                               f"{m.PROTOCOL_VERSION}, the client {cmd.protocol}")
        e = self.engine
        return m.HelloResult(m.PROTOCOL_VERSION, engine_pkg.__version__, e.config.model,
                             os.getpid(), snapshots.engine_settings(e), e.max_model_len,
                             self.max_message_bytes, self.metrics_url, self.http_url,
                             str(self.trace_dir or default_trace_dir()))

    def _cmd_submit(self, who, cmd: m.Submit) -> m.SubmitResult:
        if len(self.owners) >= self.max_pending_requests:
            raise CommandError(m.OVERLOADED, f"{len(self.owners)} requests in flight, the "
                               f"limit is {self.max_pending_requests}; retry later")
        try:
            params = SamplingParams(**msgspec.structs.asdict(cmd.sampling))
            # Its shape was checked when it was decoded or built (ipc.prompts): here only what
            # the model can tell (vocabulary, chat template, length) can still be refused.
            rid = self.engine.add_request(cmd.typed_prompt(), params, cmd.request_id)
        except ValueError as exc:
            raise CommandError(m.BAD_REQUEST, str(exc)) from None
        self.owners[rid] = who
        self.recent.pop(rid, None)  # a reused id is a new request
        self.counters["requests"] += 1
        return m.SubmitResult(rid, self.engine.requests[rid].num_prompt_tokens)

    def _cmd_abort(self, who, cmd: m.Abort) -> m.AbortResult:
        rid = cmd.request_id
        if rid not in self.owners and rid in self.recent:
            return m.AbortResult(False, self.recent[rid])
        if rid not in self.owners or not self.engine.abort_request(rid):
            raise CommandError(m.UNKNOWN_REQUEST, f"no request {rid!r} is in flight")
        owner = self.owners[rid]
        self._send(owner, m.Deltas([self._delta(self.engine.requests[rid], [], "", "abort")]))
        self._forget(rid, "abort")
        return m.AbortResult(True, "abort")

    def _cmd_reconfigure(self, who, cmd: m.Reconfigure) -> m.ReconfigureResult:
        # cmd.changes' names and values were checked when it was decoded (ipc.settings).
        try:
            self.engine.reconfigure(cmd.changes)
        except (ValueError, TypeError) as exc:
            raise CommandError(m.REFUSED, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the old pool is back
            raise CommandError(m.REFUSED, f"{type(exc).__name__}: {exc}") from None
        return m.ReconfigureResult(snapshots.engine_settings(self.engine))  # config in force

    def _cmd_snapshot(self, who, cmd: m.Snapshot) -> m.SnapshotResult:
        return m.SnapshotResult(self.steplog.frame(self.engine, self.topic_seq["step"],
                                                    consume=False),
                                snapshots.blocks_frame(
                                    self.engine, self.topic_seq["blocks"], self.sources(),
                                    self.steplog.take_preemptions(consume=False)),
                                self._stats(self.topic_seq["stats"]))

    def _cmd_shutdown(self, who, cmd: m.Shutdown) -> m.ShutdownResult:
        self.stopping = True
        return m.ShutdownResult(self._abort_all())

    def _cmd_trace_start(self, who, cmd: m.TraceStart) -> m.TraceResult:
        try:
            path = trace_path_under(prepare_trace_dir(self.trace_dir), cmd.path)
        except (ValueError, OSError) as exc:
            raise CommandError(m.REFUSED, str(exc)) from None
        if path.exists():
            raise CommandError(m.REFUSED, f"{cmd.path} exists; a trace starts a new file")
        try:
            trace = start_trace(self.engine, path, cmd.include_prompts)
        except OSError as exc:
            raise CommandError(m.REFUSED, f"cannot record to {cmd.path}: {exc}") from None
        return m.TraceResult(True, str(trace.path), path.stat().st_size)

    def _cmd_trace_stop(self, who, cmd: m.TraceStop) -> m.TraceResult:
        trace = self.engine.trace
        self.engine.stop_trace()
        if trace is None:
            return m.TraceResult(False)
        size = trace.path.stat().st_size if trace.path.exists() else 0
        return m.TraceResult(False, str(trace.path), size)

    # Each command type of ipc.messages.Command and the method that answers it.
    HANDLERS: ClassVar[dict[type, Callable]] = {
        m.Hello: _cmd_hello, m.Submit: _cmd_submit, m.Abort: _cmd_abort,
        m.Reconfigure: _cmd_reconfigure, m.Snapshot: _cmd_snapshot, m.Shutdown: _cmd_shutdown,
        m.TraceStart: _cmd_trace_start, m.TraceStop: _cmd_trace_stop}

    # -- state -----------------------------------------------------------------------------
    def _maybe_publish(self) -> None:
        """Publish each subscribed topic that is stale and due. A topic is due when both
        1/state_hz and cost/PUBLISH_BUDGET have passed since its last frame, so building
        frames never takes more than that share of the engine thread (a 32k-block pool gets
        fewer blocks frames rather than slower steps). Idle topics repeat every second."""
        if self.state_sent - self.io.state_forwarded > MAX_STATE_BACKLOG:
            return  # the I/O thread is behind: skip a round rather than queue
        now = time.monotonic()
        for topic, pub in self.published.items():
            if now < self._due(pub) or not self.io.wanted(topic):
                continue
            started = time.thread_time()  # CPU time: waits for the GIL or a core are not cost
            frame = self._build(topic, self.topic_seq[topic] + 1)
            if frame is None:
                continue
            payload = codec.encode(frame)
            cost = time.thread_time() - started
            self.publish_s += cost
            self.topic_seq[topic] += 1
            self.state_sent += 1
            self.out.send_multipart([b"P", topic.encode(), payload], copy=False)
            pub.at, pub.version = now, self.version
            pub.spaced_after(cost, TOPIC_INTERVAL.get(topic, self.state_interval))

    def _due(self, pub: _Published) -> float:
        return pub.at + (pub.gap if pub.version < self.version else max(pub.gap, HEARTBEAT_S))

    def _next_publish(self) -> float:
        return min(self._due(p) for t, p in self.published.items() if self.io.wanted(t)) \
            if any(self.io.wanted(t) for t in self.published) else time.monotonic() + HEARTBEAT_S

    def _build(self, topic: str, seq: int):
        if topic == "step":
            return self.steplog.frame(self.engine, seq)
        if topic == "blocks":
            return snapshots.blocks_frame(self.engine, seq, self.sources(),
                                          self.steplog.take_preemptions())
        if topic == "device":
            return msgspec.structs.replace(self.feed.device(), seq=seq)
        return self._stats(seq)

    def _stats(self, seq: int) -> m.StatsFrame:
        return self.metrics.frame(self.engine, seq, self.server_counters())

    def server_counters(self) -> m.ServerCounters:
        c = self.counters
        return m.ServerCounters(
            requests=c["requests"], finished=c["finished"], aborted=c["aborted"],
            errors=c["errors"], bad_frames=self.io.bad_frames, dropped_replies=self.io.dropped,
            http_in_flight=len(self.sources()), publish_s=self.publish_s,
            kv_events=self.kv_events.counters() if self.kv_events is not None else None)

    def _send(self, who, reply) -> None:
        if not isinstance(who, bytes):  # an in-process client (the HTTP API): no socket
            who.deliver(reply)
            return
        self.out.send_multipart([b"R", who, codec.encode(reply)], copy=False)

    def sources(self) -> dict[str, str]:
        """Live requests that did not come over ZeroMQ, by their source ("http")."""
        return {rid: who.source for rid, who in self.owners.items()
                if not isinstance(who, bytes)}
