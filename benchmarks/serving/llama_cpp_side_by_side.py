"""Decode tok/s of one chat, kvscope vs llama.cpp on the same GGUF, prompt tokens and threads.

    python -m benchmarks.serving.llama_cpp_side_by_side --llama-python /work/llama-venv/bin/python

llama.cpp comes from `llama-cpp-python`, which builds from source (about 25 minutes on two
cores), so it lives in a venv of its own and is never a dependency of kvscope:

    python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install llama-cpp-python

Both sides get the chat-templated prompt as token ids (the GGUF's vocabulary is the
checkpoint's), decode `--tokens` greedily after a warm-up, best of `--repeats`; tok/s =
tokens / seconds of the whole request, prefill included. llama.cpp runs in a child process
(its own interpreter), kvscope in this one, one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from kvscope.engine.measure.timing import add_json_flag, best_of, print_result

LLAMA_SIDE = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=1024, verbose=False)
def run(n):
    out = []
    for tok in llm.generate(cfg["prompt"], temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out
run(8)
best, tokens = 0.0, []
for _ in range(cfg["repeats"]):
    t0 = time.perf_counter()
    tokens = run(cfg["tokens"])
    best = max(best, len(tokens) / (time.perf_counter() - t0))
print(json.dumps({"tokens_per_s": best, "token_ids": tokens}))
"""

# --agreement: llama.cpp's greedy replies to the kv-accuracy prompts, stopping at its EOS.
LLAMA_REPLIES = r"""
import json, sys
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=1024, verbose=False)
replies = []
for prompt in cfg["prompts"]:
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if tok == llm.token_eos() or len(out) == cfg["max_tokens"]:
            break
    replies.append(out)
print(json.dumps(replies))
"""

PROMPT = "Write a short story about a robot who learns to paint."


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.llama_cpp_side_by_side",
                                description=__doc__)
    p.add_argument("--llama-python", default="/work/llama-venv/bin/python",
                   help="an interpreter with llama-cpp-python installed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--combos", nargs="+", default=["float32:auto", "float32:dense"],
                   help="kvscope dtype:weights pairs")
    p.add_argument("--agreement", action="store_true",
                   help="also: llama.cpp's greedy agreement with Hugging Face float32 on the "
                        "kv-accuracy prompts (replies of up to 48 tokens, as "
                        "benchmarks.cpu.single_stream measures kvscope's)")
    add_json_flag(p)
    return p.parse_args(argv)


def llama_agreement(args, gguf: str, tokenizer) -> dict:
    """llama.cpp's replies to the kv-accuracy prompts against Hugging Face float32 greedy."""
    import torch

    from benchmarks.cpu.single_stream import agreement, hf_reference, strip_eos
    from kvscope.engine.chat_template import chat_prompt_ids
    from kvscope.engine.loading.checkpoint_files import resolve_checkpoint
    from kvscope.engine.measure.kv_accuracy import PROMPTS

    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in PROMPTS]
    cfg = {"gguf": gguf, "threads": args.threads, "prompts": prompts, "max_tokens": 48}
    proc = subprocess.run([args.llama_python, "-c", LLAMA_REPLIES, json.dumps(cfg)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed: {proc.stderr.strip()[-800:]}")
    replies = json.loads(proc.stdout.strip().splitlines()[-1])
    torch.set_num_threads(args.threads)
    reference = hf_reference(resolve_checkpoint("default"), prompts, 48)
    eos = {tokenizer.eos_token_id}
    agree = [agreement(strip_eos(r, eos), strip_eos(ref, eos))
             for r, ref in zip(replies, reference, strict=True)]
    return {"greedy_agreement": sum(agree) / len(agree),
            "identical_prompts": sum(a == 1.0 for a in agree), "num_prompts": len(agree)}


def run_llama(args, gguf: str, prompt: list[int]) -> dict:
    cfg = {"gguf": gguf, "threads": args.threads, "tokens": args.tokens,
           "repeats": args.repeats, "prompt": prompt}
    proc = subprocess.run([args.llama_python, "-c", LLAMA_SIDE, json.dumps(cfg)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed ({args.llama_python}): "
                           f"{proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_kvscope(args, dtype: str, weights: str, prompt: list[int]) -> dict:
    import torch

    from kvscope.engine import LLM, EngineConfig, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(EngineConfig(dtype=dtype, weights=weights))
    llm.generate(prompt, SamplingParams(max_tokens=8))
    tokens: list[int] = []

    def request() -> None:
        tokens[:] = llm.generate(prompt, SamplingParams(max_tokens=args.tokens,
                                                        ignore_eos=True))[0].token_ids

    seconds = best_of(request, args.repeats, warmup=0)
    return {"tokens_per_s": args.tokens / seconds, "token_ids": tokens,
            "weights": llm.stats().weights}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from kvscope.engine.chat_template import chat_prompt_ids
    from kvscope.engine.loading.checkpoint_files import (
        default_gguf_path,
        load_tokenizer,
        resolve_checkpoint,
    )
    from kvscope.engine.measure.kv_accuracy import common_prefix

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = load_tokenizer(resolve_checkpoint("default"))
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}])
    results = {"llama.cpp": run_llama(args, str(default_gguf_path()), prompt)}
    for combo in args.combos:
        dtype, weights = combo.split(":")
        results[f"kvscope {combo}"] = run_kvscope(args, dtype, weights, prompt)
    ref = results["llama.cpp"]["token_ids"]
    for r in results.values():
        r["same_tokens_as_llama_cpp"] = common_prefix(r["token_ids"], ref)
    if args.agreement:
        results["llama.cpp"]["agreement"] = llama_agreement(args, str(default_gguf_path()),
                                                            tokenizer)
    if args.json:
        results = {k: {**v, "token_ids": None} for k, v in results.items()}
    print_result(results, lambda r: format_table(r, len(prompt), args), args.json)
    return 0


def format_table(results: dict, prompt_tokens: int, args: argparse.Namespace) -> str:
    lines = [f"{prompt_tokens} prompt tokens, {args.tokens} generated, {args.threads} threads"]
    lines += [f"{name:24} {r['tokens_per_s']:8.1f} tok/s   first "
              f"{r['same_tokens_as_llama_cpp']} tokens equal to llama.cpp's"
              for name, r in results.items()]
    if args.agreement:
        a = results["llama.cpp"]["agreement"]
        lines.append(f"llama.cpp greedy agreement with HF float32 (kv-accuracy prompts): "
                     f"{a['greedy_agreement']:.1%}, {a['identical_prompts']}/{a['num_prompts']} "
                     f"identical")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
