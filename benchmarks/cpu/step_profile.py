"""Where a decode step's time goes: attention, the KV write, the matmuls and the rest, on CPU.

    python -m benchmarks.cpu.step_profile [--dtype bfloat16] [--weights dense] [--seqs 16]
        [--context 160] [--steps 20] [--threads N] [--json]

N sequences decode at a given context length: each is prefilled with --context random tokens (no
prefix sharing), then --steps decode steps of the engine are timed (LLM engine.step, greedy). Inside
the step the model's attention calls (engine.model.paged_decoder.paged_attention: the paged gather,
QK^T, softmax and PV), its KV writes (engine.model.paged_decoder.write_kv, quantizing for 1-byte KV)
and its matmul calls (each layer's qkv, o, gate_up and down, and the LM head) are timed with
perf_counter wrappers, so the shares add up against the step's wall time on one thread of work.
Shares, not absolute times, are what to compare on a shared machine.

The one-region decode step (engine.model.fused.one_region) runs every layer's kernels inside one
native call, where no wrapper sees them; so the profile runs the kernel-by-kernel fused step
it replaces (KVSCOPE_ONE_REGION=off for the timed steps), the same kernels with a thread
wake-up each: compare its step time with `long_context`'s, not with a user's.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

from kvscope.engine.measure.timing import add_json_flag, per_call_seconds, print_result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu.step_profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights", default="dense")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_json_flag(p)
    return p.parse_args(argv)


class Clock:
    """Seconds spent inside the wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def instrument(model) -> dict[str, Clock]:
    """Wrap the model's attention kernels and matmul weights (instance attributes and the names
    engine.model.paged_decoder and engine.model.fused.decode look up, so nothing in the engine
    changes). A fused decode step (engine.model.fused.decode) writes K/V inside its RoPE call: that
    counts as other."""
    import kvscope.engine.model.fused.decode as fused
    import kvscope.engine.model.paged_decoder as model_module

    clocks = {"attention": Clock(), "kv_write": Clock(), "matmul": Clock()}
    model_module.paged_attention = clocks["attention"].wrap(model_module.paged_attention)
    model_module.write_kv = clocks["kv_write"].wrap(model_module.write_kv)
    fused.attention = clocks["attention"].wrap(fused.attention)
    fused.int4 = clocks["matmul"].wrap(fused.int4)
    fused.int8 = clocks["matmul"].wrap(fused.int8)
    fused.dense = clocks["matmul"].wrap(fused.dense)
    if not model.fused_decode:  # a fused step passes the linears to fused.int4/dense
        for layer in model.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                setattr(layer, name, clocks["matmul"].wrap(getattr(layer, name)))
    model.lm_head = clocks["matmul"].wrap(model.lm_head)
    return clocks


def run(args) -> dict:
    import torch

    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                           kv_dtype=args.kv_dtype, device="cpu", max_num_seqs=args.seqs,
                           max_num_batched_tokens=max(512, args.context)))
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model.shape.vocab_size
    for _ in range(args.seqs):
        prompt = [rng.randrange(100, vocab) for _ in range(args.context)]
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm the decode path
        engine.step()
    import kvscope.engine.model.fused.decode as fused
    import kvscope.engine.model.paged_decoder as model_module

    kernels = (model_module.paged_attention, model_module.write_kv)
    fused_kernels = (fused.attention, fused.int4, fused.dense)
    from kvscope.engine.model.fused import one_region as fused_one_region

    clocks = instrument(engine.model)
    one_region = os.environ.get(fused_one_region.ENV)
    os.environ[fused_one_region.ENV] = "off"
    try:
        step = per_call_seconds(engine.step, args.steps, warmup=0)
    finally:  # the module-level wrappers and the setting must not outlive this run
        model_module.paged_attention, model_module.write_kv = kernels
        fused.attention, fused.int4, fused.dense = fused_kernels
        if one_region is None:
            del os.environ[fused_one_region.ENV]
        else:
            os.environ[fused_one_region.ENV] = one_region
    attention, kv_write, matmul = (clocks[k].seconds / args.steps
                                   for k in ("attention", "kv_write", "matmul"))
    return {
        "dtype": args.dtype, "weights": args.weights,
        "kv_dtype": str(engine.pool.dtype).removeprefix("torch."),
        "seqs": args.seqs, "context": args.context, "threads": torch.get_num_threads(),
        "step_ms": step * 1e3,
        "attention_ms": attention * 1e3, "kv_write_ms": kv_write * 1e3,
        "matmul_ms": matmul * 1e3,
        "attention_share": attention / step, "kv_write_share": kv_write / step,
        "matmul_share": matmul / step,
        "other_share": 1 - (attention + kv_write + matmul) / step,
    }


def format_table(r: dict) -> str:
    lines = [(f"{r['seqs']} sequences decoding at ~{r['context']} tokens of context, "
              f"{r['dtype']} {r['weights']} weights, {r['kv_dtype']} KV, {r['threads']} threads"),
             f"step        {r['step_ms']:8.2f} ms"]
    lines += [f"{part:11} {r[part + '_ms']:8.2f} ms  {r[part + '_share']:6.1%}"
              for part in ("attention", "kv_write", "matmul")]
    other = r["step_ms"] - r["attention_ms"] - r["kv_write_ms"] - r["matmul_ms"]
    lines.append(f"other       {other:8.2f} ms  {r['other_share']:6.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print_result(run(args), format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
