"""An interactive chat beside a batch: what priority scheduling buys the chat, and what it
costs the batch (issue 26).

    python -m benchmarks.serving.priority_latency [--seconds S] [--json] [serve options]

One real `kvscope serve --http-port 0` subprocess. Under each --policies entry (switched with
a ZeroMQ `reconfigure`, the server and its model stay), three phases of --seconds each:

* idle: the foreground alone: a short chat message every --fg-interval seconds (open loop:
  one goes out on time even when the last is still streaming), --fg-tokens tokens out
  (ignore_eos, so exactly that many), streamed, at priority --fg-priority (-1, as the window's
  chat);
* alone: the background alone: --bg-streams streamed /v1/completions in a closed loop (each
  sends its next request when the last ended), prompts of --bg-min-words..--bg-max-words
  random words, --bg-tokens tokens out, at priority 0;
* beside: both at once; under "priority", once per --lower-tokens value (the server's
  priority_lower_tokens, switched in place: 0 = protected steps off) and --step-stretch value
  (priority_step_stretch), against the same idle and alone phases (neither has two
  priorities live, so the knobs do not act in them).

The alone and beside phases run over one background that runs throughout, in --cycles
alternating windows (seconds / cycles each; mirrored order every other round: alone, beside
| beside, alone | ...). Measured as two phases one after the other, the ratio moved with
what the machine did in between (the background alone's rate moved by a third between runs
on 2026-12-06) and with where the 16 streams stood in their prompt/answer cycle when
a window began (every stream starts with its prompt at once); alternating windows over one
steady background give both phases the same share of each. Between the idle and the
background phases, and after each beside window, the benchmark waits out the server's
priority_hold_s (protected steps go on that long after the last chat), so no alone window
runs protected steps; the chats of a beside window finish before the next window begins.

The background is measured from when every stream is producing (at most BG_READY_S
later: the table says how many were); a window's chats may end after it, and the background
is not counted then.

Reported: the foreground's TTFT (request sent -> first content chunk) and ITL (gaps between
content chunks) p50/p99, client side, and the background's throughput two ways: output
(content chunks per second in the phase's windows: one token each, for the plain-ASCII words
used here) and work: the tokens the server computed in the windows (its
`iteration_tokens_total` sum, prompt and output), less the chat's, at what a chat cost in
the idle phase (that phase's tokens per chat). A request's prompt and answer can fall in
different windows, so output alone carries over from window to window; computed tokens do
not, but a short window still starts from what the one before it left (20-second windows
read 0.95-1.00x where 80-second ones read 0.87x: docs/scheduling.md). Then the targets: TTFT
p99 beside <= 1.5x idle, ITL p99 beside <= 2x idle, background beside >= 0.9x alone (both
ways). p99 of a short phase is close to its maximum: --seconds 60+ for numbers to quote,
longer windows for the background's steady state.
The server's preemptions by reason during each phase come from its /metrics.

Options not listed below go to `kvscope serve` (--model, --device, --max-num-seqs, ...).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.serving.ipc_bench import start_server
from benchmarks.serving.priority_load import (
    Load,
    Samples,
    add_load_options,
    all_producing,
    background_worker,
    foreground,
    stop,
)
from kvscope.engine.measure.timing import add_json_flag, percentile, print_result, progress_logger

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = progress_logger("priority_latency")
# beside / idle (alone); the background's computed tokens (prompt + output) are reported and
# judged beside its output tokens, which carry over between windows
TARGETS = {"ttft_p99": 1.5, "itl_p99": 2.0, "bg_tokens_per_s": 0.9, "bg_work_per_s": 0.9}
SETTINGS_SHOWN = ("scheduling_policy", "max_num_seqs", "max_num_batched_tokens",
                  "max_prefill_tokens_while_decoding", "priority_lower_tokens", "priority_hold_s",
                  "priority_step_stretch")


async def phase(url: str, load: Load, seconds: float, fg: bool, bg: bool) -> dict:
    """One phase on its own (the warm-up, and the idle chat: no background)."""
    out = Samples()
    workers = [asyncio.create_task(background_worker(url, load, w, out))
               for w in range(load.bg_streams if bg else 0)]
    try:
        producing = await all_producing(load, out) if bg else None
        start = time.perf_counter()
        if fg:  # the last chats may end after the window; the background is not counted then
            await foreground(url, load, seconds, out)
        else:
            await asyncio.sleep(seconds)
    finally:
        await stop(workers)
    return summary(out, [(start, start + seconds)] if bg else [], producing)


def gaps_by_overlap(chats: list[list[float]]) -> tuple[list[float], list[float]]:
    """The chats' ITL gaps split in two: those inside which another chat's first token
    arrived (its prefill ran in the gap: the open loop sends the next message while a slow
    reply still streams), and the rest."""
    firsts = sorted(c[0] for c in chats if c)
    spanning, apart = [], []
    for chat in chats:
        for a, b in itertools.pairwise(chat):
            i = bisect.bisect_right(firsts, a)
            (spanning if i < len(firsts) and firsts[i] <= b else apart).append(b - a)
    return spanning, apart


def summary(out: Samples, windows: list[tuple[float, float]], producing: int | None) -> dict:
    """A phase's numbers: the foreground's percentiles, the background's chunks per second
    inside its windows (None: no background)."""
    seconds = sum(end - start for start, end in windows)
    chunks = sum(1 for t in out.bg_chunks for start, end in windows if start <= t <= end)
    spanning, apart = gaps_by_overlap(out.chats)
    return {"itl_spanning_prefill": len(spanning),
            "itl_p99_apart_s": percentile(apart, 0.99),
            "itl_max_spanning_s": max(spanning, default=None),
            "seconds": seconds, "windows": len(windows), "bg_streams_producing": producing,
            "fg_requests": out.fg_requests,
            "ttft_p50_s": percentile(out.ttft, 0.5), "ttft_p99_s": percentile(out.ttft, 0.99),
            "itl_p50_s": percentile(out.itl, 0.5), "itl_p99_s": percentile(out.itl, 0.99),
            "bg_tokens_per_s": chunks / seconds if windows else None}


async def interleaved(url: str, load: Load, seconds: float, cycles: int, hold_s: float,
                      besides: dict[str, Callable[[], None]]) -> dict[str, dict]:
    """The background alone and beside the chat, in alternating windows over one background
    that runs throughout: `cycles` rounds of one window each (seconds / cycles long), in
    mirrored order every other round (alone, b1, b2 | b2, b1, alone | ...), so drift on a
    shared machine and where the closed-loop streams are in their prompt/answer cycle hit
    every phase alike. `besides`: each beside phase's setup (a reconfigure), run before its
    windows. After a beside window the chats in flight finish and the server's protected
    steps run out (`hold_s`) before the next window starts; those seconds count nowhere."""
    bg = Samples()
    fg = {name: Samples() for name in besides}
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in ["alone", *besides]}
    pre: dict[str, dict[str, float]] = {name: {} for name in windows}
    computed = dict.fromkeys(windows, 0.0)
    interrupted = dict.fromkeys(windows, 0.0)
    metrics_url = url.removesuffix("/v1") + "/metrics"
    workers = [asyncio.create_task(background_worker(url, load, w, bg))
               for w in range(load.bg_streams)]
    try:
        producing = await all_producing(load, bg)
        width = seconds / cycles
        order = list(windows)
        for c in range(cycles):
            for name in order if c % 2 == 0 else order[::-1]:
                if name in besides:
                    besides[name]()
                before = server_counts(metrics_url)
                start = time.perf_counter()
                # read at the window's end: a beside window's last chats end after it
                end = asyncio.create_task(counts_at(metrics_url, start + width))
                if name == "alone":
                    await asyncio.sleep(width)
                else:
                    await foreground(url, load, width, fg[name])
                windows[name].append((start, start + width))
                after = await end
                computed[name] += after.tokens - before.tokens
                interrupted[name] += after.interrupted - before.interrupted
                for reason, n in after.preemptions.items():
                    pre[name][reason] = pre[name].get(reason, 0.0) + n \
                        - before.preemptions.get(reason, 0.0)
                if name != "alone":
                    await asyncio.sleep(hold_s)
    finally:
        await stop(workers)
    out = {}
    for name, spans in windows.items():
        samples = fg.get(name, Samples())
        samples.bg_chunks = bg.bg_chunks
        out[name] = {**summary(samples, spans, producing), "preemptions": pre[name],
                     "tokens_computed": computed[name], "interrupted_steps": interrupted[name]}
    return out


@dataclass(frozen=True)
class ServerCounts:
    preemptions: dict[str, float]  # kvscope:num_preemptions_total by reason
    tokens: float  # tokens computed in all steps (iteration_tokens_total's sum)
    interrupted: float = 0.0  # steps an arriving chat cut short (interrupted_steps_total)


def server_counts(metrics_url: str) -> ServerCounts:
    """The counters the benchmark reads from the API's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    out: dict[str, float] = {}
    tokens = interrupted = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvscope:num_preemptions_total":
                reason = s.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + s.value
            elif s.name == "kvscope:iteration_tokens_total_sum":
                tokens += s.value
            elif s.name == "kvscope:interrupted_steps_total":
                interrupted += s.value
    return ServerCounts(out, tokens, interrupted)


async def counts_at(metrics_url: str, when: float) -> ServerCounts:
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    return await asyncio.to_thread(server_counts, metrics_url)


def background_work(idle: dict, phase: dict) -> float | None:
    """Tokens per second the server computed for the background in a phase's windows: all it
    computed there less the chats', each chat at what one cost in the idle phase (its prompt
    past the prefix cache and its answer)."""
    if not phase.get("seconds") or idle.get("tokens_computed") is None:
        return None
    per_chat = idle["tokens_computed"] / idle["fg_requests"] if idle["fg_requests"] else 0.0
    return (phase["tokens_computed"] - per_chat * phase["fg_requests"]) / phase["seconds"]


def measured(url: str, load: Load, seconds: float, fg: bool, bg: bool) -> dict:
    metrics_url = url.removesuffix("/v1") + "/metrics"
    before = server_counts(metrics_url)
    result = asyncio.run(phase(url, load, seconds, fg, bg))
    after = server_counts(metrics_url)
    result["preemptions"] = {r: after.preemptions[r] - before.preemptions.get(r, 0.0)
                             for r in after.preemptions}
    result["tokens_computed"] = after.tokens - before.tokens
    result["interrupted_steps"] = after.interrupted - before.interrupted
    return result


def ratios(idle: dict, alone: dict, beside: dict) -> dict:
    def ratio(new, old):
        return None if new is None or not old else new / old

    got = {"ttft_p99": ratio(beside["ttft_p99_s"], idle["ttft_p99_s"]),
           "itl_p99": ratio(beside["itl_p99_s"], idle["itl_p99_s"]),
           "bg_tokens_per_s": ratio(beside["bg_tokens_per_s"], alone["bg_tokens_per_s"]),
           "bg_work_per_s": ratio(beside.get("bg_work_per_s"), alone.get("bg_work_per_s"))}
    meets = {k: v is not None and (v >= TARGETS[k] if k.startswith("bg_")
                                   else v <= TARGETS[k]) for k, v in got.items()}
    return {"ratios": got, "meets": meets}


def beside_setups(client, policy: str, lower_tokens: list[int] | None,
                  stretches: list[float] | None = None
                  ) -> dict[str, tuple[Callable[[], None], dict]]:
    """The beside phases: one, or under "priority" one per priority_lower_tokens value and
    priority_step_stretch value (the server's settings switched in place before each of its
    windows), each with the settings it switches to."""
    if policy != "priority" or not (lower_tokens or stretches):
        return {"beside": (lambda: None, {})}
    out = {}
    for n in lower_tokens or [None]:
        for x in stretches or [None]:
            changes = {k: v for k, v in (("priority_lower_tokens", n),
                                         ("priority_step_stretch", x)) if v is not None}
            name = "beside:" + "x".join(f"{v:g}" for v in changes.values())
            out[name] = ((lambda c=changes: client.reconfigure(**c)), changes)
    return out


def bench(serve_args: list[str], policies: list[str], load: Load, seconds: float,
          threads: int | None, lower_tokens: list[int] | None = None,
          cycles: int = 3, stretches: list[float] | None = None) -> dict:
    from kvscope.ipc import EngineClient

    proc, command, state = start_server(["--http-port", "0", *serve_args], threads)
    out: dict = {}
    try:
        with EngineClient(command, state, timeout=600, heartbeat_timeout=60) as client:
            url = client.hello().http_url
            log(f"warm-up; the API is at {url}")
            asyncio.run(phase(url, load, min(2.0, seconds), fg=True, bg=True))
            for policy in policies:
                settings = client.reconfigure(scheduling_policy=policy)
                defaults = {k: getattr(settings, k, None) for k in
                            ("priority_lower_tokens", "priority_step_stretch")}
                runs = {}
                log(f"{policy}: idle ({seconds:g} s)")
                runs["idle"] = measured(url, load, seconds, True, False)
                # the alone baseline at full batch: after the hold the idle chats started
                time.sleep(getattr(settings, "priority_hold_s", 0.0))
                phases = beside_setups(client, policy, lower_tokens, stretches)
                besides = {name: setup for name, (setup, _) in phases.items()}
                log(f"{policy}: alone and {', '.join(besides)} in {cycles} alternating rounds "
                    f"({seconds:g} s each)")
                runs.update(asyncio.run(interleaved(
                    url, load, seconds, cycles, getattr(settings, "priority_hold_s", 0.0),
                    besides)))
                for name in runs:
                    if name != "idle":
                        runs[name]["bg_work_per_s"] = background_work(runs["idle"], runs[name])
                if policy == "priority" and (lower_tokens or stretches):
                    client.reconfigure(**{k: v for k, v in defaults.items() if v is not None})
                for name in [n for n in runs if n.startswith("beside")]:
                    key = policy if name == "beside" else f"{policy}:{name[7:]}"
                    out[key] = {"idle": runs["idle"], "alone": runs["alone"],
                                "beside": runs[name],
                                **ratios(runs["idle"], runs["alone"], runs[name]),
                                "settings": {k: getattr(settings, k, None) for k in
                                             SETTINGS_SHOWN}}
                    out[key]["settings"].update(phases[name][1])
    finally:
        proc.terminate()
        proc.wait(30)
    return {"seconds": seconds, "cycles": cycles,
            "load": {**load.__dict__, "bg_words": list(load.bg_words)},
            "targets": TARGETS, "policies": out}


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _ratio(r: dict, key: str) -> str:
    v, ok = r["ratios"].get(key), r["meets"].get(key)
    return "-" if v is None else f"{v:.2f}x {'ok' if ok else 'MISSED'}"


def table(result: dict) -> str:
    load = result["load"]
    lines = [f"foreground: a chat every {load['fg_interval']} s, {load['fg_tokens']} tokens, "
             f"priority {load['fg_priority']}; background: {load['bg_streams']} streams, "
             f"{load['bg_words'][0]}-{load['bg_words'][1]} words, {load['bg_tokens']} tokens; "
             f"{result['seconds']:g} s per phase (the background's in "
             f"{result.get('cycles', 1)} alternating windows)",
             f"{'policy':12s}{'phase':8s}{'TTFT p50':>9s}{'p99':>7s}{'ITL p50':>9s}{'p99':>7s}"
             f"{'bg tok/s':>10s}{'bg work/s':>10s}{'fg reqs':>9s}  preemptions (memory/priority)"
             "  bg streams producing at the start"]
    shown = None  # the idle and alone phases a priority_lower_tokens sweep shares: once
    for policy, r in result["policies"].items():
        names = ["idle", "alone", "beside"]
        if shown == (r["idle"], r["alone"]):
            names = ["beside"]
        shown = (r["idle"], r["alone"])
        for name in names:
            p = r[name]
            bg = "-" if p["bg_tokens_per_s"] is None else f"{p['bg_tokens_per_s']:.1f}"
            work = "-" if p.get("bg_work_per_s") is None else f"{p['bg_work_per_s']:.0f}"
            pre = p["preemptions"]
            lines.append(f"{policy:12s}{name:8s}{_ms(p['ttft_p50_s']):>9s}"
                         f"{_ms(p['ttft_p99_s']):>7s}{_ms(p['itl_p50_s']):>9s}"
                         f"{_ms(p['itl_p99_s']):>7s}{bg:>10s}{work:>10s}"
                         f"{p['fg_requests']:>9d}  "
                         f"{pre.get('memory', 0):.0f}/{pre.get('priority', 0):.0f}"
                         + ("" if p["bg_streams_producing"] is None
                            else f"  {p['bg_streams_producing']}/{load['bg_streams']}"))
            if p.get("itl_spanning_prefill"):
                lines.append(f"{'':20s}{p['itl_spanning_prefill']} ITL gaps spanned another "
                             f"chat's prefill (longest {_ms(p['itl_max_spanning_s'])}); "
                             f"ITL p99 of the rest {_ms(p['itl_p99_apart_s'])}")
        lines.append(f"{'':12s}targets: TTFT p99 {_ratio(r, 'ttft_p99')} (<= 1.5x idle), "
                     f"ITL p99 {_ratio(r, 'itl_p99')} (<= 2x idle), background "
                     f"{_ratio(r, 'bg_tokens_per_s')} out, {_ratio(r, 'bg_work_per_s')} "
                     "computed (>= 0.9x alone)")
    lines.append("times in ms, client side; p99 of a short phase is about its maximum; bg "
                 "work: prompt + output tokens computed for the background")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.priority_latency",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_flag(p, "one JSON object on stdout (the table goes to stderr)")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="length of each phase (three per policy; default 30)")
    p.add_argument("--cycles", type=int, default=3,
                   help="alternating rounds the background phases are measured in "
                        "(alone and beside, over one running background; default 3)")
    p.add_argument("--policies", default="fcfs,priority",
                   help="comma-separated scheduling policies to compare")
    p.add_argument("--lower-tokens", default="",
                   help="comma-separated priority_lower_tokens values: under priority, one "
                        "beside phase for each (default: the server's setting only)")
    p.add_argument("--step-stretch", default="",
                   help="comma-separated priority_step_stretch values: under priority, one "
                        "beside phase for each (and each --lower-tokens value)")
    add_load_options(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the server (torch threads)")
    args, serve_args = p.parse_known_args(argv)
    problems = [f"--{name.replace('_', '-')} must be > 0" for name in
                ("seconds", "cycles", "fg_interval", "fg_tokens", "bg_streams",
                 "bg_min_words", "bg_tokens") if not getattr(args, name) > 0]
    if args.bg_max_words < args.bg_min_words:
        problems.append("--bg-max-words must be >= --bg-min-words")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    try:
        lower_tokens = [int(x) for x in args.lower_tokens.split(",") if x.strip()]
    except ValueError:
        lower_tokens = [-1]
    if any(n < 0 for n in lower_tokens):
        problems.append("--lower-tokens must be integers >= 0")
    try:
        stretches = [float(x) for x in args.step_stretch.split(",") if x.strip()]
    except ValueError:
        stretches = [0.0]
    if any(not 1 <= x < float("inf") for x in stretches):
        problems.append("--step-stretch must be numbers >= 1")
    if not policies:
        problems.append("--policies names no policy")
    if problems:
        print(f"priority_latency: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    load = Load(args.fg_interval, args.fg_tokens, args.fg_priority, args.bg_streams,
                (args.bg_min_words, args.bg_max_words), args.bg_tokens, args.seed)
    result = bench(serve_args, policies, load, args.seconds, args.server_threads,
                   lower_tokens, args.cycles, stretches)
    print_result(result, table, args.json, table_to_stderr=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
