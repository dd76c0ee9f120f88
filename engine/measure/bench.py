"""Engine vs Hugging Face `generate` on one seeded mixed workload, plus MFU and KV waste.

    kvscope bench [--quick] [--json] [--profile] [--concurrency N] [engine options]
    make bench

(The command's options are engine/cli/bench.py's; this module is the measurement.)
One workload (random.Random(seed)) of N requests with prompt and output lengths drawn
from wide ranges is sent all at once:

* through the engine (`LLM.generate`, greedy, ignore_eos=True, so every request produces
  exactly its requested number of tokens), and
* through Hugging Face `generate` with static batches of --batch-size requests in arrival
  order (the same dtype as the engine, dense weights): left padding with the EOS token as
  pad, an attention mask, greedy, and max_new_tokens = min_new_tokens = the longest requested
  output of the batch, so a batch runs until its longest request ends. Only requested tokens
  count as generated.

Both get a tiny warm-up first and are timed with time.perf_counter. Equal concurrency is
the default comparison: --concurrency N (default 16) is both the engine's max_num_seqs and
HF's batch size (--batch-size overrides HF's alone). The engine's weights default to dense
here, so both read the same weights; `--weights int4` measures the quantized format.

Definitions used in the report:

* tokens/s: requested (= generated) output tokens / wall seconds of the whole workload.
* MFU: model FLOPs of the workload / seconds / measured peak. The peak is this machine's
  best matmul FLOP/s, measured in the same run (torch.mm at the model's dtype and device,
  a square 1024^3 GEMM and the model's own [256, hidden] x [hidden, intermediate] GEMM,
  best of several repetitions). Model FLOPs count the work a request needs, once:
  each request feeds prompt + output - 1 tokens through the layers (the last sampled token
  is never fed back) at 2 x (layer matmul weights) FLOPs each, computes output rows of
  logits at 2 x hidden x vocab each, and spends 4 x heads x head_dim x context FLOPs per
  layer and fed token on causal attention (QK^T and PV). Work redone after a preemption is
  not useful work: it is reported separately as engine_hfu (hardware FLOPs utilisation),
  counted from what the model runner was actually given.
* KV waste: share of allocated KV slots that never hold a token, from the workload's
  lengths, counting each request as prompt + output tokens of KV at its end:
  kv_waste_paged: each request holds ceil(T / block_size) blocks;
  kv_waste_reserved: each request reserves --reserve-len slots (default: the engine's
  max_model_len), as a contiguous per-request cache sized for the longest request would;
  kv_waste_static_batch: the HF static batch's cache, (longest prompt + longest output of
  the batch) slots per row.
"""
from __future__ import annotations

import functools
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscope.engine.measure.bench_profile import RunnerCounter, install_profile, profile_report
from kvscope.engine.measure.timing import (
    best_of,
    calls_lasting,
    progress_logger,
    sync_device,
)

if TYPE_CHECKING:
    from kvscope.engine.config import EngineConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# (requests, min_prompt, max_prompt, min_output, max_output)
DEFAULT_WORKLOAD = (32, 16, 256, 8, 128)
QUICK_WORKLOAD = (8, 16, 64, 8, 32)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int

    @property
    def total(self) -> int:
        return len(self.prompt) + self.max_tokens


log = progress_logger("bench")


def resolve_workload_args(args) -> None:
    defaults = QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD
    names = ("requests", "min_prompt", "max_prompt", "min_output", "max_output")
    for name, default in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.requests < 1:
        raise ValueError("--requests must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        raise ValueError("need 1 <= --min-prompt <= --max-prompt")
    if not 1 <= args.min_output <= args.max_output:
        raise ValueError("need 1 <= --min-output <= --max-output")
    if args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    args.max_num_seqs = args.concurrency
    if args.batch_size is None:
        args.batch_size = args.concurrency
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")


# -- workload ------------------------------------------------------------------------------
def special_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if get_added is not None:
        ids.update(get_added().values())
    return ids


def build_workload(seed: int, n: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int], vocab_size: int,
                   exclude: set[int]) -> list[Request]:
    """Random token-id prompts (no special tokens) with uniform random lengths."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in exclude]
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        out.append(Request([rng.choice(allowed) for _ in range(plen)], olen))
    return out


# -- FLOPs, peak, KV waste -----------------------------------------------------------------
def matmul_params_per_layer(model) -> int:
    """Weights every fed token multiplies through (all layers): in a mixture-of-experts layer
    the router and top_k experts' matmuls, the active parameters, not every expert's."""
    return sum(_layer_params(layer, model.moe) for layer in model.layers)


def _layer_params(layer, moe) -> int:
    attention = math.prod(layer.qkv.shape) + math.prod(layer.o_proj.shape)
    experts = layer.experts
    if experts is None:
        return attention + math.prod(layer.gate_up.shape) + math.prod(layer.down.shape)
    one = math.prod(experts.gate_up[0].shape) + math.prod(experts.down[0].shape)
    return attention + math.prod(experts.router.shape) + moe.top_k * one


def attention_flops(shape, context_sum: int) -> int:
    """QK^T and PV: 2 matmuls x 2 FLOPs x heads x head_dim per (query, key) pair, per layer."""
    return 4 * shape.num_heads * shape.head_dim * shape.num_layers * context_sum


def model_flops(model, fed_tokens: int, logit_rows: int, context_sum: int) -> int:
    shape = model.shape
    return (2 * matmul_params_per_layer(model) * fed_tokens
            + 2 * math.prod(model.lm_head.shape) * logit_rows
            + attention_flops(shape, context_sum))


def workload_flops(model, reqs: list[Request]) -> int:
    """Useful model FLOPs: each request once, prompt + output - 1 tokens fed, causal."""
    fed = sum(r.total - 1 for r in reqs)
    rows = sum(r.max_tokens for r in reqs)
    ctx = sum(n * (n + 1) // 2 for n in (r.total - 1 for r in reqs))
    return model_flops(model, fed, rows, ctx)



def measure_matmul_flops(device: str, dtype, shapes: list[tuple[int, int, int]],
                         reps: int = 5, min_seconds: float = 0.05) -> dict[str, float]:
    """Best FLOP/s per (m, k, n) shape of torch.mm and, on the CPU, of the engine's own matmul
    kernel (kernels.cpu_linear, which beats torch's on some CPUs), each best of `reps`
    timed loops: the peak the MFU is taken against."""
    import torch

    from kvscope.kernels import cpu_linear

    results = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        runs = [functools.partial(torch.mm, a, b)]
        w = b.t().contiguous()
        if cpu_linear.supports(w):
            runs.append(functools.partial(cpu_linear.native_linear, a, w))
        rates = [_best_rate(run, 2 * m * k * n, device, reps, min_seconds) for run in runs]
        results[f"{m}x{k}x{n}"] = max(rates)
    return results


def _best_rate(run: Callable[[], object], flops: int, device: str, reps: int,
               min_seconds: float) -> float:
    """FLOP/s of the best of `reps` runs, each of enough calls to last min_seconds."""
    calls = calls_lasting(run, min_seconds, device=device)
    return flops / best_of(run, reps, calls=calls, warmup=0, device=device)


def kv_waste(reqs: list[Request], block_size: int, reserve_len: int,
             batch_size: int) -> dict[str, float]:
    used = sum(r.total for r in reqs)
    paged = sum(math.ceil(r.total / block_size) * block_size for r in reqs)
    reserved = sum(max(reserve_len, r.total) for r in reqs)
    static = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        row = max(len(r.prompt) for r in batch) + max(r.max_tokens for r in batch)
        static += row * len(batch)
    return {
        "kv_waste_paged": 1 - used / paged,
        "kv_waste_reserved": 1 - used / reserved,
        "kv_waste_static_batch": 1 - used / static,
    }


class CpuMonitor:
    """Share of the machine's CPU time other processes used during a timed phase (Linux).

    The benchmark is only meaningful on an otherwise idle machine: on a 2-core box one
    busy neighbour halves the throughput of both measured systems, unevenly.
    """

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system . . irq softirq steal
        t = os.times()
        return busy / hz, t.user + t.system, time.perf_counter()

    def other_load(self) -> float | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        busy = end[0] - self.start[0]
        own = end[1] - self.start[1]
        wall = end[2] - self.start[2]
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1))) if wall > 0 else None


# -- engine --------------------------------------------------------------------------------
def run_engine(args, reqs: list[Request], llm) -> dict:
    from kvscope.engine import SamplingParams

    engine = llm.engine
    vocab = engine.model.shape.vocab_size
    # Warm-up: a few short requests (prompts of other random tokens: no prefix-cache hits).
    wrng = random.Random(args.seed + 1)
    warm = [[wrng.randrange(100, vocab) for _ in range(24)] for _ in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    before = llm.stats()

    profile = install_profile(engine) if args.profile else None
    counter = RunnerCounter(engine)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    log(f"engine: {len(reqs)} requests ...")
    monitor = CpuMonitor()
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    sync_device(engine.device)
    seconds = time.perf_counter() - t0
    after = llm.stats()

    got = [len(o.token_ids) for o in outs]
    want = [r.max_tokens for r in reqs]
    if got != want:
        bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        raise RuntimeError(f"engine produced other output lengths than requested: {bad[:5]}")
    result = {
        "seconds": seconds,
        "outputs": [list(o.token_ids) for o in outs],
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "fed_tokens": counter.fed_tokens,
        "flops_executed": model_flops(engine.model, counter.fed_tokens, counter.logit_rows,
                                      counter.context_sum),
        "peak_used_blocks": counter.peak_used_blocks,
        "max_batch_seqs": counter.max_batch_seqs,
        "stats": after,
        "other_cpu_load": monitor.other_load(),
    }
    if profile is not None:
        profile["timers"]["bench_counting"] = counter.timer
        result["profile"] = profile_report(profile, seconds, engine.config.max_num_seqs)
    return result


# -- Hugging Face baseline -----------------------------------------------------------------
def load_hf(checkpoint, device: str, dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    return model.to(device).eval()


def hf_generate_batch(model, batch: list[Request], pad_id: int, device: str) -> list[list[int]]:
    import torch

    width = max(len(r.prompt) for r in batch)
    max_new = max(r.max_tokens for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                         pad_token_id=pad_id, eos_token_id=pad_id,
                         temperature=None, top_p=None, top_k=None)
    new = out[:, width:].tolist()
    return [row[:r.max_tokens] for row, r in zip(new, batch, strict=True)]


def run_hf(args, reqs: list[Request], model, pad_id: int, device: str) -> dict:
    import torch

    with torch.inference_mode():
        wrng = random.Random(args.seed + 2)
        vocab = model.config.vocab_size
        warm = [Request([wrng.randrange(100, vocab) for _ in range(n)], 4) for n in (16, 24)]
        hf_generate_batch(model, warm, pad_id, device)
        outputs: list[list[int]] = []
        bs = args.batch_size
        log(f"hf: {len(reqs)} requests in static batches of {bs} ...")
        fed = [0]
        hook = model.register_forward_pre_hook(count_input_tokens(fed), with_kwargs=True)
        monitor = CpuMonitor()
        t0 = time.perf_counter()
        try:
            for i in range(0, len(reqs), bs):
                outputs += hf_generate_batch(model, reqs[i:i + bs], pad_id, device)
            sync_device(device)
        finally:
            hook.remove()
        seconds = time.perf_counter() - t0
    short = [i for i, (o, r) in enumerate(zip(outputs, reqs, strict=True))
             if len(o) != r.max_tokens]
    if short:
        raise RuntimeError(f"HF stopped early on requests {short[:5]}")
    return {"seconds": seconds, "outputs": outputs, "other_cpu_load": monitor.other_load(),
            "fed_tokens": fed[0]}


def count_input_tokens(fed: list[int]):
    """A forward pre-hook adding each call's input positions (padding included) to fed[0]:
    the token rows HF's static batches put through the model."""
    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            fed[0] += ids.numel()
    return hook


# -- report --------------------------------------------------------------------------------
def run_bench(args, config: EngineConfig) -> dict:
    """Run the whole benchmark on an engine built from `config`, with the workload options of
    `args` (resolve_workload_args already applied); returns the report dict (what --json
    prints)."""
    import torch

    from kvscope.engine import LLM

    log("loading the engine ...")
    t0 = time.perf_counter()
    llm = LLM(config)
    log(f"engine loaded in {time.perf_counter() - t0:.1f} s")
    engine = llm.engine
    shape = engine.model.shape
    tok = llm.tokenizer
    reqs = build_workload(args.seed, args.requests, (args.min_prompt, args.max_prompt),
                          (args.min_output, args.max_output), shape.vocab_size,
                          special_token_ids(tok))
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    gen_tokens = sum(r.max_tokens for r in reqs)
    max_len = engine.max_model_len
    too_long = [r.total for r in reqs if r.total > max_len]
    if too_long:
        raise ValueError(f"requests of {max(too_long)} tokens exceed max_model_len={max_len}")

    mm_shapes = [(1024, 1024, 1024), (256, shape.hidden_size, engine.model.layers[0].down.shape[1])]
    log("measuring matmul peak ...")
    mm_start = measure_matmul_flops(engine.device, engine.dtype, mm_shapes)

    eng = run_engine(args, reqs, llm)
    hf = None
    if not args.skip_hf:
        log("loading the Hugging Face reference ...")
        hf_model = load_hf(engine.loaded.checkpoint, engine.device, engine.dtype)
        pad_id = tok.eos_token_id if tok.eos_token_id is not None else 0
        hf = run_hf(args, reqs, hf_model, pad_id, engine.device)
        del hf_model

    log("measuring matmul peak again ...")
    mm_end = measure_matmul_flops(engine.device, engine.dtype, mm_shapes)
    mm = {k: max(mm_start[k], mm_end[k]) for k in mm_start}
    peak = max(mm.values())
    useful_flops = workload_flops(engine.model, reqs)
    stats = eng["stats"]
    reserve_len = args.reserve_len or stats.max_model_len
    report = {
        "num_requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "engine_seconds": eng["seconds"],
        "engine_tokens_per_s": gen_tokens / eng["seconds"],
        "engine_total_tokens_per_s": (prompt_tokens + gen_tokens) / eng["seconds"],
        "hf_seconds": hf and hf["seconds"],
        "hf_tokens_per_s": hf and gen_tokens / hf["seconds"],
        "speedup": hf and hf["seconds"] / eng["seconds"],
        # The speedup's two factors: how many fewer token rows the engine puts through the
        # model (HF's padding, prompt and output), times how much faster it is per row.
        "engine_fed_tokens": eng["fed_tokens"],
        "hf_fed_tokens": hf and hf["fed_tokens"],
        "fewer_rows": hf and hf["fed_tokens"] / eng["fed_tokens"],
        "faster_per_row": hf and (hf["seconds"] / hf["fed_tokens"]) / (
            eng["seconds"] / eng["fed_tokens"]),
        "matmul_gflops": peak / 1e9,
        "matmul_gflops_by_shape": {k: v / 1e9 for k, v in mm.items()},
        "matmul_gflops_start": max(mm_start.values()) / 1e9,
        "matmul_gflops_end": max(mm_end.values()) / 1e9,
        "model_gflops_useful": useful_flops / 1e9,
        "engine_achieved_gflops": useful_flops / eng["seconds"] / 1e9,
        "engine_mfu": useful_flops / eng["seconds"] / peak,
        "engine_hfu": eng["flops_executed"] / eng["seconds"] / peak,
        "hf_mfu": hf and useful_flops / hf["seconds"] / peak,
        "num_preemptions": eng["num_preemptions"],
        "recomputed_tokens": eng["fed_tokens"] - sum(r.total - 1 for r in reqs),
        "num_steps": eng["num_steps"],
        "max_batch_seqs": eng["max_batch_seqs"],
        "peak_kv_blocks_used": eng["peak_used_blocks"],
        "num_kv_blocks": stats.num_kv_blocks,
        "peak_kv_pool_usage": eng["peak_used_blocks"] / stats.num_kv_blocks,
        "kv_reserve_len": reserve_len,
        **kv_waste(reqs, stats.block_size, reserve_len, args.batch_size),
        "hf_first_token_match": hf and sum(
            a[:1] == b[:1] for a, b in zip(eng["outputs"], hf["outputs"], strict=True)) / len(reqs),
        "other_cpu_load_engine": eng["other_cpu_load"],
        "other_cpu_load_hf": hf and hf["other_cpu_load"],
        "config": {
            **config.to_dict(),
            "device": engine.device,
            "dtype": stats.dtype,
            "kv_dtype": stats.kv_dtype,
            "weights": stats.weights,
            "kv_bytes_per_token": stats.kv_bytes_per_token,
            "max_model_len": stats.max_model_len,
            "requests": args.requests,
            "prompt_range": [args.min_prompt, args.max_prompt],
            "output_range": [args.min_output, args.max_output],
            "hf_batch_size": args.batch_size,
            "skip_hf": args.skip_hf,
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
        },
    }
    if "profile" in eng:
        report["profile"] = eng["profile"]
    busy = [x for x in (report["other_cpu_load_engine"], report["other_cpu_load_hf"])
            if x is not None]
    if busy and max(busy) > 0.1:
        log(f"warning: other processes used {max(busy) * 100:.0f}% of the CPU during a timed "
            "phase; the numbers are not reliable")
    return report


def _fmt(v, spec: str, unit: str = "") -> str:
    """v formatted with spec, or a dash as wide when v is None."""
    if v is None:
        width = int(spec.split(".")[0] or 0) + len(unit)
        return "-".rjust(width)
    return f"{v:{spec}}{unit}"


def format_table(r: dict) -> str:
    c = r["config"]
    rows = [
        ("workload", (f"{r['num_requests']} requests, prompt {c['prompt_range'][0]}-"
                     f"{c['prompt_range'][1]}, output {c['output_range'][0]}-"
                     f"{c['output_range'][1]} (seed {c['seed']})")),
        ("tokens", f"{r['prompt_tokens']} prompt + {r['generated_tokens']} generated"),
        ("device", (f"{c['device']} {c['dtype']}, {c['weights']} weights, "
                   f"{c['torch_threads']} threads, "
                   f"matmul peak {r['matmul_gflops']:.1f} GFLOP/s ({c['dtype']})")),
        ("concurrency", (f"engine max_num_seqs {c['max_num_seqs']}, "
                        f"HF batch {c['hf_batch_size']}")),
        ("", ""),
        ("", f"{'engine':>12} {'HF static':>12}"),
        ("seconds", f"{_fmt(r['engine_seconds'], '12.2f')} {_fmt(r['hf_seconds'], '12.2f')}"),
        ("generated tok/s", (f"{_fmt(r['engine_tokens_per_s'], '12.1f')} "
                            f"{_fmt(r['hf_tokens_per_s'], '12.1f')}")),
        ("MFU", (f"{_fmt(r['engine_mfu'] * 100, '11.1f', '%')} "
                f"{_fmt(r['hf_mfu'] and r['hf_mfu'] * 100, '11.1f', '%')}")),
        ("speedup", f"{_fmt(r['speedup'], '11.2f', 'x')}"),
        ("tokens through model", (f"{_fmt(r['engine_fed_tokens'], '12.0f')} "
                                 f"{_fmt(r['hf_fed_tokens'], '12.0f')}")),
    ]
    if r["fewer_rows"] is not None:
        rows.append(("speedup split", (f"{r['fewer_rows']:.2f}x fewer token rows (HF pads) x "
                                      f"{r['faster_per_row']:.2f}x faster per row")))
    rows += [
        ("", ""),
        ("engine steps", f"{r['num_steps']} (max {r['max_batch_seqs']} seqs in a step)"),
        ("preemptions", (f"{r['num_preemptions']} ({r['recomputed_tokens']} tokens recomputed, "
                        f"HFU {r['engine_hfu'] * 100:.1f}%)")),
        ("KV pool", (f"{r['num_kv_blocks']} blocks of {c['block_size']}, peak use "
                    f"{r['peak_kv_pool_usage'] * 100:.0f}%")),
        ("KV waste paged", f"{r['kv_waste_paged'] * 100:.1f}% of allocated slots never written"),
        ("KV waste reserved", (f"{r['kv_waste_reserved'] * 100:.1f}% "
                              f"(reserving {r['kv_reserve_len']} per request)")),
        ("KV waste HF batch", f"{r['kv_waste_static_batch'] * 100:.1f}% (padded static batches)"),
    ]
    loads = [r["other_cpu_load_engine"], r["other_cpu_load_hf"]]
    if any(x is not None for x in loads):
        rows.append(("other CPU load", " ".join(_fmt(x and x * 100, "11.0f", "%") for x in loads)
                     + "  (other processes; should be ~0%)"))
    if r["hf_first_token_match"] is not None:
        rows.append(("first-token match", (f"{r['hf_first_token_match'] * 100:.0f}% of requests "
                                          "(engine vs HF greedy)")))
    if "profile" in r:
        p = r["profile"]
        rows.append(("", ""))
        rows.append(("profile", (f"{p['num_steps']} steps, {p['step_seconds']:.2f} s in step(), "
                                f"{p['outside_step_seconds']:.2f} s outside")))
        rows.append(("host overhead", (f"{p['host_overhead_ms_per_step']:.3f} ms per step wall, "
                                      f"{p['host_overhead_cpu_ms_per_step']:.3f} ms CPU "
                                      "(step minus model forward and logits)")))
        for name, share in p["share_of_step"].items():
            rows.append((f"  {name}", f"{share * 100:5.1f}%  ({p['seconds'][name]:.2f} s)"))
        for label, d in (("decode-only steps", p["decode_only"]),
                         (f"  at {p['decode_only_full_batch']['seqs']} seqs",
                          p["decode_only_full_batch"])):
            rows.append((label, (f"{d['steps']} steps (mean {d['mean_seqs']:.1f} seqs), host "
                                 f"overhead {d['host_overhead_ms_per_step']:.3f} ms wall, "
                                 f"{d['host_overhead_cpu_ms_per_step']:.3f} ms CPU per step")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)
