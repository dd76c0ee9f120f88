"""Decode tok/s of a random mixture of experts against Hugging Face `generate`, at concurrency 1
and 16.

    python -m benchmarks.cpu.moe_decode [--tokens 32] [--concurrency 1 16] [--json]

The model: a random Mixtral (8 experts, top-2, hidden 512, expert intermediate 1024, 4 layers,
8 heads over 2 KV heads, a 256-token vocabulary), float32, saved like a real checkpoint. Both
sides get the same `--concurrency` prompts of `--prompt-len` random tokens and generate
`--tokens` tokens each greedily (the engine with ignore_eos, HF with min_new_tokens): HF as one
batch of equal-length rows (no padding), the engine as that many requests. tok/s = generated
tokens over the whole call's seconds (prefill included), best of `--repeats` after a warm-up;
the engine also with int8 expert weights. The engine's outputs are checked token for token
against HF's in float32 dense (the "match" column).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from kvscope.engine.measure.timing import add_json_flag, best_of, print_result, progress_logger

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = progress_logger("moe-decode")
SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 8,
         "num_experts_per_tok": 2, "max_position_embeddings": 1024}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu.moe_decode", description=__doc__)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--weights", nargs="+", default=["dense", "int8"])
    add_json_flag(p)
    return p.parse_args(argv)


def save_model(folder: Path) -> Path:
    from kvscope.testing.tiny_models import save_tiny_model

    # initializer_range 0.02 (a real model's), not the tests' peaked 0.3.
    return save_tiny_model(folder, "mixtral", seed=0, initializer_range=0.02, **SHAPE)


def prompts_of(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (length,), generator=g).tolist() for _ in range(n)]


def hf_run(hf, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return [row[ids.shape[1]:].tolist() for row in out]


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.engine import LLM, EngineConfig, SamplingParams

    results: dict = {"threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(Path(tmp) / "moe")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        engines = {w: LLM(EngineConfig(model=str(path), dtype="float32", weights=w,
                                       kv_dtype="float32", max_model_len=512,
                                       max_num_seqs=max(args.concurrency)))
                   for w in args.weights}
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        for n in args.concurrency:
            prompts = prompts_of(n, args.prompt_len, seed=n)
            generated = n * args.tokens
            log(f"concurrency {n}: HF generate ...")
            want = hf_run(hf, prompts, args.tokens)
            row = {"hf": generated / best_of(lambda p=prompts: hf_run(hf, p, args.tokens),
                                            args.repeats)}
            for w, llm in engines.items():
                log(f"concurrency {n}: engine, {w} weights ...")
                got = [o.token_ids for o in llm.generate(prompts, params)]
                row[w] = generated / best_of(lambda p=prompts, e=llm: e.generate(p, params),
                                             args.repeats)
                if w == "dense":
                    row["match"] = got == want
            results[str(n)] = row
    return results


def format_table(results: dict) -> str:
    rows = [(k, r) for k, r in results.items() if k != "threads"]
    engines = [k for k in rows[0][1] if k not in ("hf", "match")] if rows else []
    head = f"{'concurrency':>11} {'HF tok/s':>9} " + " ".join(
        f"{w + ' tok/s':>12} {'x HF':>6}" for w in engines) + "  match"
    lines = [f"torch threads: {results['threads']}", head]
    for n, r in rows:
        cells = " ".join(f"{r[w]:12.1f} {r[w] / r['hf']:6.2f}" for w in engines)
        lines.append(f"{n:>11} {r['hf']:9.1f} {cells}  {r.get('match')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print_result(run(args), format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
