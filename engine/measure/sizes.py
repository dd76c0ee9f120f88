"""`kvscope bench --sizes`: kvscope beside llama.cpp at the model sizes people run on a CPU.

    kvscope bench --sizes [--shapes llama-1b qwen2.5-1.5b llama-3b] [--formats int4 int8 bf16]
        [--contexts 512 4096] [--prompt 512] [--batches 8 32] [--threads 2]
        [--llama-bin DIR] [--llama-src DIR | --no-llama] [--json]
    python -m kvscope.engine.measure.sizes [the same options]

Per shape (engine/measure/size_models.py: random weights of the real model's dimensions,
nothing downloaded) and per weight format, each paired with llama.cpp's format of the same
bits (int4 / Q4_0, int8 / Q8_0, bf16 / F16), on the same weights:

- prefill tok/s of one --prompt-token request (kvscope: from its first step to the step that
  samples its first token; `llama-bench -p PROMPT -n 0`);
- decode tok/s after each of --contexts tokens of context (kvscope: 1 / the median of --steps
  engine steps after --warmup untimed ones; `llama-bench -p 0 -n STEPS -d CONTEXTS`);
- B requests at once for each of --batches, --batch-prompt tokens in and --batch-tokens out
  each, S t/s = (PP + TG) x B / seconds, as `llama-batched-bench -npl B` counts it;
- for every decode row, the read bandwidth it achieves (the bytes a token reads: the weights
  in their stored form plus the KV cache at that context, times tok/s) as a share of the read
  bandwidth measured at the start of the same run (engine/measure/bandwidth.py).

llama.cpp's side: its own converter writes the checkpoint as an F16 GGUF and llama-quantize
makes Q4_0 and Q8_0 from it (engine/measure/llama_tools.py says where they are looked for;
docs/long-context.md builds them; never built by the tests or CI), cached beside the
checkpoint. kvscope runs its engine on the checkpoint: int4 and int8 in a float32 model,
bf16 as dense bfloat16 weights, its KV cache in --kv-dtype (bfloat16: the bytes of llama.cpp's
default f16). Every run prints the CPU, the threads and the bandwidth it measured; compare the
ratios of one run, not absolute rates across runs (docs/cpu-speed.md).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvscope.engine.measure import bandwidth, llama_tools, size_models
from kvscope.engine.measure.long_context import random_prompt, time_request
from kvscope.engine.measure.sizes_table import format_table
from kvscope.engine.measure.timing import add_json_flag, print_result, progress_logger

# kvscope's form of each weight format (model dtype, weights) and llama.cpp's peer.
FORMATS = {"int4": ("float32", "int4"), "int8": ("float32", "int8"),
           "bf16": ("bfloat16", "dense")}
PEERS = {"int4": "Q4_0", "int8": "Q8_0", "bf16": "F16"}
BLOCK = 16  # tokens a KV block (the engine's default)

log = progress_logger("sizes")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=list(size_models.SHAPES),
                   help="model shapes (engine/measure/size_models.py)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096],
                   help="decode after this many tokens of context")
    p.add_argument("--prompt", type=int, default=512, help="the prefill's prompt tokens")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32],
                   help="requests at once (B)")
    p.add_argument("--batch-prompt", type=int, default=128, help="PP: prompt tokens a request")
    p.add_argument("--batch-tokens", type=int, default=64, help="TG: tokens a request makes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-dtype", default="bfloat16", help="kvscope's KV cache dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=bandwidth.DEFAULT_MIB,
                   help="buffer size of the bandwidth measurement (far above the caches)")
    p.add_argument("--cache-dir", default=None,
                   help="where checkpoints and GGUFs are kept (default: the user's cache, "
                        "kvscope/sizes)")
    g = p.add_argument_group("llama.cpp")
    g.add_argument("--llama-bin", default=None,
                   help=f"folder with llama-bench, llama-batched-bench and llama-quantize "
                        f"(default: ${llama_tools.ENV}, then PATH)")
    g.add_argument("--llama-src", default=None,
                   help=f"llama.cpp's source tree, for {llama_tools.CONVERTER} (default: "
                        f"${llama_tools.SRC_ENV}, then the tree llama-bench was built in)")
    g.add_argument("--llama-repeats", type=int, default=2, help="llama-bench -r")
    g.add_argument("--no-llama", action="store_true", help="kvscope only")
    g.add_argument("--llama-timeout", type=float, default=1800.0,
                   help="seconds each llama.cpp command may run")
    add_json_flag(p)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvscope.engine.measure.sizes",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p)
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes if s not in size_models.SHAPES]
    if unknown:
        p.error(f"--shapes {' '.join(unknown)}: expected among {', '.join(size_models.SHAPES)}")
    if min(args.contexts + args.batches + [args.prompt, args.steps, args.threads]) < 1:
        p.error("lengths, batches, --steps and --threads must be at least 1")
    args.contexts = sorted(set(args.contexts))
    args.batches = sorted(set(args.batches))
    return args


# -- kvscope ------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """The bytes one decode token reads of the weights: every layer's matmul weights and the
    LM head in their stored form (the embedding table is read one row a token)."""
    tensors = [t for layer in model.layers for lin in layer.linears() for t in lin.tensors()]
    tensors += model.lm_head.tensors()
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(engine) -> int:
    """The bytes of K and V (and their scales, for a 1-byte dtype) one cached token holds."""
    import torch

    s = engine.model.shape
    layers = len(engine.model.layers)
    size = torch.empty(0, dtype=engine.kv_dtype).element_size()
    scales = 4 if size == 1 else 0
    return 2 * layers * s.num_kv_heads * (s.head_dim * size + scales)


def kvscope_blocks(args: argparse.Namespace) -> int:
    longest = max(*args.contexts, args.prompt) + args.warmup + args.steps + 1
    batched = max(args.batches) * (-(-(args.batch_prompt + args.batch_tokens) // BLOCK) + 1)
    return max(-(-longest // BLOCK) + 2, batched) + 8


def measure_kvscope(args: argparse.Namespace, folder: Path, fmt: str) -> dict:
    """One weight format of one checkpoint: prefill, decode per context, batched, bytes."""
    from kvscope.engine import LLM, EngineConfig, SamplingParams
    from kvscope.engine.model.fused.model_view import decode_path_notice

    dtype, weights = FORMATS[fmt]
    llm = LLM(EngineConfig(model=str(folder), device="cpu", dtype=dtype, weights=weights,
                           kv_dtype=args.kv_dtype, num_kv_blocks=kvscope_blocks(args),
                           max_num_seqs=max(args.batches), enable_prefix_caching=False,
                           seed=args.seed))
    engine, rng = llm.engine, random.Random(args.seed)
    vocab = engine.model.shape.vocab_size
    tok = engine.tokenizer
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    out: dict = {"prefill": {}, "decode": {}, "decode_best": {}, "batched": {},
                 "weight_bytes": weight_bytes(engine.model),
                 "kv_bytes_per_token": kv_bytes_per_token(engine),
                 "fused_decode": bool(engine.model.fused_decode),
                 "decode_path": decode_path_notice(engine.model)}
    time_request(engine, random_prompt(rng, 32, vocab, special), 1, 2)  # warm every path
    for n in sorted({*args.contexts, args.prompt}):
        decode = n in args.contexts
        prefill, steps = time_request(engine, random_prompt(rng, n, vocab, special),
                                      args.warmup if decode else 0, args.steps if decode else 1)
        if n == args.prompt:
            out["prefill"][n] = n / prefill
        if decode:
            out["decode"][n] = 1 / statistics.median(steps)
            out["decode_best"][n] = 1 / min(steps)
        log(f"kvscope {fmt} {n}: prefill {n / prefill:.1f} tok/s"
            + (f", decode {out['decode'][n]:.2f} tok/s" if decode else ""))
    pp, tg = args.batch_prompt, args.batch_tokens
    for b in args.batches:
        prompts = [random_prompt(rng, pp, vocab, special) for _ in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tg, ignore_eos=True))
        out["batched"][b] = (pp + tg) * b / (time.perf_counter() - start)
        log(f"kvscope {fmt} B={b}: {out['batched'][b]:.1f} t/s")
    del llm, engine
    gc.collect()
    return out


# -- llama.cpp ----------------------------------------------------------------------------
def ggufs(args: argparse.Namespace, folder: Path, bench: Path) -> dict[str, Path]:
    """The checkpoint as a GGUF per format asked for: F16 by llama.cpp's converter, the others
    by llama-quantize from it; made once, kept in the checkpoint's folder."""
    out_dir = folder / "gguf"
    out_dir.mkdir(exist_ok=True)
    f16 = out_dir / "model-F16.gguf"
    if not f16.is_file():
        converter = llama_tools.find_converter(args.llama_src, bench)
        if converter is None:
            raise RuntimeError(f"{llama_tools.CONVERTER} not found in --llama-src, "
                               f"${llama_tools.SRC_ENV} or llama-bench's source tree")
        tmp = out_dir / "model-F16.gguf.part"
        command = llama_tools.convert_command(sys.executable, converter, folder, tmp)
        log("running " + " ".join(command))
        llama_tools.run_tool(command, args.llama_timeout, llama_tools.converter_env(converter))
        tmp.rename(f16)
    got = {}
    for fmt in args.formats:
        kind = PEERS[fmt]
        path = out_dir / f"model-{kind}.gguf"
        if not path.is_file():
            quantize = llama_tools.find_tool("llama-quantize", args.llama_bin)
            if quantize is None:
                raise RuntimeError("llama-quantize not found beside llama-bench")
            tmp = path.with_suffix(".gguf.part")
            command = llama_tools.quantize_command(quantize, f16, tmp, kind, args.threads)
            log("running " + " ".join(command))
            llama_tools.run_tool(command, args.llama_timeout)
            tmp.rename(path)
        got[fmt] = path
    return got


def measure_llama(args: argparse.Namespace, gguf: Path) -> dict:
    """llama-bench's prefill and decode, llama-batched-bench's S t/s, the GGUF's bytes; a
    tool that fails is reported in "errors", not fatal."""
    bench = llama_tools.find_tool("llama-bench", args.llama_bin)
    batched = llama_tools.find_tool("llama-batched-bench", args.llama_bin)
    assert bench is not None  # main found it before converting
    out: dict = {"prefill": {}, "decode": {}, "batched": {},
                 "weight_bytes": gguf.stat().st_size, "gguf": str(gguf)}
    rows: list[dict] = []
    for command in (llama_tools.bench_prefill_command(bench, str(gguf), "f16", [args.prompt],
                                                      args.threads, args.llama_repeats),
                    llama_tools.bench_decode_command(bench, str(gguf), "f16", args.contexts,
                                                     args.steps, args.threads,
                                                     args.llama_repeats)):
        log("running " + " ".join(command))
        try:
            rows += llama_tools.parse_bench_json(llama_tools.run_tool(command,
                                                                      args.llama_timeout))
        except (RuntimeError, ValueError) as e:
            out.setdefault("errors", []).append(str(e))
    out["prefill"] = llama_tools.prefill_rates(rows)
    out["decode"] = llama_tools.decode_rates(rows)
    if batched is None:
        out.setdefault("errors", []).append("llama-batched-bench not found")
        return out
    command = llama_tools.batched_command(batched, str(gguf), args.batch_prompt,
                                          args.batch_tokens, args.batches, args.threads)
    log("running " + " ".join(command))
    try:
        out["batched"] = llama_tools.batched_rates(llama_tools.run_tool(command,
                                                                         args.llama_timeout))
    except (RuntimeError, ValueError) as e:
        out.setdefault("errors", []).append(str(e))
    return out


# -- the run ------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    import torch

    from kvscope.kernels import kernel_choice, machine_key, native

    torch.set_num_threads(args.threads)
    key = machine_key.machine_key()
    result: dict = {"cpu": key.get("cpu_model", ""), "cpu_flags": key["cpu_notable_flags"],
                    "threads": args.threads,
                    "omp_wait": kernel_choice.thread_wait(), "native_kernels": native.available(),
                    "kv_dtype": args.kv_dtype, "contexts": args.contexts, "prompt": args.prompt,
                    "steps": args.steps, "batches": args.batches,
                    "batch_prompt": args.batch_prompt, "batch_tokens": args.batch_tokens,
                    "bandwidth": bandwidth.measure(args.bandwidth_mib), "shapes": {}}
    log(f"bandwidth: read {result['bandwidth']['read_gbs']:.1f} GB/s, copy "
        f"{result['bandwidth']['copy_gbs']:.1f} GB/s")
    bench = None if args.no_llama else llama_tools.find_tool("llama-bench", args.llama_bin)
    if args.no_llama:
        result["llama_skipped"] = "--no-llama"
    elif bench is None:
        result["llama_skipped"] = (f"llama-bench not found in --llama-bin, "
                                   f"${llama_tools.ENV} or PATH")
    root = Path(args.cache_dir) if args.cache_dir else None
    for name in args.shapes:
        shape = size_models.SHAPES[name]
        log(f"{name}: {shape.parameters() / 1e9:.2f} B parameters")
        folder = size_models.checkpoint(name, root, args.seed)
        got: dict = {"parameters": shape.parameters(), "layers": shape.layers,
                     "hidden": shape.hidden, "formats": {},
                     # llama.cpp's f16 KV: K and V, 2 bytes a value
                     "f16_kv_bytes_per_token": 2 * shape.layers * shape.kv_heads
                     * shape.head_dim * 2}
        result["shapes"][name] = got
        files: dict[str, Path] = {}
        if bench is not None:
            try:
                files = ggufs(args, folder, bench)
            except RuntimeError as e:
                got["llama_error"] = str(e)
        for fmt in args.formats:
            row: dict = {"peer": PEERS[fmt], "kvscope": measure_kvscope(args, folder, fmt)}
            if fmt in files:
                row["llama.cpp"] = measure_llama(args, files[fmt])
            got["formats"][fmt] = row
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the native kernels' threads
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"sizes: error: {e}", file=sys.stderr)
        return 2
    print_result(result, format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
