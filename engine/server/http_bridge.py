"""The hand-off between the HTTP server's event loop and the engine thread.

An HTTP request enters the engine exactly as a ZeroMQ command does: a `(who, Submit)` pair on
the engine server's command queue, taken between steps. `who` is here an `HttpClient` instead
of a ZeroMQ routing id, and the engine server hands its replies and token deltas to
`HttpClient.deliver`, which moves them onto the event loop with `call_soon_threadsafe` (the
engine thread never waits on the HTTP side). So HTTP requests share the scheduler, the state
stream, the traces and /metrics with every other request, marked with the source "http".

Cost matters here: with 32 streams a small model makes hundreds of deltas per step, so the
engine thread wakes the loop once for all of them (`LoopPost`), a waiting request awaits a
plain queue (no timer per message: a watchdog notices a vanished engine), and a stream takes
whatever piled up at once (`EngineStream.batches`).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator

from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.prompts import PromptInput

WATCH_S = 1.0  # how often the watchdog checks that the engine thread is still there
_GONE = object()  # put in an inbox when the engine thread ended without answering

# Engine error codes -> HTTP status.
STATUS = {m.BAD_REQUEST: 400, m.INVALID: 400, m.OVERLOADED: 429, m.SHUTTING_DOWN: 503}


class EngineUnavailable(Exception):
    """The engine is shutting down (or has stopped): the request cannot be served."""


class EngineRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 500)


class LoopPost:
    """Carries messages from the engine thread onto one event loop: one wake-up of the loop
    (a write to its self-pipe) for everything posted before it got round to them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, object]] = []

    def post(self, inbox: asyncio.Queue, message) -> None:
        with self.lock:
            self.pending.append((inbox, message))
            if len(self.pending) > 1:
                return  # a flush is already on its way
        # RuntimeError: the loop is closed, the HTTP server stopped first.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for inbox, message in items:
            inbox.put_nowait(message)


class HttpClient:
    """One HTTP request's mailbox: the `who` the engine server replies to."""

    source = "http"

    def __init__(self, post: LoopPost) -> None:
        self.post = post
        self.inbox: asyncio.Queue = asyncio.Queue()

    def deliver(self, reply) -> None:
        """Called on the engine thread."""
        self.post.post(self.inbox, reply)


class EngineStream:
    """A submitted request's deltas, as they come; `abort()` ends it in the engine."""

    def __init__(self, bridge: EngineBridge, client: HttpClient, request_id: str,
                 num_prompt_tokens: int) -> None:
        self.bridge, self.client = bridge, client
        self.request_id, self.num_prompt_tokens = request_id, num_prompt_tokens
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    @property
    def live(self) -> bool:
        return self.finish_reason is None

    async def batches(self) -> AsyncIterator[list[m.Delta]]:
        """The deltas that arrived since the last batch (at least one), until it ends."""
        inbox = self.client.inbox
        try:
            while self.live:
                replies = [await self.bridge.next_reply(self.client)]
                while not inbox.empty():
                    replies.append(inbox.get_nowait())
                batch = [d for r in replies if isinstance(r, m.Deltas) for d in r.items]
                if any(r is _GONE for r in replies):
                    raise EngineUnavailable("the engine stopped")
                for d in batch:
                    self.num_output_tokens = d.num_output_tokens
                    if d.finished:
                        self.finish_reason = d.finish_reason or "stop"
                if batch:
                    yield batch
        finally:
            if self.live:
                self.abort()
            self.bridge.live.discard(self.client)

    async def deltas(self) -> AsyncIterator[m.Delta]:
        async for batch in self.batches():
            for d in batch:
                yield d

    def abort(self) -> None:
        """Safe from any thread and any state: a finished request is left alone."""
        if self.live:
            self.finish_reason = "abort"
            self.bridge.put(self.client, m.Abort(id=self.bridge.call_id(),
                                                 request_id=self.request_id))


class EngineBridge:
    """Submits HTTP requests to an engine server (engine_server.EngineServer)."""

    def __init__(self, server) -> None:
        self.server = server
        self.closing = False
        self._ids = itertools.count(1)
        self.live: set[HttpClient] = set()  # waiting on the engine: woken if it vanishes
        self._post: LoopPost | None = None
        self._watchdog: asyncio.Task | None = None

    def call_id(self) -> int:
        return next(self._ids)

    @property
    def unavailable(self) -> bool:
        s = self.server
        return self.closing or s.stopping or s.done.is_set()

    def put(self, client: HttpClient, cmd) -> None:
        self.server.enqueue(client, cmd)

    async def submit(self, prompt: PromptInput, sampling: m.Sampling,
                     request_id: str | None = None) -> EngineStream:
        """Queue a Submit of a prompt checked already (ipc.prompts); raises EngineRefused with
        the engine's reason, or EngineUnavailable."""
        if self.unavailable:
            raise EngineUnavailable("the engine is shutting down")
        client = HttpClient(self._loop_post())
        self.live.add(client)
        self.put(client, m.Submit.of(prompt, sampling, request_id, self.call_id()))
        try:
            reply = await self.next_reply(client)
        except BaseException:
            self.live.discard(client)
            raise
        if isinstance(reply, m.Error):
            self.live.discard(client)
            if reply.code == m.SHUTTING_DOWN:
                raise EngineUnavailable(reply.message)
            raise EngineRefused(reply.code, reply.message)
        result = codec.decode_result(reply.result, m.SubmitResult)
        return EngineStream(self, client, result.request_id, result.num_prompt_tokens)

    async def next_reply(self, client: HttpClient):
        """The engine's next message for client; EngineUnavailable once the engine thread
        has ended without answering (it answers everything queued before it stops)."""
        reply = await client.inbox.get()
        if reply is _GONE:
            raise EngineUnavailable("the engine stopped")
        return reply

    def _loop_post(self) -> LoopPost:
        if self._post is None:  # the first request: we are on the HTTP server's loop now
            self._post = LoopPost(asyncio.get_running_loop())
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self._post

    async def _watch(self) -> None:
        while not self.server.done.is_set():
            await asyncio.sleep(WATCH_S)
        await asyncio.sleep(WATCH_S)  # its last replies are on the way through LoopPost
        for client in list(self.live):
            client.inbox.put_nowait(_GONE)
