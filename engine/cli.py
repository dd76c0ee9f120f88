"""`kvscope` command line: the GUI by default, and generate, serve, bench, kv-accuracy, kv-calc."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from engine.config import DEFAULT_KV_CACHE_BYTES, KV_DTYPES, MODEL_DTYPES


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--model", default="default",
                   help='"default" (embedded SmolLM2-135M-Instruct), a checkpoint folder or a .gguf')
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=MODEL_DTYPES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    g.add_argument("--kv-cache-bytes", type=parse_bytes, default=DEFAULT_KV_CACHE_BYTES,
                   help="KV memory budget, e.g. 268435456, 256M or 1G")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def engine_config_from_args(args):
    from engine import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_dtype=args.kv_dtype, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope", description="See and steer what a local LLM engine does with its KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="per-request sampling seed (--seed seeds the engine)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--trace", metavar="PATH", help="record the session to a JSONL trace")
    gen.add_argument("--no-prompts", action="store_true",
                     help="with --trace: record prompt lengths, not the prompt token ids")
    add_engine_options(gen)
    sub.add_parser("bench", help="engine vs Hugging Face generate on a mixed workload")
    sub.add_parser("kv-accuracy", help="accuracy of each KV dtype against float32 KV")
    sub.add_parser("serve", help="headless engine process behind ZeroMQ")
    sub.add_parser("trace", help="replay, compare and export recorded session traces")
    sub.add_parser("fragsim", help="reserved-max-length vs paged KV waste experiment")
    sub.add_parser("gui", help="the desktop app (the default with no command; --attach URL)")
    calc = sub.add_parser("kv-calc", help="KV bytes per token and in total for a model config")
    calc.add_argument("--config", required=True,
                      help="config.json, a checkpoint folder or an inline JSON object")
    calc.add_argument("--dtype", default="bf16",
                      help="float32|fp32|float16|fp16|bfloat16|bf16|int8|fp8")
    calc.add_argument("--tokens", type=int, default=1_000_000)
    calc.add_argument("--json", action="store_true")
    return parser


def cmd_kv_calc(args) -> int:
    from engine.kv_calc import human_bytes, kv_size, load_config

    try:
        size = kv_size(load_config(args.config), args.dtype)
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvscope kv-calc: error: {exc}", file=sys.stderr)
        return 2
    total = size.total_bytes(args.tokens)
    if args.json:
        print(json.dumps({"bytes_per_token": size.bytes_per_token, "total_bytes": total,
                          "tokens": args.tokens, "dtype": args.dtype, "layers": size.layers,
                          "kv_heads": size.kv_heads, "head_dim": size.head_dim}))
    else:
        print(f"{size.layers} layers x {size.kv_heads} KV heads x {size.head_dim} dims, "
              f"{args.dtype}: {human_bytes(size.bytes_per_token)} per token, "
              f"{human_bytes(total)} for {args.tokens:,} tokens")
    return 0


def cmd_generate(args) -> int:
    from engine import SamplingParams
    from engine.llm_engine import LLMEngine

    engine = None
    try:
        engine = LLMEngine(engine_config_from_args(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                                stop=args.stop)
        prompt = args.prompt if args.raw else chat_prompt(engine.tokenizer, args.prompt)
        if args.trace:
            engine.start_trace(args.trace, include_prompts=not args.no_prompts)
        request_id = engine.add_request(prompt, params)
    except (ValueError, OSError) as exc:
        if engine is not None:
            engine.stop_trace()
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    try:
        while engine.has_unfinished():
            for delta in engine.step():
                if not args.json:
                    print(delta.text, end="", flush=True)
    finally:
        engine.stop_trace()
    output = engine.pop_output(request_id)
    if args.json:
        print(json.dumps({"request_id": output.request_id, "text": output.text,
                          "token_ids": output.token_ids, "finish_reason": output.finish_reason,
                          "prompt_token_ids": output.prompt_token_ids,
                          "stats": engine.stats()}))
    else:
        print()
    return 0


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


DELEGATED = {"bench": "benchmarks.bench", "kv-accuracy": "benchmarks.kv_accuracy",
             "serve": "engine.serve_cli", "trace": "engine.trace_cli",
             "fragsim": "engine.fragsim_cli"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "gui" or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        # The desktop app runs in a process without torch; it starts (or attaches to) an
        # engine process of its own.
        from app.main import main as gui_main

        return gui_main(argv[1:] if argv[:1] == ["gui"] else argv)
    if argv[0] in DELEGATED:
        # These commands own their options; argparse REMAINDER would not pass options that
        # start with "--" through, so they get the raw argv.
        module = importlib.import_module(DELEGATED[argv[0]])
        return module.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "kv-calc":
        return cmd_kv_calc(args)
    return cmd_generate(args)


if __name__ == "__main__":
    sys.exit(main())
