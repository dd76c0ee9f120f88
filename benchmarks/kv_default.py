"""What the CPU's default KV dtype costs, beside what the default weights already cost.

    python -m kvscope.benchmarks.kv_default [--settings dense:float32 int4:float32 ...] [--json]

The reference is dense float32 weights with float32 KV, the setting whose greedy output equals
Hugging Face float32 token for token. Each setting (weights:kv_dtype) is measured against it
as kv-accuracy measures a KV dtype (benchmarks/kv_accuracy.py): prefix and positional
agreement of 48 greedy tokens over the 40 chat prompts, mean KL along the reference's
continuation (teacher-forced), perplexity on resources/perplexity_text.txt. It answers one
question: once the weights are int4 (the CPU default for the embedded Q4_1 checkpoint), how
much of the distance from the reference does a bfloat16 KV add (engine/config.py,
resolve_kv_dtype; docs/kv-dtypes.md, "The CPU default").
"""
from __future__ import annotations

import argparse
import sys

from kvscope.benchmarks.timing import add_json_flag, progress_logger, run_benchmark

log = progress_logger("kv-default")
DEFAULT_SETTINGS = ["dense:bfloat16", "int4:float32", "int4:bfloat16"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvscope.benchmarks.kv_default",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS,
                   help="weights:kv_dtype pairs measured against dense:float32")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--text-tokens", type=int, default=1024)
    add_json_flag(p)
    return p.parse_args(argv)


def parse_setting(setting: str) -> tuple[str, str]:
    weights, sep, kv_dtype = setting.partition(":")
    if not sep or not weights or not kv_dtype:
        raise SystemExit(f"--settings {setting!r}: expected weights:kv_dtype, "
                         f"e.g. int4:bfloat16")
    return weights, kv_dtype


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvscope.benchmarks.kv_accuracy import TEXT, load_prompts, measure, reference_of
    from kvscope.engine import EngineConfig
    from kvscope.engine.llm import LLM
    from kvscope.engine.loading.loader import load_model

    loaded = load_model(args.model, torch.float32)
    settings = [parse_setting(s) for s in args.settings]
    llm = LLM(EngineConfig(model=args.model, weights="dense", kv_dtype="float32"),
              loaded=loaded)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in load_prompts()[:args.num_prompts]]
    text_ids = loaded.tokenizer.encode(TEXT.read_text())[:args.text_tokens]
    log("reference: dense:float32 ...")
    reference = reference_of(llm.engine, prompts, args.max_tokens)
    results = {}
    for weights in dict.fromkeys(w for w, _ in settings):
        if weights != "dense":
            del llm
            llm = LLM(EngineConfig(model=args.model, weights=weights), loaded=loaded)
        for kv_dtype in (k for w, k in settings if w == weights):
            log(f"{weights}:{kv_dtype} ...")
            llm.engine.reconfigure(kv_dtype=kv_dtype)
            result = measure(llm.engine, prompts, reference, text_ids, args.max_tokens)
            result.pop("greedy")
            results[f"{weights}:{kv_dtype}"] = {"weights": llm.stats().weights,
                                                "kv_dtype": kv_dtype, **result}
    return results


def format_table(results: dict) -> str:
    lines = [f"{'weights:kv':16} {'bytes/token':>12} {'prefix agree':>13} "
             f"{'position agree':>15} {'mean KL':>10} {'perplexity':>11}"]
    lines += [f"{name:16} {r['kv_bytes_per_token']:12d} {r['prefix_agreement']:12.1%} "
              f"{r['positional_agreement']:14.1%} {r['mean_kl']:10.2e} {r['perplexity']:11.3f}"
              for name, r in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
