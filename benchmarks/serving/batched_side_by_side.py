"""B requests at once, kvscope beside `llama-batched-bench`, on the same GGUF and threads.

    LLAMA_BIN=... python -m benchmarks.serving.batched_side_by_side [--batches 1 4 16]
        [--prompt 128] [--tokens 128] [--threads 2] [--json]

llama.cpp: `llama-batched-bench -npp PP -ntg TG -npl B...` (its default f16 KV), whose
`S t/s` is (PP + TG) x B / the whole run's seconds: B prompts of PP tokens prefilled, then TG
tokens generated for each. kvscope: the same work through the engine at its defaults (int4
weights from the Q4_1 GGUF, its default KV dtype): B requests of PP random token ids, each
generating exactly TG tokens (ignore_eos), submitted at once and stepped to the end; the
same formula over the wall time, best of --repeats after a warm-up. One run, both peers, so
the ratio is the number to read.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from kvscope.engine.measure import llama_tools
from kvscope.engine.measure.timing import add_json_flag, progress_logger, run_benchmark

log = progress_logger("batched")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.batched_side_by_side",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="kvscope's model (llama.cpp: --gguf)")
    p.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt", type=int, default=128, help="PP: prompt tokens a request")
    p.add_argument("--tokens", type=int, default=128, help="TG: generated tokens a request")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--llama-bin", default=None)
    p.add_argument("--llama-timeout", type=float, default=900)
    add_json_flag(p)
    return p.parse_args(argv)


def kvscope_rates(args: argparse.Namespace) -> dict[int, float]:
    """S t/s per batch size, as llama-batched-bench counts it."""
    import torch

    from kvscope.engine import LLM, EngineConfig, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(EngineConfig(model=args.model, device="cpu", max_num_seqs=max(args.batches)))
    rng = random.Random(0)
    vocab = llm.engine.model.shape.vocab_size
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rates = {}
    for b in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        rates[b] = (args.prompt + args.tokens) * b / best
        log(f"kvscope B={b}: {rates[b]:.1f} t/s")
    return rates


def llama_rates(args: argparse.Namespace, gguf: str) -> dict[int, float] | str:
    tool = llama_tools.find_tool("llama-batched-bench", args.llama_bin)
    if tool is None:
        return f"llama-batched-bench not found in --llama-bin, ${llama_tools.ENV} or PATH"
    ctx = (args.prompt + args.tokens) * max(args.batches) + 16
    command = [str(tool), "-m", gguf, "-c", str(ctx), "-npp", str(args.prompt),
               "-ntg", str(args.tokens), "-npl", ",".join(map(str, args.batches)),
               "-t", str(args.threads)]
    log("running " + " ".join(command))
    rows = llama_tools.parse_markdown_table(llama_tools.run_tool(command, args.llama_timeout))
    return {int(r["B"]): float(r["S t/s"]) for r in rows if "S t/s" in r}


def run(args: argparse.Namespace) -> dict:
    from kvscope.engine.loading.checkpoint_files import default_gguf_path

    result = {"prompt": args.prompt, "tokens": args.tokens, "threads": args.threads,
              "kvscope": kvscope_rates(args)}
    theirs = llama_rates(args, args.gguf or str(default_gguf_path()))
    if isinstance(theirs, str):
        result["llama_skipped"] = theirs
    else:
        result["llama.cpp"] = theirs
    return result


def format_table(r: dict) -> str:
    lines = [f"PP {r['prompt']}, TG {r['tokens']}, {r['threads']} threads; S t/s = "
             f"(PP + TG) x B / seconds",
             f"{'B':>4} {'kvscope':>10} {'llama.cpp':>10} {'ratio':>7}"]
    theirs = r.get("llama.cpp", {})
    for b, ours in r["kvscope"].items():
        peer = theirs.get(b, theirs.get(str(b)))
        ratio = f"{ours / peer:6.2f}x" if peer else "-"
        lines.append(f"{b:>4} {ours:10.1f} {peer or float('nan'):10.1f} {ratio:>7}")
    if "llama_skipped" in r:
        lines.append(r["llama_skipped"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
