"""Soak and chaos against a real `kvscope serve` on loopback: does the engine hold up for hours?

    python -m benchmarks.serving.soak --quick            # 5 minutes
    python -m benchmarks.serving.soak --minutes 30 --out /tmp/soak
    python -m benchmarks.serving.soak --seconds 60 --tiny # what `make test` runs (KVSCOPE_SOAK=1)

One `kvscope serve --http-port 0` subprocess and, for the whole run, at once: HTTP clients
sending streamed and whole completions and chats (some hang up mid-stream), bad bodies (broken
JSON, wrong types, negative max_tokens, an unknown model, a 9 MB prompt, out-of-vocabulary
token ids and more: each must get a 4xx), ZeroMQ submits of which 40 % are aborted, a live
reconfigure of block size, KV dtype or budget every --reconfigure-every seconds, a trace
started and stopped every --trace-every seconds. Optionally (--window) a window process
attached offscreen. It reports requests by outcome, latency percentiles per tenth of the run,
the server's resident memory over time, the blocks owned at the end and whether a greedy reply
is the same before and after, and exits 1 unless:

- no unexpected outcome (a 5xx, a good request refused, a bad one accepted, a dropped stream);
- 0 KV blocks owned once the load has stopped;
- resident memory growth after warm-up under --max-growth-mib (50), compared at the base
  settings (the reconfigure cycle returns to them, and a halved budget is half a pool less);
- p99 latency in the last tenth within --max-p99-ratio (1.2) of the first tenth.

Latency figures on a shared machine swing with the neighbours' load; the JSON (--out) keeps
every sample, so a failed ratio can be read against the load average it records.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIB = 2**20
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
GREEDY = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0}
GREEDY_PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the server ----------------------------------------------------------------------------
class Serve:
    """`kvscope serve` on free loopback ports, its endpoints, HTTP base and process."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.trace_dir = workdir / "traces"
        cmd = [sys.executable, "-m", "kvscope", "serve", "--port", "0", "--http-port", "0",
               "--device", args.device, "--model", args.model, "--block-size", "16",
               "--kv-cache-bytes", str(args.kv_cache_mib * MIB),
               "--max-num-seqs", str(args.max_num_seqs), "--trace-dir", str(self.trace_dir),
               *args.serve_args]
        self.log = open(workdir / "serve.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline().split() if self.proc.stdout else []
        if not line or line[0] != "ready":
            self.proc.kill()
            raise SystemExit(f"kvscope serve did not start ({' '.join(cmd)}); see "
                             f"{workdir / 'serve.log'}")
        self.command, self.state = line[1], line[2]
        self.ps = psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return int(self.proc.returncode or 0)


def tiny_chat_model(folder: Path) -> Path:
    """The random tiny test model, with a chat template so chats are real chats."""
    from transformers import AutoTokenizer

    from kvscope.testing.tiny_models import save_tiny_model

    save_tiny_model(folder, "llama", seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


# -- bookkeeping ---------------------------------------------------------------------------
class Tally:
    """Outcomes, latencies and unexpected events, shared by every worker thread."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[tuple[float, float, str]] = []  # (t since start, seconds, kind)
        self.unexpected: list[str] = []

    def count(self, outcome: str, kind: str, latency: float | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1
            if latency is not None:
                self.latencies.append((time.monotonic() - self.started, latency, kind))

    def fail(self, kind: str, what: str) -> None:
        with self.lock:
            self.outcomes[f"{kind}:unexpected"] += 1
            if len(self.unexpected) < 200:
                self.unexpected.append(f"{time.monotonic() - self.started:7.1f}s {kind}: {what}")


# -- HTTP ----------------------------------------------------------------------------------
def http_request(base: tuple[str, int], method: str, path: str, body: bytes | None,
                 timeout: float) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*base, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    return conn.getresponse()


def good_body(rng: random.Random, model: str, chat: bool, stream: bool) -> dict:
    tokens = rng.choice([8, 16, 24])
    body: dict = {"model": model, "max_tokens": tokens, "stream": stream,
                  "temperature": rng.choice([0.0, 0.7]), "ignore_eos": True}
    words = " ".join(rng.choice(["kv", "block", "cache", "page", "token", "step", "batch"])
                     for _ in range(rng.randrange(4, 40)))
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    return body


def http_good(base, model: str, rng: random.Random, tally: Tally, hangup_p: float) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    kind = ("chat" if chat else "completion") + ("-stream" if stream else "")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = json.dumps(good_body(rng, model, chat, stream)).encode()
    hang_up = stream and rng.random() < hangup_p
    start = time.monotonic()
    try:
        resp = http_request(base, "POST", path, body, timeout=300)
        if resp.status != 200:
            tally.fail(kind, f"HTTP {resp.status}: {resp.read()[:300]!r}")
            return
        if not stream:
            out = json.loads(resp.read())
            if not out.get("choices"):
                tally.fail(kind, f"no choices: {str(out)[:200]}")
                return
            tally.count("ok", kind, time.monotonic() - start)
            return
        lines = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            lines += 1
            if hang_up and lines >= 2:
                resp.close()  # the client goes away mid-stream
                tally.count("hangup", kind)
                return
            if line == b"data: [DONE]":
                tally.count("ok", kind, time.monotonic() - start)
                return
            event = json.loads(line[5:])
            if "error" in event:
                tally.fail(kind, f"error event: {str(event)[:300]}")
                return
        tally.fail(kind, "the stream ended without [DONE]")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        tally.fail(kind, f"{type(exc).__name__}: {exc}")


def bad_bodies(model: str, vocab: int, max_model_len: int) -> list[tuple[str, str, str, bytes]]:
    """(name, method, path, body): every one must be answered with a 4xx."""
    def j(obj: object) -> bytes:
        return json.dumps(obj).encode()

    comp, chat = "/v1/completions", "/v1/chat/completions"
    ok = {"model": model, "prompt": "hi", "max_tokens": 4}
    return [
        ("broken-json", "POST", comp, b'{"model": "x", "prompt": "hi",'),
        ("not-an-object", "POST", comp, j(["prompt", "hi"])),
        ("wrong-type-max-tokens", "POST", comp, j({**ok, "max_tokens": "ten"})),
        ("negative-max-tokens", "POST", comp, j({**ok, "max_tokens": -5})),
        ("unknown-model", "POST", comp, j({**ok, "model": "no-such-model"})),
        ("oov-token-id", "POST", comp, j({**ok, "prompt": [1, 2, vocab + 7]})),
        ("negative-token-id", "POST", comp, j({**ok, "prompt": [1, -3]})),
        ("missing-prompt", "POST", comp, j({"model": model, "max_tokens": 4})),
        ("empty-prompt", "POST", comp, j({**ok, "prompt": ""})),
        ("temperature-negative", "POST", comp, j({**ok, "temperature": -1})),
        ("top-p-above-one", "POST", comp, j({**ok, "top_p": 2.5})),
        ("stop-wrong-type", "POST", comp, j({**ok, "stop": 42})),
        ("prompt-past-model-len", "POST", comp, j({**ok, "prompt": [1] * (max_model_len + 8)})),
        ("chat-no-messages", "POST", chat, j({"model": model, "messages": []})),
        ("chat-bad-role-type", "POST", chat, j({"model": model,
                                                "messages": [{"role": 7, "content": "x"}]})),
        ("chat-content-number", "POST", chat, j({"model": model,
                                                 "messages": [{"role": "user", "content": 3}]})),
        ("not-utf8", "POST", comp, b'{"prompt": "\xff\xfe"}'),
        ("unknown-path", "POST", "/v1/no-such-endpoint", j(ok)),
        ("wrong-method", "GET", comp, None),
        ("9mb-prompt", "POST", comp, j({**ok, "prompt": "a" * (9 * MIB)})),
    ]


def http_bad(base, bodies, rng: random.Random, tally: Tally) -> None:
    # The 9 MB body is sent now and then, not a quarter of the time: it is 9 MB each way.
    name, method, path, body = rng.choice(bodies[:-1] if rng.random() > 0.02 else bodies[-1:])
    kind = f"bad:{name}"
    try:
        resp = http_request(base, method, path, body, timeout=120)
        resp.read()
        if 400 <= resp.status < 500:
            tally.count("4xx", kind)
        else:
            tally.fail(kind, f"HTTP {resp.status} (a 4xx was due)")
    except (OSError, http.client.HTTPException) as exc:
        if name == "9mb-prompt" and isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            tally.count("4xx", kind)  # refused before the whole body was read
        else:
            tally.fail(kind, f"{type(exc).__name__}: {exc}")


def http_worker(base, model, bodies, args, seed: int, tally: Tally, stop: threading.Event):
    rng = random.Random(seed)
    while not stop.is_set():
        if rng.random() < args.bad_fraction:
            http_bad(base, bodies, rng, tally)
        else:
            http_good(base, model, rng, tally, args.hangup_fraction)


# -- ZeroMQ --------------------------------------------------------------------------------
def zmq_worker(client, vocab: int, args, seed: int, tally: Tally, stop: threading.Event):
    from kvscope.ipc.client import EngineDead, EngineError, EngineTimeout

    rng = random.Random(seed)
    while not stop.is_set():
        prompt = [rng.randrange(1, min(vocab, 250)) for _ in range(rng.randrange(4, 64))]
        abort = rng.random() < args.abort_fraction
        start = time.monotonic()
        try:
            rid = client.submit(prompt, {"max_tokens": 16, "ignore_eos": True})
            n, reason = 0, None
            for d in client.stream(rid, timeout=300):
                n += len(d.token_ids)
                if abort and n >= 2 and not d.finished:
                    client.abort(rid)
                    abort = False  # the stream still ends, with "abort"
                if d.finished:
                    reason = d.finish_reason
            if reason == "abort":
                tally.count("aborted", "zmq")
            elif reason in ("length", "stop"):
                tally.count("ok", "zmq", time.monotonic() - start)
            else:
                tally.fail("zmq", f"finish reason {reason!r}")
        except EngineError as exc:
            if exc.code == "unknown_request":  # the abort raced the finish
                tally.count("aborted", "zmq")
            else:
                tally.fail("zmq", str(exc))
        except (EngineDead, EngineTimeout) as exc:
            tally.fail("zmq", f"{type(exc).__name__}: {exc}")


# -- reconfigures, traces, memory ----------------------------------------------------------
def reconfigure_cycle(kv_bytes: int) -> list[tuple[str, dict]]:
    """(label, changes); "base" entries put the start settings back, where memory compares."""
    return [("bs32", {"block_size": 32}), ("bs8", {"block_size": 8}),
            ("base", {"block_size": 16}), ("int8", {"kv_dtype": "int8"}),
            ("base", {"kv_dtype": "auto"}), ("half-budget", {"kv_cache_bytes": kv_bytes // 2}),
            ("base", {"kv_cache_bytes": kv_bytes})]


class Chaos:
    """The control thread: reconfigures, traces; and the memory sampler."""

    def __init__(self, client, serve: Serve, args, tally: Tally) -> None:
        self.client, self.serve, self.args, self.tally = client, serve, args, tally
        self.cycle = reconfigure_cycle(args.kv_cache_mib * MIB)
        self.label = "base"
        self.reconfigures: Counter[str] = Counter()
        self.traces = 0
        self.memory: list[tuple[float, int, str]] = []  # (t, rss bytes, settings label)

    def run(self, stop: threading.Event) -> None:
        from kvscope.ipc.client import EngineError

        t0 = self.tally.started
        next_reconf = t0 + self.args.reconfigure_every
        next_trace, tracing, i = t0 + self.args.trace_every / 2, False, 0
        while not stop.wait(0.5):
            now = time.monotonic()
            try:
                if now >= next_reconf:
                    label, changes = self.cycle[i % len(self.cycle)]
                    i += 1
                    self.label = "changing"  # memory mid-rebuild is neither setting's
                    self.client.reconfigure(timeout=300, **changes)
                    self.label = label
                    self.reconfigures[label] += 1
                    next_reconf = time.monotonic() + self.args.reconfigure_every
                if now >= next_trace:
                    if tracing:
                        self.client.trace_stop(timeout=60)
                    else:
                        self.client.trace_start(f"soak-{self.traces}.jsonl", timeout=60)
                        self.traces += 1
                    tracing = not tracing
                    next_trace = time.monotonic() + self.args.trace_every / 2
            except EngineError as exc:
                self.tally.fail("control", str(exc))
        if tracing:
            self.client.trace_stop(timeout=60)
        # Back at the base settings for the closing checks.
        for label, changes in self.cycle:
            if label == "base":
                self.client.reconfigure(timeout=300, **changes)
        self.label = "base"

    def sample(self, stop: threading.Event) -> None:
        """The server's resident set every second, with the settings then in force (its own
        thread: a reconfigure under load takes seconds, and so would the gaps)."""
        while not stop.wait(1.0):
            self.memory.append((time.monotonic() - self.tally.started, self.serve.rss(),
                                self.label))


def start_window(serve: Serve, workdir: Path) -> subprocess.Popen:
    """`kvscope --attach` offscreen with its own settings folder, drawing the live state the
    whole run (benchmarks.gui_bench.start_window: returns once it is connected)."""
    from benchmarks.window.gui_bench import REPO
    from benchmarks.window.gui_bench import start_window as attach

    config = workdir / "window-config"
    config.mkdir(exist_ok=True)
    return attach(serve.command, serve.state, REPO, str(config))


# -- the report ----------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def latency_tenths(latencies, duration: float) -> list[dict]:
    out = []
    for k in range(10):
        lo, hi = duration * k / 10, duration * (k + 1) / 10
        vals = [lat for t, lat, _ in latencies if lo <= t < hi]
        out.append({"from_s": round(lo, 1), "n": len(vals), "p50": pct(vals, 0.50),
                    "p95": pct(vals, 0.95), "p99": pct(vals, 0.99)})
    return out


def memory_growth(memory, warmup_s: float) -> dict:
    """The first and the last fifth of the samples taken at the base settings after warm-up
    (a tenth of the run would hold none when a reconfigure cycle is long)."""
    base = [r for t, r, label in memory if label == "base" and t >= warmup_s]
    fifth = len(base) // 5
    if fifth < 2:
        return {"growth_mib": float("nan"), "note": "too few samples at the base settings"}
    early, late = base[:fifth], base[-fifth:]
    return {"after_warmup_mib": statistics.median(early) / MIB,
            "last_tenth_mib": statistics.median(late) / MIB,
            "growth_mib": (statistics.median(late) - statistics.median(early)) / MIB,
            "max_mib": max(r for _, r, _ in memory) / MIB,
            "min_mib": min(r for _, r, _ in memory) / MIB}


def greedy_reply(client) -> list[int]:
    return list(client.generate(GREEDY_PROMPT, GREEDY, timeout=300).token_ids)


def soak(args: argparse.Namespace) -> dict:
    from kvscope.ipc import EngineClient

    workdir = Path(args.out or tempfile.mkdtemp(prefix="kvscope-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.model = str(tiny_chat_model(workdir / "tiny-model"))
    serve = Serve(args, workdir)
    client = EngineClient(serve.command, serve.state, timeout=300, heartbeat_timeout=60)
    window = None
    try:
        hello = client.hello()
        stats = client.snapshot().stats
        vocab = 256 if args.tiny else 49152
        host, port = hello.http_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
        base = (host, int(port))
        model = json.loads(http_request(base, "GET", "/v1/models", None, 30).read()
                           )["data"][0]["id"]
        before = greedy_reply(client)
        log(f"serve pid {serve.proc.pid}, model {model}, {stats.engine.num_kv_blocks} blocks; "
            f"running {args.seconds:.0f} s in {workdir}")
        if args.window:
            window = start_window(serve, workdir)
        stop = threading.Event()
        tally = Tally(time.monotonic())
        chaos = Chaos(client, serve, args, tally)
        bodies = bad_bodies(model, vocab, hello.max_model_len)
        threads = [threading.Thread(target=http_worker, daemon=True,
                                    args=(base, model, bodies, args, 100 + k, tally, stop))
                   for k in range(args.http_clients)]
        threads += [threading.Thread(target=zmq_worker, daemon=True,
                                     args=(client, vocab, args, 200 + k, tally, stop))
                    for k in range(args.zmq_clients)]
        control = threading.Thread(target=chaos.run, args=(stop,), daemon=True)
        sampler = threading.Thread(target=chaos.sample, args=(stop,), daemon=True)
        for t in [*threads, control, sampler]:
            t.start()
        deadline = tally.started + args.seconds
        while time.monotonic() < deadline and serve.proc.poll() is None:
            time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            done = sum(v for k, v in tally.outcomes.items() if not k.endswith("unexpected"))
            log(f"{time.monotonic() - tally.started:6.0f} s: {done} requests, "
                f"{len(tally.unexpected)} unexpected, rss {serve.rss() / MIB:.0f} MiB")
        duration = time.monotonic() - tally.started
        stop.set()
        for t in threads:
            t.join(600)
        control.join(600)
        time.sleep(1.0)
        used = client.snapshot().stats.engine.num_used_blocks
        after = greedy_reply(client)
        report = {
            "seconds": round(duration, 1), "workdir": str(workdir), "model": model,
            "outcomes": dict(sorted(tally.outcomes.items())),
            "unexpected": tally.unexpected, "reconfigures": dict(chaos.reconfigures),
            "traces": chaos.traces, "blocks_owned_at_end": used,
            "greedy_same": before == after, "latency_tenths": latency_tenths(
                tally.latencies, duration),
            "memory": memory_growth(chaos.memory, args.warmup_s),
            "memory_samples": [(round(t, 1), r // MIB, lab) for t, r, lab in chaos.memory],
            "load_average": os.getloadavg(), "window": bool(window),
            "window_alive": window is not None and window.poll() is None}
        return check(report, args)
    finally:
        if window is not None:
            window.terminate()
        client.close()
        serve.stop()


def check(report: dict, args) -> dict:
    tenths = report["latency_tenths"]
    first, last = tenths[0]["p99"], tenths[-1]["p99"]
    report["p99_ratio"] = last / first if first == first and first > 0 else float("nan")
    unexpected = sum(v for k, v in report["outcomes"].items() if k.endswith("unexpected"))
    failures = []
    if unexpected:
        failures.append(f"{unexpected} unexpected outcomes")
    if report["blocks_owned_at_end"]:
        failures.append(f"{report['blocks_owned_at_end']} KV blocks owned at the end")
    if not report["greedy_same"]:
        failures.append("the greedy reply changed")
    growth = report["memory"]["growth_mib"]
    if growth != growth:  # nan
        failures.append("too few memory samples at the base settings after warm-up: run longer")
    elif not growth < args.max_growth_mib:
        failures.append(f"memory grew {growth:.1f} MiB after warm-up")
    if not report["p99_ratio"] <= args.max_p99_ratio:
        failures.append(f"p99 latency: last tenth {last:.2f} s vs first {first:.2f} s")
    if args.window and not report["window_alive"]:
        failures.append("the window process exited")
    report["failures"] = failures
    report["passed"] = not failures
    return report


def summary(report: dict) -> str:
    lines = [f"soak: {report['seconds']} s against {report['model']}",
             "outcomes: " + ", ".join(f"{k}={v}" for k, v in report["outcomes"].items()),
             f"reconfigures: {report['reconfigures']}, traces: {report['traces']}",
             "latency p50/p99 per tenth (s): " + "  ".join(
                 f"{t['p50']:.2f}/{t['p99']:.2f}" for t in report["latency_tenths"]),
             f"p99 last/first tenth: {report['p99_ratio']:.2f}",
             "memory (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in report["memory"].items()
                                          if isinstance(v, float)),
             f"blocks owned at the end: {report['blocks_owned_at_end']}; greedy same: "
             f"{report['greedy_same']}",
             *[f"unexpected: {u}" for u in report["unexpected"][:10]],
             "PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"])]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="5 minutes")
    length.add_argument("--minutes", type=float, help="run this long (default 5)")
    length.add_argument("--seconds", type=float, help="run this long, in seconds")
    p.add_argument("--out", help="folder for serve.log, traces and report.json (default: temp)")
    p.add_argument("--model", default="default")
    p.add_argument("--tiny", action="store_true", help="the random tiny test model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--http-clients", type=int, default=12)
    p.add_argument("--zmq-clients", type=int, default=4)
    p.add_argument("--bad-fraction", type=float, default=0.25)
    p.add_argument("--hangup-fraction", type=float, default=0.03)
    p.add_argument("--abort-fraction", type=float, default=0.4)
    p.add_argument("--reconfigure-every", type=float, default=20.0, help="seconds")
    p.add_argument("--trace-every", type=float, default=60.0, help="seconds per start+stop")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="memory compares after this (default: a tenth of the run, ≥ 30 s)")
    p.add_argument("--max-growth-mib", type=float, default=50.0)
    p.add_argument("--max-p99-ratio", type=float, default=1.2)
    p.add_argument("--window", action="store_true", help="attach an offscreen window too")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("serve_args", nargs="*", help="more `kvscope serve` options, after --")
    args = p.parse_args(argv)
    args.seconds = args.seconds or 60 * (args.minutes or 5)
    if args.warmup_s is None:
        args.warmup_s = max(30.0, args.seconds / 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = soak(args)
    if args.out:
        Path(args.out, "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1) if args.json else summary(report), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
