"""What `kvscope serve --kv-events` costs the engine thread per step, and how many events it sends.

    python -m kvscope.benchmarks.kv_events_cost [--quick] [--shared-prefix N] [--num-kv-blocks B]
        [--model default] [--json]

KV-event batches per step, events per second, and the time the engine thread spends per step
turning the block manager's records into a vLLM batch, encoding it and handing it to the
publisher thread, under `kvscope bench`'s workload (random prompts, optionally sharing a
prefix), with a live subscriber on loopback.

Costs are per-call wall times on this machine, to compare with the step time of the same run.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

from kvscope.benchmarks.bench import (
    DEFAULT_WORKLOAD,
    QUICK_WORKLOAD,
    build_workload,
    special_token_ids,
)
from kvscope.benchmarks.timing import add_json_flag, print_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv_events_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="a small pool evicts, so BlockRemoved events appear too")
    p.add_argument("--quick", action="store_true", help="bench's --quick workload")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with one of 4 shared prefixes of N tokens")
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    return p


def workload(args, engine):
    n, pmin, pmax, omin, omax = QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD
    n = args.requests or n
    vocab = engine.model.shape.vocab_size
    exclude = special_token_ids(engine.tokenizer)
    reqs = build_workload(args.seed, n, (pmin, pmax), (omin, omax), vocab, exclude)
    if args.shared_prefix:
        rng = random.Random(args.seed + 7)
        allowed = [t for t in range(vocab) if t not in exclude]
        prefixes = [[rng.choice(allowed) for _ in range(args.shared_prefix)] for _ in range(4)]
        for i, r in enumerate(reqs):
            r.prompt[:0] = prefixes[i % 4]
    return reqs


class Listener(threading.Thread):
    """A subscriber on the PUB socket, as a router or the window would be."""

    def __init__(self, endpoints) -> None:
        super().__init__(daemon=True)
        from kvscope.ipc.vllm_kv_subscriber import KVEventSubscriber

        self.sub = KVEventSubscriber(*endpoints)
        self.events = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self._count(self.sub.poll(50))
        self._count(self.sub.catch_up())
        self.sub.close()

    def _count(self, got) -> None:
        self.events += sum(len(b.events) for _, b in got)


def isolated_flush_us(engine, feed, block_size: int, n: int = 2000) -> float:
    """The same hand-over without the model running beside it: one typical batch (a prompt's
    4 new full blocks stored, 2 evicted), the median of n flushes."""
    from kvscope.engine.kv_cache.events import BlockCached, BlockUncached

    records = [BlockCached(10 + i, 9 + i if i else None, tuple(range(block_size)))
               for i in range(4)] + [BlockUncached(1), BlockUncached(2)]
    bm, times = engine.block_manager, []
    for _ in range(n):
        bm.cache_events.extend(records)
        t0 = time.perf_counter()
        feed.flush()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def drive(engine, reqs, flush=None):
    """Run the workload to the end; per-step (step, flush, flush-that-published) seconds."""
    from kvscope.engine import SamplingParams

    engine.reconfigure(block_size=engine.config.block_size)  # an empty, cold prefix cache
    for r in reqs:
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    step_s, flush_s, batch_s = [], [], []
    started = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        published = flush() if flush is not None else None
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        flush_s.append(t2 - t1)
        if published is not None:
            batch_s.append(t2 - t1)
    return step_s, flush_s, batch_s, time.perf_counter() - started


def run(args) -> dict:
    from kvscope.engine import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.server.kv_events import CacheEventFeed, KVEventPublisher, KVEventsConfig

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                    block_size=args.block_size,
                                    num_kv_blocks=args.num_kv_blocks))
    reqs = workload(args, engine)
    drive(engine, reqs)  # warm-up
    base_before = drive(engine, reqs)  # without --kv-events
    publisher = KVEventPublisher(KVEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"))
    publisher.start()
    listener = Listener(publisher.endpoints)
    listener.start()
    time.sleep(0.5)  # let the SUB connect; anything it misses it replays
    feed = CacheEventFeed(engine, publisher)
    step_s, flush_s, batch_s, wall = drive(engine, reqs, lambda: feed.flush())
    deadline = time.monotonic() + 30
    while publisher.sent + publisher.send_errors < feed.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    listener.stop.set()
    listener.join(30)
    batches, events, dropped, nbytes = feed.batches, feed.events, feed.dropped, publisher.bytes
    micro_us = isolated_flush_us(engine, feed, args.block_size)
    feed.close()
    base_after = drive(engine, reqs)  # the block manager of a new pool records nothing
    base_wall = (base_before[3] + base_after[3]) / 2
    batch_s = batch_s or [0.0]
    per_step_us = 1e6 * sum(flush_s) / len(flush_s)
    return {
        "model": args.model, "device": str(engine.device), "requests": len(reqs),
        "block_size": args.block_size, "num_kv_blocks": engine.block_manager.num_blocks,
        "shared_prefix": args.shared_prefix, "steps": len(step_s), "wall_s": wall,
        "batches": batches, "events": events, "dropped": dropped,
        "bytes": nbytes, "batches_per_step": batches / len(step_s),
        "events_per_step": events / len(step_s),
        "events_per_s": events / wall, "batches_per_s": batches / wall,
        "bytes_per_batch": nbytes / max(1, batches),
        "step_ms_mean": 1e3 * statistics.fmean(step_s),
        "publish_us_per_step": per_step_us,
        "publish_us_per_batch_p50": 1e6 * statistics.median(batch_s),
        "publish_us_per_batch_p99": 1e6 * sorted(batch_s)[int(0.99 * (len(batch_s) - 1))],
        "publish_us_per_event": 1e6 * sum(batch_s) / max(1, events),
        "publish_share_of_step": sum(flush_s) / sum(step_s),
        "isolated_publish_us_per_batch": micro_us,
        "wall_s_without_events": base_wall,
        "wall_ratio_with_events": wall / base_wall,
        "subscriber_events": listener.events,
        "subscriber_missed": listener.sub.counters.missed,
        "subscriber_replayed": listener.sub.counters.replayed,
    }


def format_table(r: dict) -> str:
    return "\n".join([
        (f"{r['model']} on {r['device']}: {r['requests']} requests, {r['steps']} steps in "
         f"{r['wall_s']:.1f} s, pool {r['num_kv_blocks']} blocks of {r['block_size']}, "
         f"shared prefix {r['shared_prefix']} tokens"),
        (f"  batches {r['batches']} ({r['batches_per_step']:.2f} per step, "
         f"{r['events_per_step']:.2f} events per step, "
         f"{r['batches_per_s']:.1f}/s), events {r['events']} ({r['events_per_s']:.1f}/s), "
         f"{r['bytes_per_batch']:.0f} bytes per batch, dropped {r['dropped']}"),
        (f"  engine thread: {r['publish_us_per_step']:.1f} us per step publishing "
         f"(per batch p50 {r['publish_us_per_batch_p50']:.1f} us, p99 "
         f"{r['publish_us_per_batch_p99']:.0f} us; {r['publish_us_per_event']:.1f} us per "
         f"event) vs a {r['step_ms_mean']:.1f} ms step: "
         f"{100 * r['publish_share_of_step']:.3f} % of the step time"),
        (f"  the same hand-over in isolation (4 blocks stored + 2 removed per batch): "
         f"{r['isolated_publish_us_per_batch']:.1f} us per batch (median)"),
        (f"  the whole workload: {r['wall_s']:.2f} s with --kv-events, "
         f"{r['wall_s_without_events']:.2f} s without (mean of a run before and after): "
         f"ratio {r['wall_ratio_with_events']:.3f}"),
        (f"  subscriber: {r['subscriber_events']} events, {r['subscriber_missed']} missed, "
         f"{r['subscriber_replayed']} replayed")])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print_result(run(args), format_table, args.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
