"""`kvscope kv-calc`: KV bytes per token and in total for any Hugging Face config."""
from __future__ import annotations

import argparse
import json
import sys

from kvscope.kvmath.kv_size import (
    human_bytes,
    kv_size,
    load_config,
    reclamation_saving,
    sequence_tokens_held,
    window_note,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `kv-calc` and its options on the launcher's subparsers action."""
    calc = sub.add_parser("kv-calc", help="KV bytes per token and in total for a model config",
                          description="KV cache bytes per token (2 x layers x KV heads x head "
                                      "dim x bytes) and for --tokens tokens, from a Hugging "
                                      "Face config; no model is loaded. Sliding-window "
                                      "layers are reported: an all-windowed model's "
                                      "sequence keeps at most its window.")
    calc.add_argument("--config", required=True,
                      help="config.json, a checkpoint folder or an inline JSON object")
    calc.add_argument("--dtype", default="bf16",
                      help="float32|fp32|float16|fp16|bfloat16|bf16|int8|fp8")
    calc.add_argument("--tokens", type=int, default=1_000_000)
    calc.add_argument("--json", action="store_true")
    return calc


def run(args: argparse.Namespace) -> int:
    try:
        size = kv_size(load_config(args.config), args.dtype)
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvscope kv-calc: error: {exc}", file=sys.stderr)
        return 2
    tokens, shape = args.tokens, size.shape
    total = size.total_bytes(tokens)
    if args.json:
        print(json.dumps({"bytes_per_token": size.bytes_per_token, "total_bytes": total,
                          "tokens": tokens, "dtype": args.dtype, "layers": size.layers,
                          "kv_heads": size.kv_heads, "head_dim": size.head_dim,
                          "windowed_layers": size.windowed_layers, "window": size.window,
                          "sequence_tokens_held": sequence_tokens_held(shape, tokens),
                          "sequence_bytes": size.sequence_bytes(tokens),
                          "reclamation_saving": reclamation_saving(shape, tokens)}))
    else:
        print(f"{size.layers} layers x {size.kv_heads} KV heads x {size.head_dim} dims, "
              f"{args.dtype}: {human_bytes(size.bytes_per_token)} per token, "
              f"{human_bytes(total)} for {tokens:,} tokens")
        note = window_note(shape, tokens)
        if note:
            if shape.all_windowed:
                note += f" ({human_bytes(size.sequence_bytes(tokens))} per sequence)"
            print(note)
    return 0
