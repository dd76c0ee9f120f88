"""What the OpenAI HTTP API costs: streamed tokens/s, TTFT and server CPU, HTTP vs ZeroMQ.

    python -m benchmarks.serving.http_bench [--json] [--tiny] [serve options]

One real `kvscope serve --http-port 0` subprocess; the same greedy workload (token-id prompts,
ignore_eos, so every request makes exactly --max-tokens tokens) from --concurrency streaming
clients at once (closed loop: each client sends its next request when the last one ended),
once through `ipc.EngineClient` (ZeroMQ) and once through `POST /v1/completions` with
`stream: true` (a keep-alive connection per client, SSE parsed by hand so the client's own
cost stays small), alternating
--reps times. Reports generated tokens/s each way (medians) and their ratio, TTFT, and the
server's CPU seconds each way (psutil): on a box shared with other work, where wall-clock rates
swing with the neighbours' load, the CPU ratio is the steadier measure of what HTTP costs.
The engine steps each way show how well the batches stayed full: a closed loop of equal
requests finishes them in waves, and a wave's resubmissions that trickle in start a step
with only part of the batch.

Options not listed below go to `kvscope serve` (--model, --device, --max-num-seqs, ...).
--tiny uses the random tiny test model (kvscope/testing/tiny_models.py): steps of a millisecond
or two, the worst case for the HTTP side's relative cost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.serving.ipc_bench import start_server
from kvscope.engine.measure.timing import add_json_flag, print_result, progress_logger

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


log = progress_logger("http_bench")


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def run_ipc(client, prompts, max_tokens: int, concurrency: int) -> dict:
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    ttft: list[float] = []
    tokens = [0]

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                _, prompt = todo.pop()
            start = time.perf_counter()
            rid = client.submit(prompt, {"max_tokens": max_tokens, "ignore_eos": True})
            first = None
            for d in client.stream(rid, timeout=600):
                if d.token_ids and first is None:
                    first = time.perf_counter() - start
                if d.finished:
                    with lock:
                        tokens[0] += d.num_output_tokens
                        ttft.append(first)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"tokens_per_s": tokens[0] / (time.perf_counter() - start), "tokens": tokens[0],
            "ttft_p50_s": statistics.median(ttft)}


class SseConnection:
    """One keep-alive HTTP/1.1 connection posting streaming requests, with chunked transfer
    decoding and SSE parsing by hand: a few microseconds per chunk (httpx's pure-Python h11
    costs ~10x more, and on a small box the client competes with the server for the CPU)."""

    def __init__(self, url: str) -> None:
        rest = url.removeprefix("http://")
        hostport, _, path = rest.partition("/")
        self.host, _, port = hostport.rpartition(":")
        self.port, self.prefix = int(port), "/" + path
        self.reader = self.writer = None

    async def post(self, path: str, body: dict):
        """Yields each event's data (bytes) until [DONE]."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}"
                          f"\r\n\r\n".encode() + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        buf = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            buf += chunk[:-2]
            *events, buf = buf.split(b"\n\n")
            for e in events:
                if e != b"data: [DONE]":
                    yield e[6:]

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _http_one(conn: SseConnection, prompt, max_tokens) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, used = None, 0
    async for data in conn.post("/completions", body):
        if first is None:
            first = time.perf_counter() - start
        if b'"usage":{' in data:
            used = json.loads(data)["usage"]["completion_tokens"]
    return used, first


def run_http(url, prompts, max_tokens: int, concurrency: int) -> dict:
    async def main():
        todo = list(prompts)
        ttft, tokens = [], 0

        async def worker():
            nonlocal tokens
            conn = SseConnection(url)
            try:
                while todo:
                    used, first = await _http_one(conn, todo.pop(), max_tokens)
                    tokens += used
                    ttft.append(first)
            finally:
                await conn.close()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {"tokens_per_s": tokens / (time.perf_counter() - start), "tokens": tokens,
                "ttft_p50_s": statistics.median(ttft)}

    return asyncio.run(main())


def bench(serve_args, requests: int, concurrency: int, prompt_len: int, max_tokens: int,
          reps: int, threads: int | None) -> dict:
    from kvscope.ipc import EngineClient

    proc, command, state = start_server(["--http-port", "0", *serve_args], threads)
    try:
        with EngineClient(command, state, timeout=600, heartbeat_timeout=30) as client:
            hello = client.hello()
            vocab = 250  # ids every test model and SmolLM2 treat as plain tokens
            prompts = prompts_for(requests, prompt_len, vocab, seed=0)
            log(f"warm-up; the API is at {hello.http_url}")
            run_ipc(client, prompts[:concurrency], 8, concurrency)
            run_http(hello.http_url, prompts[:concurrency], 8, concurrency)
            runs = {"ipc": [], "http": []}
            server_cpu = psutil.Process(proc.pid)
            for rep in range(reps):
                for way in ("ipc", "http") if rep % 2 == 0 else ("http", "ipc"):
                    cpu0, mine0 = sum(server_cpu.cpu_times()[:2]), time.process_time()
                    steps0 = client.snapshot().stats.step
                    r = (run_ipc(client, prompts, max_tokens, concurrency) if way == "ipc"
                         else run_http(hello.http_url, prompts, max_tokens, concurrency))
                    r["server_cpu_s"] = sum(server_cpu.cpu_times()[:2]) - cpu0
                    r["client_cpu_s"] = time.process_time() - mine0
                    r["steps"] = client.snapshot().stats.step - steps0
                    if r["tokens"] != requests * max_tokens:
                        raise SystemExit(f"{way}: {r['tokens']} tokens, expected "
                                         f"{requests * max_tokens}")
                    runs[way].append(r)
                    log(f"rep {rep} {way}: {r['tokens_per_s']:.1f} tok/s, CPU s: server "
                        f"{r['server_cpu_s']:.2f}, client {r['client_cpu_s']:.2f}, engine "
                        f"steps {r['steps']}")
    finally:
        proc.terminate()
        proc.wait(30)
    keys = ("tokens_per_s", "ttft_p50_s", "server_cpu_s", "client_cpu_s", "steps")
    med = {way: {k: statistics.median(r[k] for r in rs) for k in keys}
           for way, rs in runs.items()}
    return {"requests": requests, "concurrency": concurrency, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "reps": reps, "median": med,
            "runs": {w: [r["tokens_per_s"] for r in rs] for w, rs in runs.items()},
            "http_over_ipc": med["http"]["tokens_per_s"] / med["ipc"]["tokens_per_s"],
            # Less at the mercy of other processes on a shared box than wall-clock rates:
            "server_cpu_ipc_over_http": med["ipc"]["server_cpu_s"] / med["http"]["server_cpu_s"]}


def table(r: dict) -> str:
    lines = [(f"{r['requests']} requests, {r['concurrency']} streaming clients, prompt "
              f"{r['prompt_len']} tokens, {r['max_tokens']} generated each, {r['reps']} reps "
              f"(medians)")]
    for way, name in (("ipc", "ipc.EngineClient (ZeroMQ)"),
                      ("http", "HTTP /v1/completions SSE")):
        m = r["median"][way]
        lines.append(f"  {name:28s} {m['tokens_per_s']:9.1f} tok/s   TTFT p50 "
                     f"{1e3 * m['ttft_p50_s']:8.1f} ms   CPU s server {m['server_cpu_s']:.2f} "
                     f"client {m['client_cpu_s']:.2f}   steps {m['steps']:.0f}   runs "
                     + " ".join(f"{x:.0f}" for x in r["runs"][way]))
    lines.append(f"  HTTP / ZeroMQ throughput: {r['http_over_ipc']:.3f}; server CPU per token, "
                 f"ZeroMQ / HTTP: {r['server_cpu_ipc_over_http']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.http_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_flag(p, "one JSON object on stdout")
    p.add_argument("--tiny", action="store_true", help="the tiny random test model")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="runs each way, alternating")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the server (torch threads)")
    args, serve_args = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from kvscope.testing.tiny_models import save_tiny_model

            save_tiny_model(Path(tmp), "llama", seed=0)
            serve_args = ["--model", tmp, *serve_args]
        if "--max-num-seqs" not in serve_args:
            serve_args = [*serve_args, "--max-num-seqs", str(args.concurrency)]
        result = bench(serve_args, args.requests, args.concurrency, args.prompt_len,
                       args.max_tokens, args.reps, args.server_threads)
    print_result(result, table, args.json, table_to_stderr=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
