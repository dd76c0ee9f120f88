"""The hand-off between the HTTP server's event loop and the engine thread.

An HTTP request enters the engine exactly as a ZeroMQ command does: a `(who, Submit)` pair on
the engine server's command queue, taken between steps. `who` is here an `HttpClient` instead
of a ZeroMQ routing id, and the engine server hands its replies and token deltas to
`HttpClient.deliver`, which moves them onto the event loop with `call_soon_threadsafe` (the
engine thread never waits on the HTTP side). So HTTP requests share the scheduler, the state
stream, the traces and /metrics with every other request, marked with the source "http".
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from ipc import codec
from ipc import messages as m

REPLY_POLL_S = 1.0  # how often a waiting request checks that the engine is still there

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


class HttpClient:
    """One HTTP request's mailbox: the `who` the engine server replies to."""

    source = "http"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.inbox: asyncio.Queue = asyncio.Queue()

    def deliver(self, reply) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, reply)
        except RuntimeError:  # the loop is closed: the HTTP server stopped first
            pass


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

    async def deltas(self) -> AsyncIterator[m.Delta]:
        while self.live:
            reply = await self.bridge.next_reply(self.client)
            if not isinstance(reply, m.Deltas):
                continue  # e.g. the reply to our own abort
            for d in reply.items:
                self.num_output_tokens = d.num_output_tokens
                if d.finished:
                    self.finish_reason = d.finish_reason or "stop"
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

    def call_id(self) -> int:
        return next(self._ids)

    @property
    def unavailable(self) -> bool:
        s = self.server
        return self.closing or s.stopping or s.done.is_set()

    def put(self, client: HttpClient, cmd) -> None:
        self.server.commands.put((client, cmd))

    async def submit(self, **fields) -> EngineStream:
        """Queue a Submit (prompt / messages / token_ids, sampling, request_id); raises
        EngineRefused with the engine's reason, or EngineUnavailable."""
        if self.unavailable:
            raise EngineUnavailable("the engine is shutting down")
        client = HttpClient(asyncio.get_running_loop())
        self.put(client, m.Submit(id=self.call_id(), **fields))
        reply = await self.next_reply(client)
        if isinstance(reply, m.Error):
            if reply.code == m.SHUTTING_DOWN:
                raise EngineUnavailable(reply.message)
            raise EngineRefused(reply.code, reply.message)
        result = codec.decode_result(reply.result, m.SubmitResult)
        return EngineStream(self, client, result.request_id, result.num_prompt_tokens)

    async def next_reply(self, client: HttpClient):
        """The engine's next message for client; EngineUnavailable once the engine thread
        has ended without answering (it answers everything queued before it stops)."""
        while True:
            try:
                return await asyncio.wait_for(client.inbox.get(), REPLY_POLL_S)
            except asyncio.TimeoutError:
                if self.server.done.is_set() and client.inbox.empty():
                    raise EngineUnavailable("the engine stopped") from None
