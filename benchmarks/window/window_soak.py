"""A long window session: does the window's memory stay flat over an hour of frames?

    python -m benchmarks.window.window_soak --minutes 60 [--json]

A MainWindow (offscreen unless a display is set) fed synthetic engine state as fast as it
draws it (kvscope/testing/frames.py: blocks, step, stats and heartbeat frames; requests finish
and new ones arrive all the time, so per-request state that is never dropped shows up),
through the bridge's mailbox as a real engine's frames arrive. The resident set and the
number of live Python objects are sampled every --sample-s seconds; after a warm-up (the
plots' bounded histories filling up) both must stay flat. tests/app/test_window_long_session.py
runs the same session for tens of seconds.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import psutil

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
MIB = 2**20


def rolling_frames(num_blocks: int, running: int, tick: int, block_size: int = 16):
    """The blocks frame at `tick`: `running` requests, one leaving and a new one arriving
    every 10 ticks, each with its own scattered blocks."""
    from kvscope.testing.frames import blocks_frame

    first = tick // 10
    ids = [f"req-{first + k:07d}" for k in range(running)]
    rng = random.Random(first)
    perm = rng.sample(range(num_blocks), num_blocks)
    per = int(num_blocks * 0.8) // running
    tables = {rid: perm[i * per:(i + 1) * per] for i, rid in enumerate(ids)}
    filled = {t[-1]: 1 + tick % (block_size - 1) for t in tables.values()}
    return blocks_frame(num_blocks, block_size, tables, filled, seq=tick + 1)


def window_session(seconds: float, num_blocks: int = 1024, running: int = 16,
                   sample_s: float = 1.0, warmup_s: float | None = None) -> dict:
    """Feed a window frames for `seconds`; its memory and object counts over time."""
    from PySide6.QtWidgets import QApplication

    from benchmarks.window.gui_bench import make_window
    from kvscope.testing.frames import heartbeat, stats_frame, step_frame

    app = QApplication.instance() or QApplication([])
    proc = psutil.Process()
    warmup_s = seconds / 4 if warmup_s is None else warmup_s
    samples: list[tuple[float, int, int]] = []  # (t, rss, live objects)
    with tempfile.TemporaryDirectory() as tmp:
        window = make_window(tmp, (1280, 800), engine_args=[])
        try:
            bridge, tick = window.bridge, 0
            start = next_sample = time.monotonic()
            while (now := time.monotonic()) < start + seconds:
                t = time.time()
                bridge.mailbox.put_frame("blocks", rolling_frames(num_blocks, running, tick))
                bridge.mailbox.put_frame("step", step_frame(seq=tick + 1, t=t, decode=running,
                                                            running=running))
                bridge.mailbox.put_frame("stats", stats_frame(seq=tick + 1, t=t,
                                                              num_kv_blocks=num_blocks,
                                                              num_running=running))
                bridge.mailbox.put_frame("heartbeat", heartbeat(seq=tick + 1, busy=True))
                bridge.drain()
                window.frame_tick()
                app.processEvents()
                tick += 1
                if now >= next_sample:
                    gc.collect()  # what the window's GUI-thread collector does (app/gui_gc)
                    samples.append((now - start, proc.memory_info().rss,
                                    len(gc.get_objects())))
                    next_sample = now + sample_s
        finally:
            window.shutdown()
            window.close()
            window.deleteLater()
            app.processEvents()
    return summarize(samples, tick, seconds, warmup_s)


def summarize(samples, ticks: int, seconds: float, warmup_s: float) -> dict:
    after = [s for s in samples if s[0] >= warmup_s]
    head = after[:max(1, len(after) // 5)]
    tail = after[-max(1, len(after) // 5):]

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    return {"seconds": seconds, "ticks": ticks, "fps": ticks / seconds,
            "warmup_s": warmup_s, "rss_after_warmup_mib": med(head, 1) / MIB,
            "rss_end_mib": med(tail, 1) / MIB,
            "rss_growth_mib": (med(tail, 1) - med(head, 1)) / MIB,
            "objects_after_warmup": med(head, 2), "objects_end": med(tail, 2),
            "objects_growth": med(tail, 2) - med(head, 2),
            "samples": [(round(t, 1), r // MIB, n) for t, r, n in samples]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.window.window_soak",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--running", type=int, default=32)
    p.add_argument("--max-growth-mib", type=float, default=20.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = window_session(60 * args.minutes, args.blocks, args.running, sample_s=5.0)
    ok = out["rss_growth_mib"] < args.max_growth_mib
    if args.json:
        print(json.dumps({**out, "passed": ok}, indent=1))
    else:
        print(f"window session {args.minutes:g} min, {out['fps']:.0f} frames/s: rss "
              f"{out['rss_after_warmup_mib']:.0f} -> {out['rss_end_mib']:.0f} MiB "
              f"({out['rss_growth_mib']:+.1f}), objects {out['objects_after_warmup']:.0f} -> "
              f"{out['objects_end']:.0f}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
