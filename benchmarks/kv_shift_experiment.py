"""Experiment: the exact K shift alone on top of the rotation, for fp8 (the engine now has the
shift together with a q/k channel balance as `--kv-rotation calibrated`, kernels/k_balance.py;
this script keeps the shift-only variant for comparison).

Subtracting one constant vector c from every key of a layer and KV head changes every score of
a query by the same q.c, so softmax, and the output, are unchanged in exact arithmetic; what
changes is what the quantizer sees: keys carry large per-channel offsets (after RoPE, the
slowly rotating channels hardly move), and a float format spends its relative precision on
the offset instead of the part that differs from key to key.

Here c is the mean post-RoPE key per (layer, KV head, channel) of a calibration text (not the
evaluation prompts or text), measured once through a float32 pool; the engine's KV write is
wrapped to subtract it (before the rotation) on the torch path. Rows as `kvscope kv-accuracy`.

    python -m kvscope.benchmarks.kv_shift_experiment [--dtypes fp8 int8] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from kvscope.benchmarks import kv_accuracy

# The engine's own calibration text (the "calibrated" rotation measures on it too).
from kvscope.engine.kv_calibration import CALIBRATION_TEXT as CALIBRATION


def key_means(engine, token_ids):
    """Per layer [kv_heads, head_dim]: the mean key of `token_ids` in a float32 pool."""
    import torch

    from kvscope.engine.scoring import token_log_probs

    engine.reconfigure(kv_dtype="float32", kv_rotation="none")  # a fresh, zeroed pool
    token_log_probs(engine, token_ids)
    means = []
    for k_cache, _ in engine.pool.caches:
        rows = k_cache.view(-1, *k_cache.shape[2:])
        written = rows.flatten(1).ne(0).any(1)
        assert int(written.sum()) == len(token_ids)
        means.append(rows[written].mean(0).to(torch.float32))
    return means


def shifting_write(means, num_layers):
    """kernels.ops.write_kv that subtracts layer i's mean key; the model writes its layers
    in order, so the i-th call of a forward pass is layer i."""
    from kvscope.kernels import ops

    original = ops.write_kv
    calls = [0]

    def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                 rotation=None, k_balance=None):
        c = means[calls[0] % num_layers]
        calls[0] += 1
        key = key - c.to(key.dtype)
        original(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, rotation,
                 k_balance)

    return write_kv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kv_shift_experiment", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtypes", nargs="+", default=["fp8", "int8"], choices=["fp8", "int8"])
    p.add_argument("--rotations", nargs="+", default=["hadamard", "none"],
                   choices=["hadamard", "none"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    from kvscope.engine import EngineConfig
    from kvscope.engine import model as model_module
    from kvscope.engine.llm import LLM
    from kvscope.engine.loader import load_model

    loaded = load_model(args.model, torch.float32)
    llm = LLM(EngineConfig(model=args.model), loaded=loaded)
    engine = llm.engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in kv_accuracy.PROMPTS]
    text_ids = loaded.tokenizer.encode(kv_accuracy.TEXT.read_text())[:args.text_tokens]
    reference = kv_accuracy.reference_of(engine, prompts, args.max_tokens)
    means = key_means(engine, loaded.tokenizer.encode(CALIBRATION))
    # engine.model imported write_kv by name: that is the one the forward pass calls.
    model_module.write_kv = shifting_write(means, engine.model.shape.num_layers)
    results = {}
    for dtype in args.dtypes:
        for rotation in args.rotations:
            name = f"{dtype}+{rotation}+kshift"
            print(f"[kv-shift] {name} ...", file=sys.stderr)
            engine.reconfigure(kv_dtype=dtype, kv_rotation=rotation)
            r = kv_accuracy.measure(engine, prompts, reference, text_ids, args.max_tokens)
            r.pop("greedy")
            results[name] = {"kv_dtype": dtype, "kv_rotation": rotation + " + K shift", **r}
    if args.json:
        print(json.dumps(results))
    else:
        kv_accuracy.print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
