"""What the priority benchmarks send: the interactive chat and the background batch, their
options, and the HTTP clients that stream them (benchmarks/priority_latency.py over the
OpenAI API; benchmarks/priority_engine.py takes the words, topics and options only)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from benchmarks.serving.http_bench import SseConnection

WORDS = (
    "cache", "block", "token", "page", "memory", "queue", "batch", "model", "layer", "head",
    "value", "key", "stream", "request", "latency", "budget", "window", "chunk", "prefill",
    "decode", "policy", "engine", "server", "client", "table", "number", "river", "mountain",
    "garden", "music", "paper", "silver", "morning", "yellow", "quiet",
)
BG_READY_S = 60.0  # longest wait for every background stream to produce (a loaded box)
TOPICS = ("the weather", "a good book", "tea", "the sea", "trains", "a small cat")


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    fg_requests: int = 0
    # each chat's content chunk arrival times, first token first (which ITL gaps span
    # another chat's prefill: its first token arrived inside the gap)
    chats: list[list[float]] = field(default_factory=list)
    bg_chunks: list[float] = field(default_factory=list)  # arrival times of content chunks
    bg_started: set[int] = field(default_factory=set)  # workers whose stream is producing


@dataclass(frozen=True)
class Load:
    fg_interval: float
    fg_tokens: int
    fg_priority: int
    bg_streams: int
    bg_words: tuple[int, int]
    bg_tokens: int
    seed: int


async def foreground_one(url: str, load: Load, k: int, out: Samples) -> None:
    conn = SseConnection(url)
    body = {"messages": [{"role": "user", "content": f"Say a few words about "
                                                     f"{TOPICS[k % len(TOPICS)]}."}],
            "max_tokens": load.fg_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "priority": load.fg_priority}
    sent = last = time.perf_counter()
    first = True
    arrivals: list[float] = []
    out.chats.append(arrivals)
    try:
        async for data in conn.post("/chat/completions", body):
            choices = json.loads(data)["choices"]
            if not choices or not choices[0]["delta"].get("content"):
                continue  # the role chunk, the usage chunk
            now = time.perf_counter()
            arrivals.append(now)
            if first:
                out.ttft.append(now - sent)
                first = False
            else:
                out.itl.append(now - last)
            last = now
    finally:
        await conn.close()
    out.fg_requests += 1


async def foreground(url: str, load: Load, seconds: float, out: Samples) -> None:
    """Open loop: one chat every fg_interval until `seconds` passed, then wait for them."""
    start, tasks = time.perf_counter(), []
    for k in range(max(1, int(seconds / load.fg_interval))):
        delay = start + k * load.fg_interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(foreground_one(url, load, k, out)))
    await asyncio.gather(*tasks)


async def background_worker(url: str, load: Load, worker: int, out: Samples) -> None:
    """Closed loop until cancelled (the hang-up aborts the request in flight)."""
    rng = random.Random(f"{load.seed}:{worker}")
    conn = SseConnection(url)
    try:
        while True:
            n = rng.randint(*load.bg_words)
            body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(n)),
                    "max_tokens": load.bg_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            async for data in conn.post("/completions", body):
                if b'"text":"' in data and b'"text":""' not in data:
                    out.bg_chunks.append(time.perf_counter())
                    out.bg_started.add(worker)
    finally:
        await conn.close()


async def all_producing(load: Load, out: Samples) -> int:
    """Wait (at most BG_READY_S) until every background stream is past its first prefill."""
    deadline = time.perf_counter() + BG_READY_S
    while len(out.bg_started) < load.bg_streams and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    return len(out.bg_started)


async def stop(workers: list[asyncio.Task]) -> None:
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The chat and the background, as this benchmark and priority_engine share them."""
    p.add_argument("--fg-interval", type=float, default=1.5)
    p.add_argument("--fg-tokens", type=int, default=48)
    p.add_argument("--fg-priority", type=int, default=-1)
    p.add_argument("--bg-streams", type=int, default=16)
    p.add_argument("--bg-min-words", type=int, default=200)
    p.add_argument("--bg-max-words", type=int, default=700)
    p.add_argument("--bg-tokens", type=int, default=128)
