"""The engine options every command shares (--model, --block-size, --kv-dtype, ...)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from kvscope.engine.config import (
    DEFAULT_KV_ANCHOR_TOKENS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
    DEFAULT_PRIORITY_AGING_S,
    DEFAULT_PRIORITY_HOLD_S,
    DEFAULT_PRIORITY_LOWER_TOKENS,
    DEFAULT_PRIORITY_STEP_STRETCH,
    KV_DTYPES,
    KV_ROTATIONS,
    MODEL_DTYPES,
    SCHEDULING_POLICIES,
    WEIGHT_FORMATS,
    EngineConfig,
)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--model", default="default",
                   help='"default" (embedded SmolLM2-135M-Instruct), a checkpoint folder '
                        'or a .gguf')
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=MODEL_DTYPES)
    g.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="matmul weights: auto (default) = int4 on CPU for a 4-bit checkpoint "
                        "(the embedded Q4_1 GGUF: about 2x faster, greedy output close to but "
                        "not always equal to Hugging Face's), else dense; dense = token-exact "
                        "with Hugging Face; int4/int8 = weight-only, CPU")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    g.add_argument("--kv-rotation", default="auto", choices=KV_ROTATIONS,
                   help="rotate q/k/v (Hadamard) before the KV cache stores them; calibrated: "
                        "plus the exact K shift and q/k balance; auto: calibrated for int8/fp8")
    g.add_argument("--kv-anchor-tokens", type=int, default=DEFAULT_KV_ANCHOR_TOKENS,
                   help="int8/fp8 KV: keep the first N positions of each opening (the "
                        "attention sink) exact in a small table beside the pool; 0 = off")
    g.add_argument("--kv-cache-bytes", type=parse_bytes, default=DEFAULT_KV_CACHE_BYTES,
                   help="KV memory budget, e.g. 268435456, 256M or 1G")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-offload-bytes", type=parse_bytes, default=0, metavar="BYTES",
                   help="host-memory tier for the prefix cache's blocks the pool evicts "
                        "(pinned memory on CUDA): a prefix found there is copied back, not "
                        "computed again; e.g. 1G; 0 = off (docs/kv-tiers.md)")
    g.add_argument("--kv-disk-bytes", type=parse_bytes, default=0, metavar="BYTES",
                   help="disk tier: full KV blocks written by content, kept across restarts "
                        "(a resumed chat prefills only its new tokens); e.g. 4G; 0 = off")
    g.add_argument("--kv-disk-dir", default="", metavar="DIR",
                   help="the disk tier's folder (default: kv-blocks under $KVSCOPE_CACHE_DIR, "
                        "else ~/.cache/kvscope)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--scheduling-policy", default="priority", choices=SCHEDULING_POLICIES,
                   help="priority (default): lower request priority first, and a request of "
                        "strictly higher priority may preempt lower ones; with every priority "
                        "equal it schedules as fcfs; fcfs: arrival order, priority ignored")
    g.add_argument("--priority-aging-s", type=float, default=DEFAULT_PRIORITY_AGING_S,
                   help="a waiting request's priority improves by 1 per this many seconds "
                        "since it arrived, so nothing starves; 0 = no aging")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int,
                   default=DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
                   help="at most this many prefill tokens in a step while decodes run (at "
                        "least one block's worth), so a long prompt does not stall every "
                        "stream's next token; 0 = no cap")
    g.add_argument("--priority-lower-tokens", type=int, default=DEFAULT_PRIORITY_LOWER_TOKENS,
                   help="priority: while a more urgent request is live (or left less than "
                        "--priority-hold-s ago), a step carries this many tokens of less "
                        "urgent work, round-robin (once the step-cost model is fitted, what "
                        "--priority-step-stretch allows instead, one token at least; one "
                        "token while the urgent one prefills), so the urgent one's steps "
                        "stay short; 0 = off (default 8; docs/scheduling.md has the "
                        "trade-off)")
    g.add_argument("--priority-hold-s", type=float, default=DEFAULT_PRIORITY_HOLD_S,
                   help="keep those short steps this long after the urgent requests left, so "
                        "a chat's next turn starts within one of them (default 0: it stops "
                        "a step of less urgent work instead)")
    g.add_argument("--priority-step-stretch", type=float, default=DEFAULT_PRIORITY_STEP_STRETCH,
                   metavar="X",
                   help="less urgent work while the step's predicted time (learned from "
                        "the protected steps run) stays within X times what the urgent "
                        "decodes cost alone, in place of those tokens; 1 = the tokens only "
                        "(default 2)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode steps (on CUDA "
                        "they are on by default, behind a start-up self-check; the CPU "
                        "always runs eagerly)")
    g.add_argument("--speculative-config", type=parse_speculative_config, default={},
                   metavar="JSON",
                   help='speculative decoding from the context, as vLLM\'s: \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\'; off by default (docs/speculative.md)')


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


SPECULATIVE_KEYS = {"method": "speculative_method",
                    "num_speculative_tokens": "num_speculative_tokens",
                    "prompt_lookup_min": "prompt_lookup_min",
                    "prompt_lookup_max": "prompt_lookup_max"}


def parse_speculative_config(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON -> EngineConfig field values (validated there)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    unknown = sorted(set(raw) - set(SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"--speculative-config: unknown keys {unknown}; "
                                         f"allowed are {sorted(SPECULATIVE_KEYS)}")
    return {SPECULATIVE_KEYS[k]: v for k, v in raw.items()}


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        weights=args.weights, block_size=args.block_size,
        kv_dtype=args.kv_dtype, kv_rotation=args.kv_rotation,
        kv_anchor_tokens=args.kv_anchor_tokens, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        scheduling_policy=args.scheduling_policy, priority_aging_s=args.priority_aging_s,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        priority_lower_tokens=args.priority_lower_tokens, priority_hold_s=args.priority_hold_s,
        priority_step_stretch=args.priority_step_stretch,
        kv_offload_bytes=getattr(args, "kv_offload_bytes", 0),
        kv_disk_bytes=getattr(args, "kv_disk_bytes", 0),
        kv_disk_dir=getattr(args, "kv_disk_dir", ""),
        enforce_eager=getattr(args, "enforce_eager", False), **_speculative(args))


def _speculative(args) -> dict[str, Any]:
    """The --speculative-config fields; a config naming no method means "ngram"."""
    spec = dict(getattr(args, "speculative_config", None) or {})
    if spec:
        spec.setdefault("speculative_method", "ngram")
    return spec
