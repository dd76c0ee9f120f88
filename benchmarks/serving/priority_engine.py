"""The chat beside a batch inside one engine, without the server: what protected steps cost
the background in the engine's own steps (issue 26).

    python -m benchmarks.serving.priority_engine [--seconds S] [--cycles N] [--json]
        [engine options: --priority-lower-tokens N, --priority-hold-s S, ...]

The load of benchmarks/priority_latency.py, fed to an `LLMEngine` stepped in this process: a
closed loop of --bg-streams background requests (prompts of --bg-min-words..--bg-max-words
random words, --bg-tokens out, priority 0), and in the beside windows a chat every
--fg-interval seconds (--fg-tokens out, priority -1, the chat template). Alone and beside
alternate over one background that runs throughout, --cycles windows of --seconds / cycles
each, in mirrored order every other round; after each beside window the engine runs on until
its protected steps end (priority_hold_s after the last chat). Reported per phase: the
background's output tok/s (tokens of its requests out during the windows) and the tokens
computed for it (prompt and output: output alone carries over between windows, a request's
prompt in one and its answer in the next), the median step time and the steps per second,
and per window, so the pairs can be compared one by one.

priority_latency measures what a person sees over HTTP, with the API server and the client on
the same cores; this one leaves both out, so the difference between the two ratios is what
the serving path costs per step (protected steps are many and small).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

from benchmarks.serving.priority_load import TOPICS, WORDS, add_load_options
from kvscope.engine.measure.timing import add_json_flag, progress_logger, run_benchmark

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = progress_logger("priority_engine")


@dataclass
class Window:
    bg_tokens: int = 0
    seconds: float = 0.0
    steps: list[float] = field(default_factory=list)
    chats: int = 0
    bg_work: int = 0  # tokens computed for the background: prompt and output

    def summary(self) -> dict:
        return {"bg_tok_s": self.bg_tokens / self.seconds if self.seconds else 0.0,
                "bg_work_s": self.bg_work / self.seconds if self.seconds else 0.0,
                "steps_per_s": len(self.steps) / self.seconds if self.seconds else 0.0,
                "median_step_ms": 1e3 * statistics.median(self.steps) if self.steps else None,
                "chats": self.chats}


class Load:
    """The background's closed loop and the chats, on one engine."""

    def __init__(self, engine, tokenizer, args: argparse.Namespace) -> None:
        from kvscope.engine import SamplingParams

        self.engine, self.tok, self.args = engine, tokenizer, args
        self.rng = random.Random(args.load_seed)
        self.bg_params = SamplingParams(max_tokens=args.bg_tokens, ignore_eos=True)
        self.fg_params = SamplingParams(max_tokens=args.fg_tokens, ignore_eos=True,
                                        priority=args.fg_priority)
        self.background: set[str] = set()
        self.computed: dict[str, int] = {}  # a background request's tokens computed so far
        self.chats: set[str] = set()
        self.asked = 0

    def refill(self) -> None:
        while len(self.background) < self.args.bg_streams:
            n = self.rng.randint(self.args.bg_min_words, self.args.bg_max_words)
            text = " ".join(self.rng.choice(WORDS) for _ in range(n))
            self.background.add(self.engine.add_request(self.tok.encode(text), self.bg_params))

    def ask(self) -> None:
        topic = TOPICS[self.asked % len(TOPICS)]
        ids = self.tok.apply_chat_template(
            [{"role": "user", "content": f"Say a few words about {topic}."}],
            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        self.chats.add(self.engine.add_request(ids, self.fg_params))
        self.asked += 1

    def background_work(self) -> int:
        """Tokens computed for the background since the last call: its requests' progress
        (a preempted request starts over, and its recomputed tokens count as work too)."""
        work = 0
        for rid in self.background:
            seq = self.engine.requests.get(rid)
            if seq is None:
                continue
            now, last = seq.num_computed_tokens, self.computed.get(rid, 0)
            work += max(0, now - last)
            self.computed[rid] = now
        return work

    def run(self, seconds: float, chat: bool, window: Window | None = None) -> None:
        """Step for `seconds` (chats asked in that time when `chat`, and stepped until they
        end); background tokens out within the seconds count into `window`."""
        start = time.perf_counter()
        next_chat = start
        while True:
            now = time.perf_counter()
            inside = now - start < seconds
            if not inside and not (chat and self.chats):
                break
            if chat and inside and now >= next_chat:
                self.ask()
                next_chat += self.args.fg_interval
                if window is not None:
                    window.chats += 1
            t = time.perf_counter()
            out = self.engine.step()
            if window is not None and inside:
                window.steps.append(time.perf_counter() - t)
            work = self.background_work()
            if window is not None and time.perf_counter() - start <= seconds:
                window.bg_work += work
            for d in out.outputs:
                if d.request_id in self.background:
                    if window is not None and time.perf_counter() - start <= seconds:
                        window.bg_tokens += len(d.token_ids)
                    if d.finished:
                        self.background.discard(d.request_id)
                        self.computed.pop(d.request_id, None)
                        self.engine.pop_output(d.request_id)
                elif d.finished:
                    self.chats.discard(d.request_id)
                    self.engine.pop_output(d.request_id)
            self.refill()
        if window is not None:
            window.seconds += seconds


def run(args: argparse.Namespace) -> dict:
    from kvscope.engine import LLM
    from kvscope.engine.cli.options import engine_config_from_args
    from kvscope.engine.config import resolve_device, resolve_dtype
    from kvscope.engine.loading.loader import load_model

    config = replace(engine_config_from_args(args), scheduling_policy="priority")
    loaded = load_model(config.model, resolve_dtype(config.dtype, resolve_device(config.device)))
    load = Load(LLM(config, loaded).engine, loaded.tokenizer, args)
    load.refill()
    log(f"warm-up ({args.warmup_s:g} s)")
    load.run(args.warmup_s, chat=False)
    width = args.seconds / args.cycles
    windows: dict[str, list[Window]] = {"alone": [], "beside": []}
    for c in range(args.cycles):
        for name in ("alone", "beside") if c % 2 == 0 else ("beside", "alone"):
            log(f"round {c + 1}: {name} ({width:g} s)")
            w = Window()
            load.run(width, chat=name == "beside", window=w)
            windows[name].append(w)
            if name == "beside":
                load.run(config.priority_hold_s, chat=False)  # protected steps run out
    phases = {}
    for name, ws in windows.items():
        total = Window(sum(w.bg_tokens for w in ws), sum(w.seconds for w in ws),
                       [s for w in ws for s in w.steps], sum(w.chats for w in ws),
                       sum(w.bg_work for w in ws))
        phases[name] = {**total.summary(), "windows": [w.summary() for w in ws]}
    alone, beside = phases["alone"]["bg_tok_s"], phases["beside"]["bg_tok_s"]
    return {"seconds": args.seconds, "cycles": args.cycles,
            "lower_tokens": config.priority_lower_tokens,
            "hold_s": config.priority_hold_s, "phases": phases,
            "bg_ratio": beside / alone if alone else None,
            "bg_work_ratio": (phases["beside"]["bg_work_s"] / phases["alone"]["bg_work_s"]
                              if phases["alone"]["bg_work_s"] else None),
            "pair_ratios": [b.summary()["bg_tok_s"] / a.summary()["bg_tok_s"]
                            if a.bg_tokens else None
                            for a, b in zip(windows["alone"], windows["beside"], strict=True)]}


def table(r: dict) -> str:
    lines = [f"{r['seconds']:g} s a phase in {r['cycles']} alternating windows; "
             f"priority_lower_tokens {r['lower_tokens']}, hold {r['hold_s']:g} s",
             f"{'phase':8s}{'bg tok/s':>10s}{'work/s':>8s}{'steps/s':>9s}{'step p50 ms':>13s}"
             f"{'chats':>7s}"
             "  per window bg tok/s"]
    for name, p in r["phases"].items():
        per = ", ".join(f"{w['bg_tok_s']:.1f}" for w in p["windows"])
        step = "-" if p["median_step_ms"] is None else f"{p['median_step_ms']:.1f}"
        lines.append(f"{name:8s}{p['bg_tok_s']:>10.1f}{p['bg_work_s']:>8.0f}"
                     f"{p['steps_per_s']:>9.1f}{step:>13s}"
                     f"{p['chats']:>7d}  {per}")
    ratio = "-" if r["bg_ratio"] is None else f"{r['bg_ratio']:.2f}x"
    pairs = ", ".join("-" if x is None else f"{x:.2f}" for x in r["pair_ratios"])
    work = "-" if r["bg_work_ratio"] is None else f"{r['bg_work_ratio']:.2f}x"
    lines.append(f"background beside / alone: {ratio} out (window by window: {pairs}), "
                 f"{work} computed (prompt + output)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from kvscope.engine.cli.options import add_engine_options

    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.priority_engine",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="seconds a phase (default 60)")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--warmup-s", type=float, default=25.0)
    add_load_options(p)
    p.add_argument("--load-seed", type=int, default=0, help="seed of the background prompts")
    add_json_flag(p)
    add_engine_options(p)
    args = p.parse_args(argv)
    problems = [f"--{n.replace('_', '-')} must be > 0" for n in
                ("seconds", "cycles", "fg_interval", "fg_tokens", "bg_streams", "bg_min_words",
                 "bg_tokens") if not getattr(args, n) > 0]
    if args.warmup_s < 0:
        problems.append("--warmup-s must be >= 0")
    if args.bg_max_words < args.bg_min_words:
        problems.append("--bg-max-words must be >= --bg-min-words")
    if problems:
        p.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, parse_args, run, table)


if __name__ == "__main__":
    sys.exit(main())
