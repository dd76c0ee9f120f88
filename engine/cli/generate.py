"""`kvscope generate`: one reply, streamed to stdout (or one JSON object with --json)."""
from __future__ import annotations

import argparse
import json
import sys

import msgspec

from kvscope.engine.cli.options import add_engine_options, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `generate` and all its options on the launcher's subparsers action."""
    gen = sub.add_parser("generate", help="generate a reply, streamed to stdout",
                         description="Generate one reply to PROMPT with the engine in this "
                                     "process, streamed to stdout as it is sampled.")
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
    return gen


def run(args: argparse.Namespace) -> int:
    from kvscope.engine import SamplingParams
    from kvscope.engine.chat_template import chat_prompt_ids
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.traces.recorder import start_trace

    engine = None
    try:
        engine = LLMEngine(engine_config_from_args(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                                stop=args.stop)
        prompt = args.prompt if args.raw else chat_prompt_ids(
            engine.tokenizer, [{"role": "user", "content": args.prompt}])
        if args.trace:
            start_trace(engine, args.trace, include_prompts=not args.no_prompts)
        request_id = engine.add_request(prompt, params)
    except (ValueError, OSError) as exc:
        if engine is not None:
            engine.stop_trace()
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    try:
        while engine.has_unfinished():
            for delta in engine.step().outputs:
                if not args.json:
                    print(delta.text, end="", flush=True)
    finally:
        engine.stop_trace()
    output = engine.pop_output(request_id)
    if args.json:
        print(json.dumps({"request_id": output.request_id, "text": output.text,
                          "token_ids": output.token_ids, "finish_reason": output.finish_reason,
                          "prompt_token_ids": output.prompt_token_ids,
                          "stats": msgspec.structs.asdict(engine.stats())}))
    else:
        print()
    return 0
