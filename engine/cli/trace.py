"""`kvscope trace replay|compare|export`: replay a session against another configuration,
compare two runs, and export a trace to Chrome trace-event JSON (ui.perfetto.dev)."""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

from kvscope.engine.cli.options import add_engine_options, engine_config_from_args
from kvscope.engine.traces.reader import Trace, outputs_of, read_trace
from kvscope.engine.traces.recorder import start_trace
from kvscope.engine.traces.schema import (
    Abort,
    Arrival,
    Finish,
    Preempt,
    Reconfigure,
    Step,
    Token,
    TraceError,
)

FULL_PRECISION = ("auto", "float32", "float16", "bfloat16")


# -- summary -------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(trace: Trace) -> dict:
    arrivals = trace.of_type(Arrival)
    steps = trace.of_type(Step)
    arrival_t = {a.id: a.t for a in arrivals}
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    itl: list[float] = []
    output_tokens = 0
    for ev in trace.of_type(Token):
        output_tokens += len(ev.tokens)
        if ev.id in last_token:
            itl.append(ev.t - last_token[ev.id])
        else:
            first_token[ev.id] = ev.t
        last_token[ev.id] = ev.t
    ttft = [first_token[i] - arrival_t[i] for i in first_token if i in arrival_t]
    ends = [s.t + s.dur for s in steps] + [e.t for e in trace.events]
    start = min(arrival_t.values(), default=0.0)
    duration = max(ends, default=start) - start
    bs = trace.header.block_size
    usage = [s.kv_used / s.kv_total for s in steps if s.kv_total]
    waste, block_size = [], bs
    for e in trace.events:  # the block size in force changes with a reconfigure
        if isinstance(e, Reconfigure):
            block_size = e.block_size
        elif isinstance(e, Step) and e.kv_used:
            waste.append(min(1.0, max(0.0, 1 - e.kv_tokens / (e.kv_used * block_size))))

    def ms(v):
        return None if v is None else v * 1000

    return {
        "model": trace.header.model, "block_size": bs, "kv_dtype": trace.header.kv_dtype,
        "kv_rotation": trace.header.kv_rotation,
        "num_kv_blocks": trace.header.num_kv_blocks,
        "requests": len(arrivals), "finished": len(trace.of_type(Finish)),
        "aborted": len(trace.of_type(Abort)), "steps": len(steps),
        "prompt_tokens": sum(a.prompt_len for a in arrivals), "output_tokens": output_tokens,
        "duration_s": duration,
        "throughput_tok_s": output_tokens / duration if duration > 0 else None,
        **{f"ttft_p{q}_ms": ms(percentile(ttft, q)) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": ms(percentile(itl, q)) for q in (50, 90, 99)},
        "preemptions": len(trace.of_type(Preempt)),
        "reconfigures": len(trace.of_type(Reconfigure)),
        "kv_usage_peak": max(usage, default=0.0),
        "kv_usage_mean": sum(usage) / len(usage) if usage else 0.0,
        "internal_waste_mean": sum(waste) / len(waste) if waste else 0.0,
        "truncated": trace.truncated,
    }


def print_summary(s: dict) -> None:
    for k, v in s.items():
        print(f"{k:>20}: {_fmt(v)}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


# -- replay --------------------------------------------------------------------------------
def load_workload(path: str):
    from kvscope.engine.traces.workload import is_mooncake, read_kvscope, read_mooncake

    if is_mooncake(path):
        return read_mooncake(path), None
    trace = read_trace(path)
    return read_kvscope(trace), trace


def replay(items, engine, out_path, speed: float | None, include_prompts: bool = True,
           prompt_seed: int = 0, hash_block_size: int = 512) -> dict:
    """Submit the arrivals (times scaled by 1/speed; all at once when speed is None)."""
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.traces.workload import synthesise_prompts

    synthesise_prompts(items, engine.model.shape.vocab_size, prompt_seed, hash_block_size)
    pending = sorted(items, key=lambda w: w.t)
    rejected: dict[str, str] = {}
    start_trace(engine, out_path, include_prompts)
    try:
        i, t0 = 0, time.monotonic()
        while i < len(pending) or engine.has_unfinished():
            now = time.monotonic() - t0
            while i < len(pending) and (speed is None or pending[i].t / speed <= now):
                w = pending[i]
                i += 1
                try:
                    engine.add_request(w.prompt, SamplingParams(**w.sampling), w.request_id)
                except (ValueError, TypeError) as exc:
                    rejected[w.request_id] = str(exc)
            if engine.has_unfinished():
                engine.step()
            elif i < len(pending):
                time.sleep(min(0.5, max(0.0, pending[i].t / speed - now)))
    finally:
        engine.stop_trace()
    return rejected


def compare_outputs(items, recorded: Trace | None, new: Trace, config) -> dict:
    """Whether every output matches the recorded one, where that comparison is meaningful."""
    why = None
    kv = (recorded.header.kv_dtype, new.header.kv_dtype) if recorded is not None else ()
    if recorded is None:
        why = "the input is a workload trace without outputs"
    elif not recorded.header.include_prompts:
        why = "the recorded trace has no prompts (--no-prompts)"
    elif any(float(w.sampling.get("temperature", 0.0)) != 0 for w in items):
        why = "not every request used greedy sampling"
    elif config.kv_dtype not in FULL_PRECISION or "int8" in kv or "fp8" in kv:
        why = "quantised KV (int8/fp8) changes outputs"
    elif recorded.header.dtype != new.header.dtype:
        why = (f"the model ran in {recorded.header.dtype} when recorded and in "
               f"{new.header.dtype} now")
    if why:
        return {"outputs_identical": None, "outputs_not_compared": why}
    finished = {e.id for e in recorded.of_type(Finish)}
    old, now = outputs_of(recorded), outputs_of(new)
    differing = sorted(i for i in finished if old.get(i) != now.get(i))
    return {"outputs_identical": not differing, "outputs_compared": len(finished),
            "outputs_differing": differing}


def cmd_replay(args) -> int:
    from kvscope.engine.llm_engine import LLMEngine

    speed = None if args.speed == "max" else float(args.speed)
    if speed is not None and not speed > 0:
        raise ValueError(f"--speed {args.speed} must be a positive number or 'max'")
    items, recorded = load_workload(args.trace)
    out = args.output or str(Path(args.trace).with_suffix("")) + ".replay.jsonl"
    if Path(out).resolve() == Path(args.trace).resolve():
        raise ValueError("-o must not be the input trace")
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    rejected = replay(items, engine, out, speed, not args.no_prompts, args.prompt_seed,
                      args.hash_block_size)
    new = read_trace(out)
    summary = {**summarize(new), "trace": out, "rejected": rejected,
               **compare_outputs(items, recorded, new, config)}
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0


# -- compare -------------------------------------------------------------------------------
def compare(a: dict, b: dict) -> dict:
    ratio = {}
    for k, va in a.items():
        vb = b.get(k)
        if isinstance(va, (int, float)) and not isinstance(va, bool) \
                and isinstance(vb, (int, float)) and not isinstance(vb, bool):
            ratio[k] = vb / va if va else None
    return {"a": a, "b": b, "ratio": ratio}


def cmd_compare(args) -> int:
    result = compare(summarize(read_trace(args.a)), summarize(read_trace(args.b)))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'':>20}  {'A':>12}  {'B':>12}  {'B/A':>8}")
    for k, va in result["a"].items():
        r = result["ratio"].get(k)
        print(f"{k:>20}  {_fmt(va):>12}  {_fmt(result['b'].get(k)):>12}  "
              f"{'' if r is None else f'{r:.3g}x':>8}")
    return 0


# -- export --------------------------------------------------------------------------------
def _us(t: float) -> int:
    return round(t * 1_000_000)


def to_chrome(trace: Trace) -> dict:
    """Chrome trace-event JSON: pid 1 is the engine (steps, counters), pid 2 the requests."""
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "engine"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "requests"}},
    ]
    state: dict[str, str] = {}

    def span(rid: str, new: str | None, t: float) -> None:
        old = state.pop(rid, None)
        if old is not None:
            ev.append({"ph": "e", "cat": "request", "name": old, "id": rid, "pid": 2,
                       "tid": 0, "ts": _us(t)})
        if new is None:
            ev.append({"ph": "e", "cat": "request", "name": rid, "id": rid, "pid": 2,
                       "tid": 0, "ts": _us(t)})
            return
        ev.append({"ph": "b", "cat": "request", "name": new, "id": rid, "pid": 2, "tid": 0,
                   "ts": _us(t)})
        state[rid] = new

    kv_total = trace.header.num_kv_blocks
    for e in trace.events:
        if isinstance(e, Arrival):
            ev.append({"ph": "b", "cat": "request", "name": e.id, "id": e.id, "pid": 2,
                       "tid": 0, "ts": _us(e.t), "args": {"prompt_len": e.prompt_len}})
            span(e.id, "queued", e.t)
        elif isinstance(e, Step):
            ev.append({"ph": "X", "name": "step", "cat": "engine", "pid": 1, "tid": 1,
                       "ts": _us(e.t), "dur": max(1, _us(e.dur)),
                       "args": {"batch_size": e.batch_size, "tokens": e.tokens,
                                "budget": e.budget}})
            ts = _us(e.t)
            ev.append({"ph": "C", "name": "batch_size", "pid": 1, "ts": ts,
                       "args": {"batch_size": e.batch_size}})
            ev.append({"ph": "C", "name": "tokens_per_step", "pid": 1, "ts": ts,
                       "args": {"tokens": e.tokens}})
            ev.append({"ph": "C", "name": "kv_usage", "pid": 1, "ts": ts,
                       "args": {"used_blocks": e.kv_used,
                                "usage": e.kv_used / (e.kv_total or kv_total or 1)}})
            for rid, _ in e.seqs:
                if state.get(rid) in ("queued", "preempted"):
                    span(rid, "prefill", e.t)
        elif isinstance(e, Token):
            if state.get(e.id) == "prefill":
                span(e.id, "decode", e.t)
        elif isinstance(e, Preempt):
            ev.append({"ph": "i", "name": "preempt", "cat": "engine", "pid": 1, "tid": 1,
                       "s": "p", "ts": _us(e.t), "args": {"request": e.id}})
            if e.id in state:
                span(e.id, "preempted", e.t)
        elif isinstance(e, (Finish, Abort)) and e.id in state:
            span(e.id, None, e.t)
    end = max((x["ts"] + x.get("dur", 0) for x in ev if "ts" in x), default=0)
    for rid in list(state):  # a trace cut short: close what is still open
        span(rid, None, end / 1_000_000)
    ev.sort(key=lambda x: x.get("ts", -1))  # stable: per-track order is kept
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "metadata": {"kvscope_model": trace.header.model,
                         "block_size": trace.header.block_size,
                         "kv_dtype": trace.header.kv_dtype,
                         "kv_rotation": trace.header.kv_rotation,
                         "wall_time": trace.header.wall_time}}


CSV_FIELDS = ["step", "t_us", "dur_us", "batch_size", "tokens", "budget", "kv_used",
              "kv_total", "kv_usage", "kv_tokens", "running", "waiting"]


def write_csv(trace: Trace, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for n, s in enumerate(trace.of_type(Step)):
            w.writerow([n, _us(s.t), _us(s.dur), s.batch_size, s.tokens, s.budget, s.kv_used,
                        s.kv_total, s.kv_used / s.kv_total if s.kv_total else 0, s.kv_tokens,
                        s.running, s.waiting])


def cmd_export(args) -> int:
    trace = read_trace(args.trace)
    Path(args.output).write_text(json.dumps(to_chrome(trace)))
    if args.csv:
        write_csv(trace, args.csv)
    print(f"wrote {args.output}" + (f" and {args.csv}" if args.csv else ""))
    return 0


# -- command line --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope trace", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a trace's arrivals against an engine config")
    r.add_argument("trace", help="a kvscope trace, or Mooncake-style JSONL")
    r.add_argument("--speed", default="1.0",
                   help="scale the inter-arrival times (2 = twice as fast), or 'max'")
    r.add_argument("-o", "--output", help="the new trace (default TRACE.replay.jsonl)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-prompts", action="store_true",
                   help="record prompt lengths only in the new trace")
    r.add_argument("--prompt-seed", type=int, default=0,
                   help="seed for prompts synthesised where the trace has none")
    r.add_argument("--hash-block-size", type=int, default=512,
                   help="tokens per Mooncake hash id (default 512)")
    add_engine_options(r)
    c = sub.add_parser("compare", help="two traces' summaries side by side")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json", action="store_true")
    e = sub.add_parser("export", help="Chrome trace-event JSON for ui.perfetto.dev")
    e.add_argument("trace")
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--csv", help="also write the per-step series as CSV")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    handler = {"replay": cmd_replay, "compare": cmd_compare, "export": cmd_export}
    try:
        return handler[args.command](args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"kvscope trace {args.command}: error: {exc}", file=sys.stderr)
        return 2
