"""Decode tok/s and greedy agreement with HF float32 of one chat, per weight format and dtype.

    python -m benchmarks.cpu.single_stream [--combos float32:dense bfloat16:int4 ...] [--json]

One chat at a time, for each weight format and model dtype (the measurements behind the CPU
default).

Speed: the kv-accuracy prompt set's first prompt (chat template applied), `--tokens`
generated with ignore_eos after a warm-up, best of `--repeats`; tok/s = tokens / seconds of
the whole request (prefill included, as a user sees it). Agreement: for each of the
kv-accuracy prompts, greedy replies of up to `--agree-tokens` that stop at EOS on both sides
(no min_new_tokens: HF would forbid EOS where the engine may pick it), compared with Hugging
Face `generate` in float32 on the same checkpoint: tokens before the first difference over
the longer reply's length (1.0 = identical).
"""
from __future__ import annotations

import argparse
import os
import sys

from kvscope.engine.measure.timing import add_json_flag, best_of, print_result, progress_logger

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = progress_logger("single-stream")
DEFAULT_COMBOS = ["float32:dense", "bfloat16:dense", "float32:int4", "bfloat16:int4",
                  "float32:int8", "bfloat16:int8"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu.single_stream",
                                description=__doc__)
    p.add_argument("--model", default="default")
    p.add_argument("--combos", nargs="+", default=DEFAULT_COMBOS,
                   help="dtype:weights pairs, e.g. float32:dense bfloat16:int4")
    p.add_argument("--tokens", type=int, default=128, help="tokens timed per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--agree-tokens", type=int, default=48)
    add_json_flag(p)
    return p.parse_args(argv)


def hf_reference(checkpoint, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None)
            out.append(ids[0, len(p):].tolist())
    return out


def strip_eos(tokens, eos: set[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def agreement(got: list[int], ref: list[int]) -> float:
    from kvscope.engine.measure.kv_accuracy import common_prefix

    return common_prefix(got, ref) / max(len(got), len(ref), 1)


def decode_speed(llm, prompt: list[int], tokens: int, repeats: int) -> float:
    from kvscope.engine import SamplingParams

    llm.generate(prompt, SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return tokens / best_of(lambda: llm.generate(prompt, params), repeats, warmup=0)


def run(args) -> dict:
    import torch

    from kvscope.engine import LLM, EngineConfig, SamplingParams
    from kvscope.engine.loading.loader import load_model
    from kvscope.engine.measure.kv_accuracy import PROMPTS

    loaded = load_model(args.model, torch.float32)
    results = {}
    prompts = reference = None
    for combo in args.combos:
        dtype, weights = combo.split(":")
        log(f"{combo} ...")
        llm = LLM(EngineConfig(model=args.model, dtype=dtype, weights=weights), loaded=loaded)
        if prompts is None:
            prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
                       for q in PROMPTS]
            reference = hf_reference(loaded.checkpoint, prompts, args.agree_tokens)
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.agree_tokens))
        eos = loaded.eos_token_ids
        agree = [agreement(strip_eos(o.token_ids, eos), strip_eos(r, eos))
                 for o, r in zip(outs, reference, strict=True)]
        results[combo] = {
            "tokens_per_s": decode_speed(llm, prompts[0], args.tokens, args.repeats),
            "greedy_agreement": sum(agree) / len(agree),
            "identical_prompts": sum(a == 1.0 for a in agree),
            "num_prompts": len(agree),
            "weights": llm.stats().weights,
            "weight_bytes": sum(t.nbytes for t in llm.engine.model.tensors()),
        }
        del llm
    return results


def format_table(results: dict) -> str:
    lines = [(f"{'dtype:weights':16} {'tok/s':>8} {'agree w/ HF f32':>16} {'identical':>10} "
              f"{'weight MiB':>11}")]
    lines += [f"{combo:16} {r['tokens_per_s']:8.1f} {r['greedy_agreement']:15.1%} "
              f"{r['identical_prompts']:>5}/{r['num_prompts']:<4} "
              f"{r['weight_bytes'] / 2**20:11.1f}" for combo, r in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print_result(run(args), format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
