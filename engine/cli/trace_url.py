"""`kvscope trace replay TRACE --url URL`: the replay against an OpenAI-compatible server,
its progress on stderr and its report (parsing is engine/cli/trace.py's)."""
from __future__ import annotations

import argparse
import json
import sys

from kvscope.engine.traces.http_replay import (
    HttpReplayConfig,
    HttpReplayResult,
    Progress,
    replay_url_file,
)

EXIT_INTERRUPTED = 130


def config_from_args(args: argparse.Namespace, speed: float | None) -> HttpReplayConfig:
    return HttpReplayConfig(
        url=args.url, api_key=args.api_key or None,
        model=None if args.model == "default" else args.model, speed=speed,
        max_concurrency=args.max_concurrency, api=args.api or "completions",
        ignore_eos=args.ignore_eos, timeout_s=args.timeout_s,
        request_timeout_s=args.request_timeout_s, include_prompts=not args.no_prompts,
        prompt_seed=args.prompt_seed, hash_block_size=args.hash_block_size,
        vocab_size=args.vocab_size, tokenizer=args.tokenizer)


def _progress_printer(as_json: bool):
    def show(p: Progress) -> None:
        if as_json:
            print(json.dumps({"progress": {"done": p.done, "total": p.total,
                                           "errors": p.errors, "in_flight": p.in_flight}}),
                  file=sys.stderr, flush=True)
        elif sys.stderr.isatty():
            print(f"\r{p.done}/{p.total} done, {p.errors} failed, {p.in_flight} in flight ",
                  end="", file=sys.stderr, flush=True)
    return show


def report_lines(r: HttpReplayResult) -> list[str]:
    s = r.summary
    out = [f"replayed {s.requests} requests against {r.url} (model {r.model})"
           + (f" - {r.stopped}" if r.stopped else ""),
           f"  {s.finished} finished, {len(r.errors)} failed, {len(r.ended_early)} ended "
           f"before the recorded length; {s.output_tokens} output tokens in "
           f"{s.duration_s:.3g} s",
           f"  TTFT p50/p90/p99 {_ms(s.ttft_p50_ms)}/{_ms(s.ttft_p90_ms)}/{_ms(s.ttft_p99_ms)} "
           f"ms; ITL p50/p90/p99 {_ms(s.itl_p50_ms)}/{_ms(s.itl_p90_ms)}/{_ms(s.itl_p99_ms)} ms"]
    o = r.outputs
    out.append("  greedy outputs " + ("not compared: " + str(o.not_compared)
                                      if o.identical is None else
                                      ("identical" if o.identical else "differ: "
                                       + ", ".join(o.differing[:8]))
                                      + f" ({o.compared} compared)"))
    counts: dict[str, int] = {}
    for message in r.errors.values():
        counts[message] = counts.get(message, 0) + 1
    out += [f"  {n} x {message}" for message, n in sorted(counts.items(), key=lambda x: -x[1])]
    out.append(f"  -> {r.trace}")
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def cmd_replay_url(args: argparse.Namespace, speed: float | None) -> int:
    out = args.output
    if not out:  # replay.py imports the engine (torch): only when there is no -o
        from kvscope.engine.traces.replay import default_output_path

        out = default_output_path(args.trace)
    result = replay_url_file(args.trace, out, config_from_args(args, speed),
                             _progress_printer(args.progress))
    if not args.progress and sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print("\n".join(report_lines(result)))
    return EXIT_INTERRUPTED if result.stopped == "interrupted" else 0
