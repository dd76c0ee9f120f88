"""What watching the engine costs: microseconds per call of each thing the monitoring samples.

    python -m kvscope.benchmarks.monitor_cost [--blocks 8192] [--requests 64] [--json]

A device sample, the KV totals behind /metrics, the stats dict, and rendering one /metrics
scrape, on a pool of --blocks blocks with --requests live requests (the engine thread pays the
first three; a scrape runs on the HTTP thread but holds the GIL while it renders).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from kvscope.benchmarks.timing import add_json_flag, per_call_seconds, print_result


def per_call_us(fn: Callable[[], object], n: int) -> float:
    """Mean microseconds of n back-to-back calls after one untimed call."""
    return per_call_seconds(fn, n) * 1e6


def format_table(result: dict) -> str:
    lines = [f"{result['blocks']} blocks, {result['used']} used by {result['requests']} requests"]
    lines += [f"  {name:<28} {us:9.1f} us" for name, us in result["us_per_call"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monitor_cost", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=8192)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--model", default="default")
    add_json_flag(p)
    args = p.parse_args(argv)
    from prometheus_client import generate_latest

    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.server import snapshots
    from kvscope.engine.server.device_monitor import DeviceMonitor
    from kvscope.engine.server.metrics import EngineMetrics, EngineState

    # int8 KV keeps a big pool small (8192 blocks of SmolLM2: 1.6 GB) on a CPU box.
    engine = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=args.blocks, kv_dtype="int8",
                                    block_size=16, max_num_batched_tokens=16384))
    for i in range(args.requests):
        engine.add_request([100 + (i + j) % 500 for j in range(200)],
                           SamplingParams(max_tokens=64))
    engine.step()  # admit and prefill
    monitor = DeviceMonitor(engine)
    metrics = EngineMetrics(engine.config.model, engine.max_model_len,
                            engine.config.max_num_batched_tokens)
    metrics.publish(EngineState(engine.stats(), snapshots.block_totals(engine),
                                monitor.sample()))
    rows = {"device sample (1 Hz)": per_call_us(monitor.sample, 200),
            "KV totals (1 Hz)": per_call_us(lambda: snapshots.block_totals(engine), 200),
            "engine.stats() (<= 20 Hz)": per_call_us(engine.stats, 2000),
            "render one scrape": per_call_us(lambda: generate_latest(metrics.registry), 200)}
    result = {"blocks": args.blocks, "used": engine.block_manager.num_used_blocks,
              "requests": args.requests, "us_per_call": rows}
    print_result(result, format_table, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
