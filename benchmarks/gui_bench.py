"""What the desktop app costs: `python -m benchmarks.gui_bench [--json] [serve options]`

(a) GUI main-thread time per frame: a MainWindow (offscreen unless a display is set) fed
    synthetic engine state (tests/app_fakes.py builders: 64 running requests, tables scattered
    over the pool, one request selected) through the bridge's own path: frames go into the
    bridge's mailbox, then one tick = bridge.drain() (block map, chat, plots, status take the
    newest frame) + repaint_views() (block map image + plots) + refresh_labels() (totals,
    block table, chat clocks; the real window does this at 4 Hz, counted here every tick: the
    worst case) + processEvents() (Qt paints the dirty widgets). Timed with perf_counter at
    4k and 32k blocks.
(b) engine throughput with the GUI attached vs headless: a real `engine.cli.serve` process
    (--model default: the embedded SmolLM2-135M-Instruct), a fixed greedy workload (ignore_eos,
    so every request makes exactly --max-tokens tokens) driven by ipc.EngineClient, run
    alternately with no subscriber and with a MainWindow in this process attached to the
    engine (subscribed to every topic, repainting at 30 Hz) while the Qt loop runs here.

Options not listed below go to `engine.cli.serve` (--device, --num-kv-blocks, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # app_fakes: the frame builders the app tests use


def log(msg: str) -> None:
    print(f"[gui_bench] {msg}", file=sys.stderr, flush=True)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_window(tmp: str, **kwargs):
    from PySide6.QtCore import QSettings

    from app.main_window import MainWindow

    settings = QSettings(str(Path(tmp) / "gui_bench.ini"), QSettings.Format.IniFormat)
    window = MainWindow(settings=settings, **kwargs)
    window.resize(1600, 960)
    window.show()
    return window


# -- (a) ---------------------------------------------------------------------------------------
def synthetic_frames(num_blocks: int, requests: int, variants: int, block_size: int = 16):
    """`variants` blocks frames of one busy pool: ~85% of the blocks in use by `requests`
    running requests, each table scattered physically, the last block of each partly filled."""
    from app_fakes import blocks_frame

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


def gui_frame_time(num_blocks: int, requests: int, ticks: int, tmp: str) -> dict:
    from app_fakes import heartbeat, stats_frame, step_frame
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    window = make_window(tmp, engine_args=[])
    try:
        ids, frames = synthetic_frames(num_blocks, requests, variants=8)
        window.block_map.select_request(ids[0])
        bridge = window.bridge
        now = time.time()
        stats = stats_frame(num_kv_blocks=num_blocks, num_running=requests)
        t0 = now
        for _ in range(3):  # warm up: first image, grid, LUT, fonts
            bridge.mailbox.put_frame("blocks", frames[0])
            bridge.drain()
            window.repaint_views()
            window.refresh_labels()
            app.processEvents()
        drain_ms, total_ms = [], []
        for i in range(ticks):
            t = t0 + i / 30
            bridge.mailbox.put_frame("blocks", frames[i % len(frames)])
            bridge.mailbox.put_frame("step", step_frame(seq=i + 1, t=t, decode=requests,
                                                        running=requests))
            bridge.mailbox.put_frame("stats", stats_frame(seq=i + 1, t=t,
                                                          num_kv_blocks=num_blocks,
                                                          num_running=requests)
                                     if i % 8 == 0 else stats)
            bridge.mailbox.put_frame("heartbeat", heartbeat(seq=i + 1, busy=True))
            start = time.perf_counter()
            bridge.drain()
            mid = time.perf_counter()
            window.repaint_views()
            window.refresh_labels()
            app.processEvents()
            end = time.perf_counter()
            drain_ms.append(1e3 * (mid - start))
            total_ms.append(1e3 * (end - start))
        return {"blocks": num_blocks, "requests": requests, "ticks": ticks,
                "tick_ms_median": statistics.median(total_ms), "tick_ms_p95": pct(total_ms, .95),
                "tick_ms_max": max(total_ms), "drain_ms_median": statistics.median(drain_ms),
                "fps_budget_used_at_30hz": statistics.median(total_ms) / (1000 / 30)}
    finally:
        window.shutdown()
        window.close()
        window.deleteLater()
        app.processEvents()


# -- (b) ---------------------------------------------------------------------------------------
def throughput(serve_args, requests: int, max_tokens: int, reps: int, tmp: str) -> dict:
    from PySide6.QtWidgets import QApplication

    from benchmarks.ipc_bench import run_workload, start_server
    from ipc import EngineClient

    app = QApplication.instance()
    proc, cmd_ep, state_ep = start_server(serve_args, None)
    log(f"engine ready at {cmd_ep} ({' '.join(serve_args)})")
    client = EngineClient(cmd_ep, state_ep)
    hello = client.hello(timeout=60)
    rng = random.Random(0)
    words = ["the", "cache", "keeps", "keys", "and", "values", "of", "every", "token", "in",
             "fixed", "size", "blocks"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(8, 24)))
               for _ in range(requests)]
    out = {"headless": [], "gui": [], "gui_ticks": []}
    try:
        run_workload(client, prompts[:4], 8)  # warm up
        for rep in range(reps):
            for mode in ("headless", "gui"):
                if mode == "headless":
                    tps = run_workload(client, prompts, max_tokens)
                else:
                    window = make_window(tmp, attach=cmd_ep, attach_state=state_ep)
                    window.start()
                    deadline = time.monotonic() + 60
                    while window.hello is None and time.monotonic() < deadline:
                        app.processEvents()
                        time.sleep(0.005)
                    if window.hello is None:
                        raise SystemExit("the window did not attach")
                    window.block_map.select_request(None)
                    result: dict = {}

                    def drive(result=result):
                        result["tps"] = run_workload(client, prompts, max_tokens)

                    worker = threading.Thread(target=drive)
                    frames_before = window.bridge.frames_emitted
                    worker.start()
                    while worker.is_alive():  # the GUI's own event loop, 30 Hz repaints
                        app.processEvents()
                        time.sleep(0.002)
                    worker.join()
                    out["gui_ticks"].append(window.bridge.frames_emitted - frames_before)
                    window.shutdown()
                    window.close()
                    window.deleteLater()
                    app.processEvents()
                    tps = result["tps"]
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
    return {"model": str(hello.config.get("model")), "device": hello.config.get("device"),
            "requests": requests, "max_tokens": max_tokens, "reps": reps,
            "headless_tok_s": h, "gui_tok_s": g, "gui_over_headless": g / h,
            "headless_runs": out["headless"], "gui_runs": out["gui"],
            "gui_frames_emitted": out["gui_ticks"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--blocks", default="4096,32768", help="pool sizes for (a)")
    p.add_argument("--running", type=int, default=64, help="running requests for (a)")
    p.add_argument("--ticks", type=int, default=120)
    p.add_argument("--requests", type=int, default=16, help="(b): requests in the workload")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--skip-engine", action="store_true", help="only (a)")
    args, serve_args = p.parse_known_args(argv)
    if "--model" not in serve_args:
        serve_args = ["--model", "default", *serve_args]
    from PySide6.QtWidgets import QApplication

    QApplication.instance() or QApplication(["gui_bench"])
    report = {"qpa": os.environ.get("QT_QPA_PLATFORM"), "frame_time": [], "throughput": None}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.blocks.split(",")):
            r = gui_frame_time(n, args.running, args.ticks, tmp)
            log(f"{n} blocks: tick {r['tick_ms_median']:.2f} ms median")
            report["frame_time"].append(r)
        if not args.skip_engine:
            report["throughput"] = throughput(serve_args, args.requests, args.max_tokens,
                                              args.reps, tmp)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"(a) GUI main-thread time per tick (drain + block map + plots + labels + paint), "
          f"{args.running} running requests, QPA {report['qpa']}")
    print(f"{'blocks':>8} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'drain ms':>9} "
          f"{'of 33 ms':>9}")
    for r in report["frame_time"]:
        print(f"{r['blocks']:>8} {r['tick_ms_median']:>10.2f} {r['tick_ms_p95']:>8.2f} "
              f"{r['tick_ms_max']:>8.2f} {r['drain_ms_median']:>9.2f} "
              f"{100 * r['fps_budget_used_at_30hz']:>8.0f}%")
    t = report["throughput"]
    if t:
        print(f"\n(b) engine throughput, {t['requests']} requests x {t['max_tokens']} tokens, "
              f"greedy, ignore_eos, model {t['model']} on {t['device']}, median of {t['reps']}")
        print(f"{'headless tok/s':>15} {'GUI tok/s':>10} {'GUI/headless':>13}")
        print(f"{t['headless_tok_s']:>15.1f} {t['gui_tok_s']:>10.1f} "
              f"{t['gui_over_headless']:>13.3f}")
        print(f"runs: headless {[round(x, 1) for x in t['headless_runs']]}, "
              f"GUI {[round(x, 1) for x in t['gui_runs']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
