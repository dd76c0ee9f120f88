"""Replay a trace's arrivals against any OpenAI-compatible server (vLLM, SGLang, llama-server,
Ollama's /v1, kvscope serve), streamed, and record the run as a trace of its own.

Each request goes out at its recorded time (scaled by 1/speed; as soon as a slot is free when
speed is None), at most max_concurrency at once. The new trace holds, per request, its
Arrival (the send), a Chunk per streamed piece (when it arrived), a Response (status, TTFT,
E2E, finish reason, usage or chunk counts, the error if any) and a Finish or Abort. Lines are
written as requests end, so an interrupted run keeps every request it saw end, and the ones
still in flight are written as "interrupted". Every HTTP failure is a request's error, never
the run's: 4xx/5xx, a dropped connection, a malformed stream, a request past its timeout.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvscope.engine import __version__
from kvscope.engine.traces.openai_stream import (
    API_PATHS,
    ChunkError,
    ChunkInfo,
    error_of_body,
    expected_tokens,
    read_chunk,
    request_body,
)
from kvscope.engine.traces.reproduced_outputs import OutputCheck
from kvscope.engine.traces.requests import RequestRecord, run_of_trace
from kvscope.engine.traces.server_probe import api_base, choose_model, probe
from kvscope.engine.traces.sse import SseError, SseParser
from kvscope.engine.traces.summary import TraceSummary, summarize
from kvscope.engine.traces.text import TextTokenizer, try_text_tokenizer
from kvscope.engine.traces.workload import (
    WorkItem,
    is_mooncake,
    read_kvscope,
    read_mooncake,
    synthesise_prompts,
)
from kvscope.ipc.trace_format import (
    SCHEMA_VERSION,
    Abort,
    Arrival,
    Chunk,
    Event,
    Finish,
    Header,
    Response,
    ServerInfo,
    Trace,
    TraceWriter,
    read_trace,
)

MAX_ERROR_BODY = 64 * 1024
# Connection failures before any byte came back: an idle keep-alive connection the server
# closed (llama-server does), or one refused while it restarts. Retried once.
RETRYABLE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)


@dataclass
class HttpReplayConfig:
    url: str
    api_key: str | None = None
    model: str | None = None
    speed: float | None = 1.0  # None: as fast as max_concurrency allows
    max_concurrency: int = 16
    api: str = "completions"  # or "chat"
    ignore_eos: bool = False
    timeout_s: float = 600.0  # the whole run
    request_timeout_s: float = 300.0  # one request, send to last byte
    connect_timeout_s: float = 10.0
    include_prompts: bool = True
    prompt_seed: int = 0
    hash_block_size: int = 512
    vocab_size: int | None = None
    tokenizer: str | None = None  # a kvscope model spec; default: the trace's model

    def check(self) -> None:
        if self.speed is not None and not self.speed > 0:
            raise ValueError(f"speed {self.speed} must be positive (or None: as fast as allowed)")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be at least 1")
        if not self.timeout_s > 0 or not self.request_timeout_s > 0:
            raise ValueError("--timeout-s and --request-timeout-s must be positive")
        if self.api not in API_PATHS:
            raise ValueError(f"api {self.api!r} must be one of {sorted(API_PATHS)}")


class Progress(msgspec.Struct):
    done: int
    total: int
    errors: int
    in_flight: int


class HttpReplayResult(msgspec.Struct):
    summary: TraceSummary
    trace: str
    url: str
    model: str
    errors: dict[str, str]  # request id -> what went wrong
    ended_early: list[str]  # finished before the output length asked for
    stopped: str | None  # "interrupted" or "timeout" when the run did not finish
    outputs: OutputCheck

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON `kvscope trace replay --url --json` prints (the window reads it)."""
        return {**self.summary.as_dict(), "trace": self.trace, "url": self.url,
                "served_model": self.model, "request_errors": self.errors,
                "ended_early": len(self.ended_early), "ended_early_ids": self.ended_early,
                "stopped": self.stopped, **self.outputs.as_dict()}


@dataclass
class _Live:
    """One request on its way: what came back so far."""
    item: WorkItem
    body: dict[str, Any]
    sent: float = 0.0
    status: int = 0
    attempts: int = 0
    answered: bool = False  # a status line came back (no retry after that)
    chunks: list[tuple[float, str]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False  # [DONE] seen
    error: str | None = None

    def take(self, info: ChunkInfo, now: float) -> None:
        if info.text:
            self.chunks.append((now, info.text))
        self.finish_reason = info.finish_reason or self.finish_reason
        if info.completion_tokens is not None:
            self.prompt_tokens, self.completion_tokens = info.prompt_tokens, info.completion_tokens
        if info.error and self.error is None:
            self.error = f"error event in the stream: {info.error}"


class _Run:
    def __init__(self, cfg: HttpReplayConfig, base: str, model: str, writer: TraceWriter,
                 anchor: float, progress: Callable[[Progress], None] | None) -> None:
        self.cfg, self.base, self.model, self.writer = cfg, base, model, writer
        self.anchor, self.progress = anchor, progress
        self.stop_reason = "interrupted"
        self.total = self.done = self.failed = self.in_flight = 0
        self.errors: dict[str, str] = {}
        self.ended_early: list[str] = []
        self.texts: dict[str, str] = {}
        self.stopped: str | None = None

    # -- one request ------------------------------------------------------------------------
    async def one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, live: _Live,
                  start: float) -> None:
        speed = self.cfg.speed
        if speed is not None:
            await asyncio.sleep(max(0.0, start + live.item.t / speed - time.monotonic()))
        async with sem:
            live.sent = time.monotonic()
            self.in_flight += 1
            self._write([self._arrival(live)])
            try:
                async with asyncio.timeout(self.cfg.request_timeout_s):
                    await self._attempts(client, live)
            except TimeoutError:
                live.error = (f"no end within the request timeout "
                              f"({self.cfg.request_timeout_s:g} s)")
            except asyncio.CancelledError:
                live.error = live.error or self.stop_reason
                self._end(live)
                raise
            self._end(live)

    async def _attempts(self, client: httpx.AsyncClient, live: _Live) -> None:
        for attempt in (1, 2):
            live.attempts = attempt
            try:
                await self._exchange(client, live)
                return
            except RETRYABLE as exc:
                if attempt == 1 and not live.answered:
                    continue
                live.error = _connection_error(exc, live)
                return
            except httpx.TimeoutException as exc:
                live.error = f"timed out ({type(exc).__name__}) after {len(live.chunks)} chunks"
                return
            except httpx.HTTPError as exc:
                live.error = f"{type(exc).__name__}: {exc}"
                return
            except Exception as exc:  # a server's bytes must never end the run
                live.error = f"unexpected {type(exc).__name__}: {exc}"
                return

    async def _exchange(self, client: httpx.AsyncClient, live: _Live) -> None:
        url = self.base + API_PATHS[self.cfg.api]
        async with client.stream("POST", url, json=live.body) as resp:
            live.answered, live.status = True, resp.status_code
            ctype = resp.headers.get("content-type", "")
            if resp.status_code != 200:
                body = await _read_capped(resp)
                live.error = f"HTTP {resp.status_code}: {error_of_body(body)}"
                return
            if "text/event-stream" not in ctype:
                body = await _read_capped(resp)
                live.error = (f"expected an event stream (text/event-stream), got "
                              f"{ctype or 'no content type'}: {body[:120]!r}")
                return
            await self._read_stream(resp, live)

    async def _read_stream(self, resp: httpx.Response, live: _Live) -> None:
        parser = SseParser()
        try:
            async for raw in resp.aiter_bytes():
                now = time.monotonic()
                for data in parser.feed(raw):
                    if data.strip() == "[DONE]":
                        live.done = True
                    else:
                        live.take(read_chunk(data), now)
        except (SseError, ChunkError) as exc:
            live.error = f"malformed stream after {len(live.chunks)} chunks: {exc}"
            return
        if not live.done and live.finish_reason is None and live.error is None:
            live.error = (f"the stream ended after {len(live.chunks)} chunks without a "
                          f"finish_reason or [DONE]")

    # -- recording --------------------------------------------------------------------------
    def _t(self, when: float) -> float:
        return when - self.anchor

    def _arrival(self, live: _Live) -> Arrival:
        item, body = live.item, live.body
        sampling = {k: v for k, v in body.items()
                    if k not in ("model", "prompt", "messages", "stream", "stream_options")}
        return Arrival(t=self._t(live.sent), id=item.request_id, prompt_len=item.prompt_len,
                       sampling=sampling,
                       prompt=list(item.prompt or []) if self.cfg.include_prompts else None)

    def _end(self, live: _Live) -> None:
        end = time.monotonic()
        rid = live.item.request_id
        lines: list[Event] = [Chunk(t=self._t(t), id=rid, text=text) for t, text in live.chunks]
        counted = live.completion_tokens is None
        tokens = len(live.chunks) if counted else live.completion_tokens
        lines.append(Response(
            t=self._t(end), id=rid, status=live.status, e2e=end - live.sent,
            ttft=live.chunks[0][0] - live.sent if live.chunks else None,
            finish_reason=live.finish_reason, prompt_tokens=live.prompt_tokens,
            completion_tokens=tokens, usage_from="chunks" if counted else "server",
            error=live.error, attempts=live.attempts))
        if live.error is None:
            lines.append(Finish(t=self._t(end), id=rid, reason=live.finish_reason or ""))
            self.texts[rid] = "".join(text for _, text in live.chunks)
            if (tokens or 0) < expected_tokens(live.item):  # fewer than recorded
                self.ended_early.append(rid)
        else:
            lines.append(Abort(t=self._t(end), id=rid))
            self.errors[rid] = live.error
            self.failed += 1
        self._write(lines)
        self.done += 1
        self.in_flight -= 1
        if self.progress is not None:
            self.progress(Progress(self.done, self.total, self.failed, self.in_flight))

    def _write(self, lines: list[Event]) -> None:
        if not self.writer.closed:
            self.writer.write(lines)

    # -- the run ----------------------------------------------------------------------------
    async def run(self, client: httpx.AsyncClient, lives: list[_Live]) -> str | None:
        """Every request, within the run's timeout; the reason it stopped early, else None."""
        self.total = len(lives)
        sem = asyncio.Semaphore(self.cfg.max_concurrency)
        start = time.monotonic()
        tasks = [asyncio.create_task(self.one(client, sem, live, start)) for live in lives]
        stopped = None
        try:
            _, pending = await asyncio.wait(tasks, timeout=self.cfg.timeout_s) if tasks \
                else (set(), set())
            if pending:
                stopped = "timeout"
                self.stop_reason = f"the run's timeout ({self.cfg.timeout_s:g} s) ran out"
        except asyncio.CancelledError:
            stopped = "interrupted"
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return stopped


def _connection_error(exc: Exception, live: _Live) -> str:
    where = (f"mid-stream, after {len(live.chunks)} chunks" if live.answered
             else f"before any answer ({live.attempts} attempts)")
    return f"connection lost {where}: {type(exc).__name__}: {exc}"


async def _read_capped(resp: httpx.Response) -> bytes:
    body = b""
    async for raw in resp.aiter_bytes():
        body += raw
        if len(body) >= MAX_ERROR_BODY:
            break
    return body[:MAX_ERROR_BODY]


# -- entry points ----------------------------------------------------------------------------
def load_items(source: str | os.PathLike[str]) -> tuple[list[WorkItem], Trace | None]:
    if is_mooncake(source):
        return read_mooncake(source), None
    trace = read_trace(source)
    return read_kvscope(trace), trace


def _header(cfg: HttpReplayConfig, base: str, model: str, answers: Any, anchor: float,
            wall: float) -> Header:
    settings = {"speed": cfg.speed, "max_concurrency": cfg.max_concurrency, "api": cfg.api,
                "ignore_eos": cfg.ignore_eos, "timeout_s": cfg.timeout_s,
                "request_timeout_s": cfg.request_timeout_s}
    return Header(schema_version=SCHEMA_VERSION, kvscope_version=__version__, model=model,
                  device="external", dtype="external", kv_dtype="external", block_size=0,
                  num_kv_blocks=0, config=settings, wall_time=wall, monotonic=anchor,
                  include_prompts=cfg.include_prompts,
                  server=ServerInfo(url=base, api=cfg.api, model=model, models=answers.models,
                                    version=answers.version))


def _prepare(items: list[WorkItem], recorded: Trace | None, cfg: HttpReplayConfig
             ) -> tuple[TextTokenizer | None, str | None]:
    """Prompts for items without one; the tokenizer (or why there is none)."""
    spec = cfg.tokenizer or (recorded.header.model if recorded is not None else None)
    tok, why = try_text_tokenizer(spec)
    if any(w.prompt is None for w in items):
        vocab = cfg.vocab_size or (tok.vocab_size if tok else None)
        if vocab is None:
            raise ValueError(f"the trace has no prompts to send and {why}: give --tokenizer "
                             f"or --vocab-size so prompts can be synthesised")
        synthesise_prompts(items, vocab, cfg.prompt_seed, cfg.hash_block_size)
    if cfg.api == "chat" and tok is None:
        raise ValueError(f"--chat sends prompts as text, and there is {why}")
    return tok, why


def _bodies(items: list[WorkItem], cfg: HttpReplayConfig, model: str,
            tok: TextTokenizer | None) -> list[_Live]:
    return [_Live(item=w, body=request_body(
        w, model, cfg.api, cfg.ignore_eos,
        tok.decode(list(w.prompt or [])) if cfg.api == "chat" and tok else None))
        for w in items]


async def replay_http(items: list[WorkItem], cfg: HttpReplayConfig, out_path: str,
                      tok: TextTokenizer | None = None,
                      progress: Callable[[Progress], None] | None = None,
                      started: Callable[[_Run], None] | None = None) -> _Run:
    """started: called with the run once the trace file is open (so an interrupted caller
    still has its record of what ended)."""
    base = api_base(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency,
                          max_keepalive_connections=cfg.max_concurrency)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
    # Proxy settings from the environment only for non-loopback servers: a local server is
    # never behind the user's proxy.
    local = httpx.URL(base).host in ("127.0.0.1", "localhost", "::1")
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits,
                                 trust_env=not local) as client:
        answers = await probe(client, base)
        model = choose_model(answers, cfg.model)
        lives = _bodies(items, cfg, model, tok)
        anchor = time.monotonic()
        writer = TraceWriter(out_path, _header(cfg, base, model, answers, anchor, time.time()))
        run = _Run(cfg, base, model, writer, anchor, progress)
        if started is not None:
            started(run)
        try:
            run.stopped = await run.run(client, lives)
        except asyncio.CancelledError:
            run.stopped = "interrupted"
            raise
        finally:
            writer.close()
    return run


def check_texts(items: list[WorkItem], recorded: Trace | None, texts: dict[str, str],
                tok: TextTokenizer | None, why_no_tok: str | None) -> OutputCheck:
    """Whether every greedy request that finished in both runs streamed the recorded text: the
    recorded token ids decoded, or what a recorded external run streamed."""
    if recorded is None:
        return OutputCheck(identical=None, not_compared="the input is a workload trace "
                                                        "without outputs")
    if any(float(w.sampling.get("temperature", 0.0) or 0.0) != 0 for w in items):
        return OutputCheck(identical=None, not_compared="not every request used greedy sampling")
    old = run_of_trace(recorded, "recorded").requests
    if tok is None and any(r.text is None for r in old.values()):
        return OutputCheck(identical=None, not_compared=why_no_tok)
    both = [rid for rid, r in old.items() if r.ok and rid in texts]
    differing = sorted(rid for rid in both if texts[rid] != _text(old[rid], tok))
    return OutputCheck(identical=not differing, compared=len(both), differing=differing)


def _text(r: RequestRecord, tok: TextTokenizer | None) -> str:
    if r.text is not None:
        return r.text
    return tok.decode(r.token_ids or []) if tok is not None else ""


def replay_url_file(source: str | os.PathLike[str], out_path: str | os.PathLike[str],
                    cfg: HttpReplayConfig,
                    progress: Callable[[Progress], None] | None = None) -> HttpReplayResult:
    """Replay the trace or workload at `source` against cfg.url, recording to out_path.
    Ctrl-C ends the run early: what was recorded is kept and summarised (stopped says so)."""
    cfg.check()
    if Path(out_path).resolve() == Path(source).resolve():
        raise ValueError("the output must not be the input trace")
    items, recorded = load_items(source)
    tok, why = _prepare(items, recorded, cfg)
    holder: dict[str, _Run] = {}

    async def main() -> None:
        await replay_http(items, cfg, str(out_path), tok, progress,
                          started=lambda r: holder.__setitem__("run", r))

    stopped = None
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        stopped = "interrupted"
    run = holder.get("run")
    if run is None and stopped:  # interrupted before the trace was opened
        raise KeyboardInterrupt
    new = read_trace(out_path)
    assert run is not None  # replay_http returned, so it started one
    return HttpReplayResult(
        summary=summarize(new), trace=str(out_path), url=api_base(cfg.url),
        model=new.header.model, errors=dict(sorted(run.errors.items())),
        ended_early=sorted(run.ended_early),
        stopped=run.stopped or stopped,
        outputs=check_texts(items, recorded, run.texts, tok, why))
