"""A step of decodes plus one prompt chunk: the fused CPU decode (each prompt token a row,
engine/model/fused/rows.py) against the ordinary forward, on the same captured step.

    python -m kvscope.benchmarks.fused_mixed [--decodes 16] [--chunks 1 4 16 32 64 128]
        [--contexts 0 2048] [--repeats 7] [--kv-dtype float32] [--json]

For each (chunk, context): --decodes requests decode at about 200 tokens of context; one more
request is given a prompt of context + chunk tokens and prefilled until only `chunk` are
left, so the captured step holds the decodes and a chunk reading `context` earlier keys. The
step is then run through the model's forward with the fused decode on and off, alternating,
--repeats times each; the table has the median milliseconds and their ratio. It is what
MAX_ROWS and MAX_KEYS of engine/model/fused/rows.py stand on: the fused step wins while its ratio
is under 1.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from kvscope.benchmarks.timing import add_json_flag, print_result, progress_logger

log = progress_logger("fused-mixed")


def build_engine(args: argparse.Namespace):
    from kvscope.engine import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine

    longest = max(args.contexts) + max(args.chunks) + 64
    cfg = EngineConfig(model=args.model, device="cpu", kv_dtype=args.kv_dtype,
                       max_num_seqs=args.decodes + 2, enable_prefix_caching=True,
                       max_num_batched_tokens=max(512, max(args.chunks) + args.decodes),
                       max_prefill_tokens_while_decoding=0, max_model_len=longest + 256,
                       seed=args.seed)
    return LLMEngine(cfg)


def start_decodes(engine, args: argparse.Namespace, rng: random.Random) -> None:
    """--decodes requests, stepped until every one of them decodes."""
    from kvscope.engine import SamplingParams

    for _ in range(args.decodes):
        engine.add_request(random_prompt(rng, 200), SamplingParams(max_tokens=100_000,
                                                                   ignore_eos=True))
    for _ in range(4):
        engine.step()


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def measure(engine, args: argparse.Namespace, rng: random.Random, context: int, chunk: int
            ) -> dict[str, float]:
    """Median ms of the step holding the decodes and a `chunk`-token chunk after `context`
    cached tokens (a prefix-cache hit: the same prefix ran to completion first)."""
    from kvscope.engine import SamplingParams

    model = engine.model
    bs = engine.config.block_size
    prefix = random_prompt(rng, context // bs * bs)
    if prefix:
        rid = engine.add_request(prefix, SamplingParams(max_tokens=1))
        while not engine.pop_output(rid).finished:
            engine.step()
    probe = engine.add_request(prefix + random_prompt(rng, chunk),
                               SamplingParams(max_tokens=1))
    forward = model.forward
    found: dict[str, float] = {}

    def timed(ids, positions, meta, pool):
        step = (ids, positions, meta, pool)
        if not found:  # the first step after the probe came: it is in it
            fused, plain = [], []
            for _ in range(args.repeats):
                fused.append(time_forward(model, forward, step, True))
                plain.append(time_forward(model, forward, step, False))
            found["fused_ms"] = 1e3 * statistics.median(fused)
            found["plain_ms"] = 1e3 * statistics.median(plain)
            found["rows"] = float(len(ids))
        return forward(ids, positions, meta, pool)
    model.forward = timed
    try:
        while not engine.pop_output(probe).finished:
            engine.step()
    finally:
        model.forward = forward
    found["ratio"] = found["fused_ms"] / found["plain_ms"]
    return found


def time_forward(model, forward, step, fused: bool) -> float:
    """Seconds of one forward (`forward`: the model's own, not the hook) of the step."""
    model.fused_decode = fused
    try:
        t = time.perf_counter()
        forward(*step)
        return time.perf_counter() - t
    finally:
        model.fused_decode = True


def format_table(result: dict, repeats: int) -> str:
    lines = [f"{result['decodes']} decodes + one chunk ({result['kv_dtype']} KV), median of "
             f"{repeats}", "context  chunk  fused ms  ordinary ms  ratio"]
    lines += [f"{r['context']:>7}  {r['chunk']:>5}  {r['fused_ms']:>8.1f}  "
              f"{r['plain_ms']:>11.1f}  {r['ratio']:>5.2f}" for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvscope.benchmarks.fused_mixed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 2048])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kv-dtype", default="float32")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    return main_run(p.parse_args(argv))


def main_run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    engine = build_engine(args)
    if not engine.model.fused_decode:
        print(f"this model's decode does not fuse: {engine.model.fused_reason}")
        return 1
    start_decodes(engine, args, rng)
    rows = []
    for context in args.contexts:
        for chunk in args.chunks:
            got = measure(engine, args, rng, context, chunk)
            log(f"context {context}, chunk {chunk}: fused {got['fused_ms']:.1f} ms, "
                f"ordinary {got['plain_ms']:.1f} ms")
            rows.append({"context": context, "chunk": chunk, **got})
    result = {"decodes": args.decodes, "kv_dtype": args.kv_dtype, "rows": rows}
    print_result(result, lambda r: format_table(r, args.repeats), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
