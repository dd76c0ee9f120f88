"""What the desktop app costs: GUI time per frame, and engine throughput with a window attached.

    python -m benchmarks.window.gui_bench [--json] [--skip-engine | --skip-frames] [serve options]
    python -m benchmarks.window.gui_bench --source vllm|llama-server [--url URL] [--seconds S]

(a) GUI main-thread time per frame: a MainWindow (offscreen unless a display is set; --size,
    default 1600x900, every panel visible) fed synthetic engine state (kvscope/testing/frames.py
    builders: 64 running requests, tables scattered over the pool, one request selected)
    through the bridge's own path: each tick puts a new frame of every topic into the
    bridge's mailbox, then times bridge.drain() (the views take the newest frames) +
    frame_tick() (what one tick of the window's frame clock runs: the block map every tick,
    the plots or the labels when it is their turn) + processEvents() (Qt paints the dirty
    widgets). Also "every view" ticks: repaint_views() + refresh_labels() every tick, the
    worst case (and what this benchmark timed before the frame clock existed). Reported as
    wall time (perf_counter) and as the main thread's CPU time (thread_time), which a busy
    shared machine inflates much less than wall time.
(b) engine throughput with a window attached vs headless, end to end: a real `kvscope serve`
    process (--model default: the embedded SmolLM2-135M-Instruct), a fixed greedy workload
    (ignore_eos, so every request makes exactly --max-tokens tokens) driven by
    ipc.EngineClient from this process, run alternately with no window and with a real
    window process (`kvscope --attach CMD --attach-state STATE`, offscreen, from this checkout
    or --window-repo, e.g. an older commit's, to compare) whose CPU share is read with psutil.
    --chat: both sides also carry one chat reply that streams all the time (a long, code-heavy
    answer, greedy; benchmarks/window/chat_stream.py): headless from a plain client, and with
    the window as its chat panel sends and renders it (Markdown, highlighted code), so the
    ratio is the window's cost while it renders a streaming reply (issue 53's target: >= 0.95).
(c) --source vllm|llama-server: the window's CPU while it watches that engine under load
    (benchmarks/gui_source_load.py): a window process on a fake with the engine's real payloads
    and synthetic load, or on a real server (--url) with concurrent chats through its API.

Options not listed below go to `engine.cli.serve` (--device, --num-kv-blocks, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvscope.engine.measure.timing import add_json_flag, percentile, print_result, progress_logger

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[2]


log = progress_logger("gui_bench")


def make_window(tmp: str, size: tuple[int, int] = (1600, 900), **kwargs):
    from PySide6.QtCore import QSettings

    from kvscope.app.main_window import MainWindow

    settings = QSettings(str(Path(tmp) / "gui_bench.ini"), QSettings.Format.IniFormat)
    window = MainWindow(settings=settings, **kwargs)
    window.resize(*size)
    window.show()
    return window


# -- (a) ---------------------------------------------------------------------------------------
def synthetic_frames(num_blocks: int, requests: int, variants: int, block_size: int = 16):
    """`variants` blocks frames of one busy pool: ~85% of the blocks in use by `requests`
    running requests, each table scattered physically, the last block of each partly filled."""
    from kvscope.testing.frames import blocks_frame

    rng = random.Random(num_blocks)
    ids = [f"req-{i:03d}" for i in range(requests)]
    frames = []
    for v in range(variants):
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        per = int(num_blocks * 0.85) // requests
        tables = {rid: perm[i * per:(i + 1) * per] for i, rid in enumerate(ids)}
        filled = {t[-1]: rng.randrange(1, block_size) for t in tables.values()}
        cached = tuple(perm[requests * per:requests * per + num_blocks // 20])
        frames.append(blocks_frame(num_blocks, block_size, tables, filled, cached, seq=v + 1))
    return ids, frames


def gui_frame_time(num_blocks: int, requests: int, ticks: int, tmp: str,
                   size: tuple[int, int], every_view: bool) -> dict:
    from PySide6.QtWidgets import QApplication

    from kvscope.testing.frames import heartbeat, stats_frame, step_frame

    app = QApplication.instance()
    window = make_window(tmp, size, engine_args=[])
    try:
        ids, frames = synthetic_frames(num_blocks, requests, variants=8)
        window.block_map.select_request(ids[0])
        bridge = window.bridge

        def paint() -> None:
            if every_view:
                window.repaint_views()
                window.refresh_labels()
            else:
                window.frame_tick()
            app.processEvents()

        t0 = time.time()
        for _ in range(12):  # warm up: first image, grid, fonts; two rounds of every job
            bridge.mailbox.put_frame("blocks", frames[0])
            bridge.drain()
            paint()
        drain_ms, total_ms, cpu_ms = [], [], []
        for i in range(ticks):
            t = t0 + i / 30
            bridge.mailbox.put_frame("blocks", frames[i % len(frames)])
            bridge.mailbox.put_frame("step", step_frame(seq=i + 1, t=t, decode=requests,
                                                        running=requests))
            bridge.mailbox.put_frame("stats", stats_frame(seq=i + 1, t=t,
                                                          num_kv_blocks=num_blocks,
                                                          num_running=requests))
            bridge.mailbox.put_frame("heartbeat", heartbeat(seq=i + 1, busy=True))
            start, cpu_start = time.perf_counter(), time.thread_time()
            bridge.drain()
            mid = time.perf_counter()
            paint()
            end, cpu_end = time.perf_counter(), time.thread_time()
            drain_ms.append(1e3 * (mid - start))
            total_ms.append(1e3 * (end - start))
            cpu_ms.append(1e3 * (cpu_end - cpu_start))
        return {"blocks": num_blocks, "requests": requests, "ticks": ticks,
                "mode": "every view" if every_view else "frame clock",
                "size": f"{size[0]}x{size[1]}", "cell_px": window.block_map.cell_pixels(),
                "tick_ms_median": statistics.median(total_ms),
                "tick_ms_p95": percentile(total_ms, .95),
                "tick_ms_max": max(total_ms), "drain_ms_median": statistics.median(drain_ms),
                "cpu_ms_median": statistics.median(cpu_ms), "cpu_ms_p95": percentile(cpu_ms, .95)}
    finally:
        window.shutdown()
        window.close()
        window.deleteLater()
        app.processEvents()


# -- (b) ---------------------------------------------------------------------------------------
def start_window(command: str, state: str, repo: Path, config_dir: str,
                 chat: str | None = None, report: str | None = None):
    """`kvscope --attach` from `repo` (this checkout or another one, to compare), offscreen,
    with its own settings folder; returns once it holds connections to both engine ports.
    chat "window" or "headless": benchmarks/window/chat_stream.py's side instead, streaming
    its chat reply (from this checkout's benchmarks, the window from `repo`)."""
    import psutil

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys([str(repo), str(REPO)])),
               XDG_CONFIG_HOME=config_dir, XDG_DATA_HOME=config_dir,
               QT_QPA_PLATFORM="offscreen")
    argv = [sys.executable, "-m", "kvscope", "--attach", command, "--attach-state", state]
    if chat is not None:
        argv = [sys.executable, "-m", "benchmarks.window.chat_stream", "--attach", command,
                "--attach-state", state, f"--{chat}"] + (["--report", report] if report else [])
    proc = subprocess.Popen(argv, cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ports = {int(command.rsplit(":", 1)[1]), int(state.rsplit(":", 1)[1])}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the window process exited ({proc.returncode})")
        try:
            conns = psutil.Process(proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            conns = []
        if ports <= {c.raddr.port for c in conns if c.raddr}:
            return proc
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the window process did not connect in 3 minutes")


def stop_window(proc: subprocess.Popen, cpu_start: float, wall_start: float) -> dict:
    """The window's share of a core over the run, then stop it."""
    import psutil

    times = psutil.Process(proc.pid).cpu_times()
    cpu = times.user + times.system - cpu_start
    wall = time.monotonic() - wall_start
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    return {"cpu_s": cpu, "wall_s": wall, "core_share": cpu / max(wall, 1e-9)}


def _cpu_seconds(proc: subprocess.Popen) -> float:
    import psutil

    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


def throughput(serve_args, requests: int, max_tokens: int, reps: int,
               window_repo: Path, chat: bool = False) -> dict:
    from benchmarks.serving.ipc_bench import run_workload, start_server
    from kvscope.ipc import EngineClient

    proc, cmd_ep, state_ep = start_server(serve_args, None)
    log(f"engine ready at {cmd_ep} ({' '.join(serve_args)})")
    client = EngineClient(cmd_ep, state_ep)
    hello = client.hello(timeout=60)
    rng = random.Random(0)
    words = ["the", "cache", "keeps", "keys", "and", "values", "of", "every", "token", "in",
             "fixed", "size", "blocks"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(8, 24)))
               for _ in range(requests)]
    out: dict[str, list] = {"headless": [], "gui": [], "windows": [], "chat_helpers": []}
    report = None
    if chat:
        fd, report = tempfile.mkstemp(prefix="gui_bench-chat-", suffix=".jsonl")
        os.close(fd)
    try:
        run_workload(client, prompts[:4], 8)  # warm up
        config_dir = tempfile.mkdtemp(prefix="gui_bench-settings-")
        for rep in range(reps):
            for mode in ("headless", "gui"):
                window = None
                if mode == "gui" or chat:
                    side = None if not chat else "window" if mode == "gui" else "headless"
                    window = start_window(cmd_ep, state_ep, window_repo, config_dir, side,
                                          report)
                    time.sleep(3.0 if not chat else 8.0)  # past the first paints (and the
                    # chat's prefill): the steady state
                    cpu0, wall0 = _cpu_seconds(window), time.monotonic()
                tps = run_workload(client, prompts, max_tokens)
                if window is not None:
                    key = "windows" if mode == "gui" else "chat_helpers"
                    out[key].append(stop_window(window, cpu0, wall0))
                out[mode].append(tps)
                log(f"rep {rep + 1}/{reps} {mode}: {tps:.1f} tok/s")
    finally:
        try:
            client.shutdown(timeout=10)
        except Exception as exc:  # noqa: BLE001
            log(f"shutdown: {exc}")
        client.close()
        try:
            proc.wait(20)
        except Exception:  # noqa: BLE001
            proc.kill()
    h, g = statistics.median(out["headless"]), statistics.median(out["gui"])
    return {"window_repo": str(window_repo), "model": hello.config.model,
            "device": hello.config.device,
            "requests": requests, "max_tokens": max_tokens, "reps": reps,
            "headless_tok_s": h, "gui_tok_s": g, "gui_over_headless": g / h,
            "headless_runs": out["headless"], "gui_runs": out["gui"],
            "windows": out["windows"], "chat": chat, "chat_helpers": out["chat_helpers"],
            "chat_replies": _replies(report)}


def _replies(report: str | None) -> list[dict]:
    """The chat replies the two sides saw (chat_stream's --report lines)."""
    if not report or not os.path.exists(report):
        return []
    with open(report) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_table(report: dict, running: int, size: str) -> str:
    """(a) a row per pool size and mode, (b) the throughput with and without a window."""
    lines = []
    if report["frame_time"]:
        lines.append(f"(a) GUI main-thread time per tick (drain + frame + Qt paint), {running} "
                     f"running requests, window {size}, QPA {report['qpa']}")
        lines.append(f"{'blocks':>8} {'ticks':>12} {'median ms':>10} {'p95 ms':>8} "
                     f"{'max ms':>8} {'CPU median':>11} {'CPU p95':>8} {'drain ms':>9} "
                     f"{'cell px':>8}")
        lines += [f"{r['blocks']:>8} {r['mode']:>12} {r['tick_ms_median']:>10.2f} "
                  f"{r['tick_ms_p95']:>8.2f} {r['tick_ms_max']:>8.2f} "
                  f"{r['cpu_ms_median']:>11.2f} {r['cpu_ms_p95']:>8.2f} "
                  f"{r['drain_ms_median']:>9.2f} {r['cell_px']:>8.1f}"
                  for r in report["frame_time"]]
    t = report["throughput"]
    if t:
        heading = (f"(b) engine throughput, {t['requests']} requests x {t['max_tokens']} tokens, "
                   f"greedy, ignore_eos, model {t['model']} on {t['device']}, median of "
                   f"{t['reps']}, a window process attached vs none"
                   + (", a code-heavy chat reply streaming on both sides" if t["chat"] else ""))
        window_cpu = [round(100 * wd["core_share"], 1) for wd in t["windows"]]
        lines += ["", heading,
                  f"{'headless tok/s':>15} {'GUI tok/s':>10} {'GUI/headless':>13}",
                  (f"{t['headless_tok_s']:>15.1f} {t['gui_tok_s']:>10.1f} "
                   f"{t['gui_over_headless']:>13.3f}"),
                  (f"runs: headless {[round(x, 1) for x in t['headless_runs']]}, "
                   f"GUI {[round(x, 1) for x in t['gui_runs']]}"),
                  (f"window process ({t['window_repo']}) CPU during the GUI runs: "
                   f"{window_cpu} % of a core")]
        if t["chat"]:
            helper = [round(100 * wd["core_share"], 1) for wd in t["chat_helpers"]]
            replies = t["chat_replies"]
            lines += [f"headless chat client CPU: {helper} % of a core",
                      "chat replies (side, characters, code blocks, + cut by the run's end): "
                      + ", ".join(f"{r['side']} {r['chars']}/{r['code']}"
                                  + ("" if r.get("ended", True) else "+") for r in replies)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(p, "print one JSON object")
    p.add_argument("--blocks", default="4096,32768", help="pool sizes for (a)")
    p.add_argument("--running", type=int, default=64, help="running requests for (a)")
    p.add_argument("--ticks", type=int, default=120)
    p.add_argument("--size", default="1600x900", help="(a): window size WxH")
    p.add_argument("--requests", type=int, default=16, help="(b): requests in the workload")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-engine", action="store_true", help="only (a)")
    p.add_argument("--skip-frames", action="store_true", help="only (b)")
    p.add_argument("--chat", action="store_true",
                   help="(b): a code-heavy chat reply streams on both sides, the window "
                        "rendering it (benchmarks/window/chat_stream.py)")
    p.add_argument("--window-repo", type=Path, default=REPO,
                   help="(b): run the window from this checkout (default: this one), e.g. "
                        "an older commit's worktree, to compare windows on one engine")
    p.add_argument("--source", choices=("kvscope", "vllm", "llama-server"), default="kvscope",
                   help="the engine the window watches: kvscope runs (a) and (b); vllm and "
                        "llama-server run (c): the window's CPU while it watches one "
                        "(benchmarks/gui_source_load.py)")
    p.add_argument("--url", help="(c): a running server to watch (default: this checkout's "
                                 "fake of that engine, under synthetic load)")
    p.add_argument("--seconds", type=float, default=20.0, help="(c): how long to measure")
    p.add_argument("--load", type=int, default=4,
                   help="(c) with --url: concurrent streaming chats through its OpenAI API")
    p.add_argument("--events-hz", type=float, default=200.0,
                   help="(c) on the vLLM fake: KV-event batches per second")
    args, serve_args = p.parse_known_args(argv)
    if args.source != "kvscope":
        from benchmarks.window.gui_source_load import format_source, source_cost

        result = source_cost(args.source, args.url, args.seconds, args.load, args.events_hz,
                             args.max_tokens)
        print_result(result, format_source, args.json, indent=2)
        return 0
    if "--model" not in serve_args:
        serve_args = ["--model", "default", *serve_args]
    w, _, h = args.size.partition("x")
    size = (int(w), int(h))
    from PySide6.QtWidgets import QApplication

    QApplication.instance() or QApplication(["gui_bench"])
    report = {"qpa": os.environ.get("QT_QPA_PLATFORM"), "frame_time": [], "throughput": None}
    with tempfile.TemporaryDirectory() as tmp:
        for n in ([] if args.skip_frames else [int(x) for x in args.blocks.split(",")]):
            for every_view in (False, True):
                r = gui_frame_time(n, args.running, args.ticks, tmp, size, every_view)
                log(f"{n} blocks, {r['mode']}: tick {r['tick_ms_median']:.2f} ms median")
                report["frame_time"].append(r)
    if not args.skip_engine:
        report["throughput"] = throughput(serve_args, args.requests, args.max_tokens, args.reps,
                                          args.window_repo.resolve(), args.chat)
    print_result(report, lambda r: format_table(r, args.running, args.size), args.json,
                 indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
