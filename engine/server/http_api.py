"""The OpenAI-compatible HTTP API (Starlette): /v1/models, /v1/chat/completions,
/v1/completions, /health, /version and, when the engine keeps Prometheus metrics, /metrics.

Runs on the HTTP server's event loop (http_server.py), never on the engine thread: requests
reach the engine through http_bridge.py like any ZeroMQ command. Chat prompts go through the
engine's own chat template path (engine.chat_template), so greedy replies equal `LLM.chat`'s.
A client that hangs up aborts its request at once, and its KV blocks come back.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import kvscope.engine as engine_pkg
from kvscope.engine.server import openai_schema as oa
from kvscope.engine.server.http_bridge import (
    EngineBridge,
    EngineRefused,
    EngineStream,
    EngineUnavailable,
)
from kvscope.engine.server.http_metrics import CountRequests, metrics_route, request_counter
from kvscope.ipc.messages import Sampling
from kvscope.ipc.prompts import ChatPrompt, PromptInput

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ApiSettings:
    model_name: str  # what /v1/models lists and `model` must name
    model_aliases: frozenset[str]  # other names accepted in `model` (the path given, ...)
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class _Json(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return msgspec.json.encode(content)


def error_response(err: oa.ApiError) -> Response:
    return JSONResponse(err.body(), status_code=err.status)


class OpenAIApi:
    def __init__(self, bridge: EngineBridge, settings: ApiSettings) -> None:
        self.bridge, self.settings = bridge, settings
        self.created = int(time.time())

    # -- plumbing ------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # Constant time: a timing difference must not tell how much of a guess was right.
        if not (scheme.lower() == "bearer"
                and hmac.compare_digest(token.strip().encode(), key.encode())):
            raise oa.ApiError(401, "invalid or missing API key: send 'Authorization: Bearer "
                              "<key>'", None, "invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise oa.ApiError(413, f"the body is larger than {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise oa.ApiError(413, f"the body is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, model: str | None) -> str:
        s = self.settings
        if model is not None and model != s.model_name and model not in s.model_aliases:
            raise oa.ApiError(404, f"the model {model!r} does not exist; this server has "
                                   f"{s.model_name!r}", "model", "model_not_found")
        return s.model_name

    async def submit(self, request_id: str, sampling: Sampling,
                     prompt: PromptInput) -> EngineStream:
        try:
            return await self.bridge.submit(prompt, sampling, request_id)
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        except EngineRefused as exc:
            param = "messages" if isinstance(prompt, ChatPrompt) else "prompt"
            raise oa.ApiError(exc.status, exc.message, param if exc.status == 400 else None,
                              exc.code) from None

    # -- routes --------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self.check_key(request)
        s = self.settings
        return _Json(oa.ModelList([oa.Model(s.model_name, self.created, s.max_model_len)]))

    async def health(self, request: Request) -> Response:
        if self.bridge.unavailable:
            return error_response(unavailable("the engine is shutting down"))
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return _Json({"version": engine_pkg.__version__})

    async def chat(self, request: Request) -> Response:
        self.check_key(request)
        req = oa.decode_request(await self.read_body(request), oa.ChatRequest)
        model = self.check_model(req.model)
        oa.check_unsupported(req)
        sampling = oa.sampling_of(req, self.settings.max_model_len)
        prompt = oa.chat_prompt(req)
        rid = "chatcmpl-" + uuid.uuid4().hex
        stream = await self.submit(rid, sampling, prompt)
        reply = ChatReply(rid, int(time.time()), model)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return SseResponse(stream, reply.chunks(stream, usage))
        text = await until_hang_up(request, stream, collect_text(stream))
        return _Json(reply.whole(stream, text)) if text is not None else Response()

    async def completions(self, request: Request) -> Response:
        self.check_key(request)
        req = oa.decode_request(await self.read_body(request), oa.CompletionRequest)
        model = self.check_model(req.model)
        oa.check_unsupported(req)
        sampling = oa.sampling_of(req, self.settings.max_model_len)
        prompt = oa.completion_prompt(req)
        rid = "cmpl-" + uuid.uuid4().hex
        stream = await self.submit(rid, sampling, prompt)
        reply = CompletionReply(rid, int(time.time()), model)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return SseResponse(stream, reply.chunks(stream, usage))
        text = await until_hang_up(request, stream, collect_text(stream))
        return _Json(reply.whole(stream, text)) if text is not None else Response()


def unavailable(message: str) -> oa.ApiError:
    return oa.ApiError(503, message, None, "shutting_down", "service_unavailable")


def ended_early(stream: EngineStream) -> oa.ApiError:
    """The engine ended the request without finishing it (shutdown, a failed step)."""
    if stream.finish_reason == "abort":
        return unavailable("the request was aborted: the engine is shutting down")
    return oa.ApiError(500, f"the engine failed while running the request "
                            f"({stream.finish_reason})", None, "engine_error", "server_error")


FINISHED = ("stop", "length")


async def collect_text(stream: EngineStream) -> str:
    parts = [d.text async for d in stream.deltas()]
    if stream.finish_reason not in FINISHED:
        raise ended_early(stream)
    return "".join(parts)


async def until_hang_up(request: Request, stream: EngineStream, work):
    """work's result, or None when the client hung up first (the request is then aborted)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _worth_sending(batch):
    """(delta, OpenAI finish reason) of the deltas a client needs to see: those with text,
    and the last one (an abort or error is reported separately)."""
    for d in batch:
        reason = d.finish_reason if d.finished and d.finish_reason in FINISHED else None
        if d.text or reason:
            yield d, reason


async def sse_body(stream: EngineStream, token_event, usage_event,
                   include_usage: bool) -> AsyncIterator[bytes]:
    """A stream's events: whatever piled up since the last write goes out in one write, and
    the ending (the usage chunk, or an error event, and [DONE]) goes with the last tokens, so
    a client learns at once that it may send its next request."""
    payload, batches = b"", stream.batches()
    try:
        async for batch in batches:
            payload = b"".join(sse(token_event(d, reason))
                               for d, reason in _worth_sending(batch))
            if not stream.live:
                break
            if payload:
                yield payload
                payload = b""
    except EngineUnavailable:  # the engine vanished without ending the request
        stream.finish_reason = "abort"
    finally:
        await batches.aclose()
    if stream.finish_reason not in FINISHED:
        payload += sse(ended_early(stream).body())
    elif include_usage:
        payload += sse(usage_event(oa.usage(stream.num_prompt_tokens,
                                            stream.num_output_tokens)))
    yield payload + DONE


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class SseResponse(StreamingResponse):
    """Server-sent events whose request is aborted however the response ends (a hang-up
    before the first chunk included)."""

    def __init__(self, stream: EngineStream, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()  # a no-op once it finished


@dataclass
class ChatReply:
    id: str
    created: int
    model: str

    def whole(self, stream: EngineStream, text: str) -> oa.ChatCompletion:
        return oa.ChatCompletion(
            self.id, self.created, self.model,
            [oa.ChatChoice(0, oa.AssistantMessage(text), stream.finish_reason)],
            oa.usage(stream.num_prompt_tokens, stream.num_output_tokens))

    def chunk(self, delta: oa.ChunkDelta, reason: str | None = None) -> oa.ChatChunk:
        return oa.ChatChunk(self.id, self.created, self.model,
                            [oa.ChatChunkChoice(0, delta, reason)])

    async def chunks(self, stream: EngineStream, include_usage: bool) -> AsyncIterator[bytes]:
        yield sse(self.chunk(oa.ChunkDelta(role="assistant", content="")))
        async for payload in sse_body(
                stream,
                lambda d, reason: self.chunk(oa.ChunkDelta(content=d.text or None), reason),
                lambda u: oa.ChatChunk(self.id, self.created, self.model, [], u),
                include_usage):
            yield payload


@dataclass
class CompletionReply:
    id: str
    created: int
    model: str

    def whole(self, stream: EngineStream, text: str) -> oa.Completion:
        return oa.Completion(self.id, self.created, self.model,
                             [oa.CompletionChoice(0, text, stream.finish_reason)],
                             oa.usage(stream.num_prompt_tokens, stream.num_output_tokens))

    def chunks(self, stream: EngineStream, include_usage: bool) -> AsyncIterator[bytes]:
        return sse_body(
            stream,
            lambda d, reason: oa.Completion(self.id, self.created, self.model,
                                            [oa.CompletionChoice(0, d.text, reason)], None),
            lambda u: oa.Completion(self.id, self.created, self.model, [], u),
            include_usage)


def _guarded(handler):
    """OpenAI-shaped errors for everything a route raises."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except oa.ApiError as err:
            return error_response(err)
        except Exception as exc:  # noqa: BLE001 - a bug answers this request, nothing else
            traceback.print_exc()
            return error_response(oa.ApiError(500, f"internal error: {type(exc).__name__}: "
                                              f"{exc}", None, "internal", "server_error"))
    return endpoint


async def _no_route(request: Request, exc) -> Response:
    code = getattr(exc, "status_code", 404)
    what = "no such endpoint" if code == 404 else "method not allowed for"
    return error_response(oa.ApiError(code, f"{what} {request.method} {request.url.path}",
                                      None, "not_found" if code == 404 else "bad_method"))


def build_app(bridge: EngineBridge, settings: ApiSettings, registry=None,
              scraped=None) -> Starlette:
    """The ASGI app; `registry` (a prometheus CollectorRegistry) counts requests into
    http_requests_total and adds /metrics, which serves `scraped` (default: registry)."""
    api = OpenAIApi(bridge, settings)
    routes = [
        Route("/v1/models", _guarded(api.models), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(api.chat), methods=["POST"]),
        Route("/v1/completions", _guarded(api.completions), methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/version", api.version, methods=["GET"]),
    ]
    if registry is not None:
        routes.append(metrics_route(scraped or registry))
    app = Starlette(routes=routes, exception_handlers={404: _no_route, 405: _no_route})
    if registry is not None:
        app.add_middleware(CountRequests, counter=request_counter(registry),
                           endpoints=frozenset(r.path for r in routes))
    return app
