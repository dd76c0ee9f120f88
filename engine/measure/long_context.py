"""Long context: decode tok/s against context and prefill tok/s against prompt length, per KV
dtype, beside llama.cpp's own tools on the same GGUF.

    python -m kvscope.engine.measure.long_context [--contexts 512 2048 6000 8000]
        [--prompts 512 2048 8000] [--kv-dtypes float32 bfloat16 int8 fp8] [--steps 32]
        [--threads 2] [--llama-bin DIR | --no-llama] [--json]
    kvscope bench --long-context [the same options]

kvscope: one request at a time on the embedded model (engine defaults: int4 weights from the
Q4_1 GGUF, each KV dtype at its default rotation and anchors, prefix caching off). Each length
is one request of random token ids: its prefill (chunked as the engine schedules it) is timed
whole, prompt tokens / seconds; then, after --warmup untimed decode steps, each of --steps
decode steps is timed on its own and tok/s = 1 / the median step, so the prefill never leaks
into the decode number and a step disturbed by the rest of the machine does not move it.
A length in both lists is measured by the same request. The KV dtypes' engines take turns on
the same prompt, --rounds times a length, and each keeps its best round: on a shared or
virtual machine a slow minute then hits every dtype alike (run one dtype after another and
it decides which dtype looks slower).

llama.cpp (docs/long-context.md builds it): `llama-bench -p 0 -n STEPS -d CONTEXT` with its
default f16 KV and with `-ctk q8_0 -ctv q8_0 -fa 1`, `llama-bench -p LENGTH -n 0` for the
prefill with both, and `llama-batched-bench -npl 1` for its prefill at B = 1; all with
--threads. Lengths stay below the model's max_model_len (8192 for the embedded model), which
a prompt plus its decode steps must fit in.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from kvscope.engine.measure import llama_tools
from kvscope.engine.measure.timing import add_json_flag, print_result, progress_logger

DEFAULT_CONTEXTS = (512, 2048, 6000, 8000)
DEFAULT_PROMPTS = (512, 2048, 8000)
DEFAULT_KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")
# "auto": the engine's default for these weights (bfloat16 KV beside int4 weights on the CPU)
KV_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
# kvscope's 1-byte dtypes are compared with llama.cpp's q8_0 as well as with its f16.
ONE_BYTE = ("int8", "fp8")

log = progress_logger("long-context")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                   help="decode context lengths (tokens already in the KV cache)")
    p.add_argument("--prompts", type=int, nargs="+", default=list(DEFAULT_PROMPTS),
                   help="prefill prompt lengths")
    p.add_argument("--kv-dtypes", nargs="+", default=list(DEFAULT_KV_DTYPES),
                   choices=KV_DTYPE_CHOICES)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps before them")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per length, every KV dtype in turn; each keeps its best")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="default", help="kvscope's model (llama.cpp: --gguf)")
    p.add_argument("--weights", default="auto", help="kvscope's matmul weights")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the prefill chunk (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("llama.cpp")
    g.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    g.add_argument("--llama-bin", default=None,
                   help=f"folder with llama-bench and llama-batched-bench (default: "
                        f"${llama_tools.ENV}, then PATH)")
    g.add_argument("--llama-repeats", type=int, default=2, help="llama-bench -r")
    g.add_argument("--no-llama", action="store_true", help="kvscope only")
    g.add_argument("--llama-timeout", type=float, default=900.0,
                   help="seconds each llama.cpp command may run")
    add_json_flag(p)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvscope.engine.measure.long_context",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p)
    return p.parse_args(argv)


def check_lengths(args: argparse.Namespace, max_model_len: int) -> None:
    """Every prompt, and every context plus its decode steps, within max_model_len."""
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.rounds < 1:
        raise ValueError("need --steps >= 1, --warmup >= 0, --threads >= 1 and --rounds >= 1")
    decode_room = args.warmup + args.steps + 1
    for n in args.contexts:
        if n < 1 or n + decode_room > max_model_len:
            raise ValueError(f"--contexts {n}: a context plus {decode_room} decode steps "
                             f"must fit in max_model_len={max_model_len}")
    for n in args.prompts:
        if not 1 <= n < max_model_len:
            raise ValueError(f"--prompts {n}: a prompt must be 1 to {max_model_len - 1} tokens"
                             f" (max_model_len={max_model_len})")


# -- kvscope ------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab_size: int, exclude: set[int]) -> list[int]:
    """n random token ids, none of them special (an EOS mid-prompt changes nothing timed, but
    a chat template's markers would)."""
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in exclude:
            out.append(t)
    return out


def time_request(engine, prompt: list[int], warmup: int, steps: int
                 ) -> tuple[float, list[float]]:
    """(seconds of the prefill, seconds of each timed decode step) of one request that runs
    alone; the request is aborted afterwards, so its blocks are free for the next."""
    from kvscope.engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=warmup + steps + 1,
                                                    ignore_eos=True))
    seq = engine.requests[rid]
    start = time.perf_counter()
    while not seq.output_token_ids:  # the step finishing the prefill samples the first token
        engine.step()
    prefill = time.perf_counter() - start
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    engine.pop_output(rid)
    return prefill, times


def kvscope_engine(args: argparse.Namespace, loaded, kv_dtype: str, num_blocks: int):
    from kvscope.engine import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=args.model, device="cpu", weights=args.weights, kv_dtype=kv_dtype,
                       num_kv_blocks=num_blocks, max_num_seqs=1, enable_prefix_caching=False,
                       seed=args.seed)
    if args.max_num_batched_tokens:
        cfg.max_num_batched_tokens = args.max_num_batched_tokens
    return LLMEngine(cfg, loaded)


def measure_all(args: argparse.Namespace, engines: dict, lengths: list[int], special: set[int]
                ) -> dict:
    """{kv dtype: {"decode": {context: tok/s}, "prefill": {length: tok/s}, "decode_best":
    ...}}. Interleaved: each length's --rounds rounds run every dtype's engine in turn on the
    same prompt, and each dtype keeps its best round, so a slow minute of a shared machine
    lands on every dtype alike instead of on whichever ran then."""
    rng = random.Random(args.seed)
    out: dict[str, dict[str, dict[int, float]]] = {
        kv: {"decode": {}, "decode_best": {}, "prefill": {}} for kv in engines}
    vocab = next(iter(engines.values())).model.shape.vocab_size
    for engine in engines.values():
        time_request(engine, random_prompt(rng, 32, vocab, special), 1, 2)  # warm every path
    for n in lengths:
        decode = n in args.contexts
        for _ in range(args.rounds):
            prompt = random_prompt(rng, n, vocab, special)
            for kv, engine in engines.items():
                prefill, steps = time_request(engine, prompt, args.warmup if decode else 0,
                                              args.steps if decode else 1)
                got = out[kv]
                if n in args.prompts:
                    got["prefill"][n] = max(got["prefill"].get(n, 0.0), n / prefill)
                if decode:
                    got["decode"][n] = max(got["decode"].get(n, 0.0),
                                           1 / statistics.median(steps))
                    got["decode_best"][n] = max(got["decode_best"].get(n, 0.0), 1 / min(steps))
        for kv, got in out.items():
            said = [f"prefill {got['prefill'][n]:.0f} tok/s"] if n in got["prefill"] else []
            said += [f"decode {got['decode'][n]:.1f} tok/s"] if decode else []
            log(f"{kv} {n}: {', '.join(said)}")
    return out


def measure_kvscope(args: argparse.Namespace) -> dict:
    import torch

    from kvscope.engine.config import resolve_dtype
    from kvscope.engine.llm_engine import kv_dtype_name
    from kvscope.engine.loading.loader import load_model
    from kvscope.kernels import kernel_choice, native

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, resolve_dtype("auto", "cpu"))
    max_model_len = loaded.hf_config.max_position_embeddings
    check_lengths(args, max_model_len)
    lengths = sorted(set(args.contexts) | set(args.prompts))
    longest = max(lengths) + args.warmup + args.steps + 1
    # As benchmarks.bench.special_token_ids, which this module cannot import: bench imports
    # it for `kvscope bench --long-context`.
    tok = loaded.tokenizer
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    # Without a C compiler (or with a build that failed) the engine runs the torch kernels:
    # said in the result, since those numbers are not the native ones.
    # How idle OpenMP threads wait moves a quiet single stream by up to 1.5x (docs/threads.md)
    result: dict = {"max_model_len": max_model_len, "threads": torch.get_num_threads(),
                    "omp_wait": kernel_choice.thread_wait(),
                    "native_kernels": native.available(), "rounds": args.rounds,
                    "kv_dtypes": {}}
    engines = {kv: kvscope_engine(args, loaded, kv, -(-longest // 16) + 2)
               for kv in args.kv_dtypes}
    measured = measure_all(args, engines, lengths, special)
    for kv, engine in engines.items():
        result["weights"] = engine.weights
        result["prefill_chunk"] = engine.config.max_num_batched_tokens
        result["kv_dtypes"][kv] = {"rotation": engine.kv_rotation,
                                   "storage": kv_dtype_name(engine.kv_dtype), **measured[kv]}
    return result


# -- llama.cpp ----------------------------------------------------------------------------
def measure_llama(args: argparse.Namespace, gguf: str) -> dict:
    """{"f16": {"decode": ..., "prefill": ...}, "q8_0": ..., "batched_prefill": ...}, or
    {"skipped": why} when the tools are not there; a tool that fails is reported, not fatal."""
    bench = llama_tools.find_tool("llama-bench", args.llama_bin)
    if bench is None:
        return {"skipped": f"llama-bench not found in --llama-bin, ${llama_tools.ENV} or PATH"}
    out: dict = {"llama_bench": str(bench)}
    for kv in llama_tools.KV_FLAGS:
        commands = [llama_tools.bench_decode_command(bench, gguf, kv, args.contexts,
                                                     args.steps, args.threads,
                                                     args.llama_repeats),
                    llama_tools.bench_prefill_command(bench, gguf, kv, args.prompts,
                                                      args.threads, args.llama_repeats)]
        rows: list[dict] = []
        for command in commands:
            log("running " + " ".join(command))
            try:
                rows += llama_tools.parse_bench_json(llama_tools.run_tool(command,
                                                                          args.llama_timeout))
            except (RuntimeError, ValueError) as e:
                out.setdefault("errors", []).append(str(e))
        out[kv] = {"decode": llama_tools.decode_rates(rows),
                   "prefill": llama_tools.prefill_rates(rows)}
    batched = llama_tools.find_tool("llama-batched-bench", args.llama_bin)
    if batched is not None:
        command = llama_tools.batched_prefill_command(batched, gguf, args.prompts, args.threads)
        log("running " + " ".join(command))
        try:
            out["batched_prefill"] = llama_tools.batched_prefill_rates(
                llama_tools.run_tool(command, args.llama_timeout))
        except (RuntimeError, ValueError) as e:
            out.setdefault("errors", []).append(str(e))
    return out


# -- the table ----------------------------------------------------------------------------
def _rate(rates: dict, n: int) -> float | None:
    """rates[n]; a result read back from --json has its lengths as strings."""
    got = rates.get(n, rates.get(str(n)))
    return float(got) if got else None


def _cells(rates: dict, lengths: list[int], fmt: str = "{:8.1f}") -> str:
    return "".join(fmt.format(r) if (r := _rate(rates, n)) else f"{'-':>8}" for n in lengths)


def _ratio_cells(ours: dict, theirs: dict, lengths: list[int]) -> str:
    cells = []
    for n in lengths:
        a, b = _rate(ours, n), _rate(theirs, n)
        cells.append(f"{a / b:7.2f}x" if a and b else f"{'-':>8}")
    return "".join(cells)


def _section(result: dict, kind: str, lengths: list[int], title: str) -> list[str]:
    """One table: kvscope per KV dtype, llama.cpp per KV type, then kvscope/llama.cpp."""
    ours = {kv: r[kind] for kv, r in result["kvscope"]["kv_dtypes"].items()}
    llama = result.get("llama.cpp", {})
    theirs = {kv: llama[kv][kind] for kv in llama_tools.KV_FLAGS if kv in llama}
    lines = [title, f"{'':28}" + "".join(f"{n:>8}" for n in lengths)]
    stored = {kv: r.get("storage", kv) for kv, r in result["kvscope"]["kv_dtypes"].items()}
    lines += [f"{'kvscope ' + _label(kv, stored[kv]):28}{_cells(r, lengths)}"
              for kv, r in ours.items()]
    names = {"f16": "llama.cpp f16", "q8_0": "llama.cpp q8_0 (-fa 1)"}
    lines += [f"{names[kv]:28}{_cells(r, lengths)}" for kv, r in theirs.items()]
    if kind == "prefill" and "batched_prefill" in llama:
        lines.append(f"{'llama-batched-bench B=1':28}{_cells(llama['batched_prefill'], lengths)}")
    for kv, r in ours.items():
        for peer in ("f16", "q8_0"):
            if peer in theirs and (peer == "f16" or stored[kv] in ONE_BYTE):
                lines.append(f"{kv + ' / ' + peer:28}{_ratio_cells(r, theirs[peer], lengths)}")
    return lines


def _label(kv: str, storage: str) -> str:
    return kv if storage == kv else f"{kv} ({storage})"


def format_table(result: dict) -> str:
    k = result["kvscope"]
    wait = f", OpenMP wait {k['omp_wait']}" if k.get("omp_wait") else ""
    head = (f"1 request, embedded model, kvscope {k['weights']} weights, prefill chunk "
            f"{k['prefill_chunk']}, {k['threads']} threads{wait} (max_model_len "
            f"{k['max_model_len']})")
    lines = [head, ""]
    if not k.get("native_kernels", True):
        lines[1:1] = ["(the native CPU kernels did not build: kvscope ran its torch kernels)"]
    lines += _section(result, "decode", result["contexts"],
                      f"decode tok/s against context (median of {result['steps']} steps "
                      f"after the prefill)")
    lines.append("")
    lines += _section(result, "prefill", result["prompts"], "prefill tok/s against prompt "
                      "length")
    llama = result.get("llama.cpp", {})
    if "skipped" in llama:
        lines += ["", f"llama.cpp: skipped ({llama['skipped']})"]
    lines += [f"llama.cpp error: {e}" for e in llama.get("errors", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the native kernels' threads
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.contexts, args.prompts = sorted(set(args.contexts)), sorted(set(args.prompts))
    try:
        result: dict = {"contexts": args.contexts, "prompts": args.prompts,
                        "steps": args.steps, "kvscope": measure_kvscope(args)}
    except (ValueError, FileNotFoundError) as e:
        print(f"long_context: error: {e}", file=sys.stderr)
        return 2
    if not args.no_llama:
        from kvscope.engine.loading.checkpoint_files import default_gguf_path

        gguf = args.gguf or (str(default_gguf_path()) if args.model == "default" else None)
        result["llama.cpp"] = (measure_llama(args, gguf) if gguf else
                               {"skipped": "--model is not the embedded one: give --gguf"})
    print_result(result, format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
