"""`kvscope bench --kernels`: the kernel choices (kernels.kernel_choice) for one model's
matmuls on this machine, with the candidates' times, whether each was measured now or found
in the per-machine cache, and the machine key they are valid for.

It asks for the decisions a run of the model would ask for (each distinct dense weight
shape at every row bucket up to the concurrency, the layers' weights also at the prefill
bucket; the LM head only ever sees one row per sequence), so the first run on a machine
measures them and later runs print the cache. --remeasure-kernels measures them again (a
choice made while the machine was busy shows a high load average in the table).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from kvscope.benchmarks.timing import print_result


def model_decisions(model: Any, concurrency: int) -> list[tuple[torch.Tensor, int]]:
    """(weight, rows) of every decision the model's matmuls need up to `concurrency` rows."""
    from kvscope.engine.weight_formats import DenseLinear
    from kvscope.kernels import cpu_linear

    decode = sorted({cpu_linear.bucket(r) for r in range(1, concurrency + 1)})
    layers = [getattr(layer, n) for layer in model.layers
              for n in ("qkv", "o_proj", "gate_up", "down")]
    out: list[tuple[torch.Tensor, int]] = []
    seen: set[tuple[torch.dtype, tuple[int, ...]]] = set()
    for lin, buckets in [(x, [*decode, cpu_linear.TOP_BUCKET]) for x in layers] + [
            (model.lm_head, decode)]:
        if not (isinstance(lin, DenseLinear) and lin.native):
            continue
        shape = (lin.weight.dtype, tuple(lin.weight.shape))
        if shape not in seen:
            seen.add(shape)
            out += [(lin.weight, b) for b in sorted(set(buckets))]
    return out


def decide(model: Any, concurrency: int, remeasure: bool) -> dict[str, Any]:
    """Ask for each decision (measuring what the cache lacks); the report dict."""
    from kvscope.kernels import cpu_linear, kernel_choice

    chooser = kernel_choice.default()
    asked = model_decisions(model, concurrency)
    threads = torch.get_num_threads()

    def name(w: torch.Tensor, rows: int) -> str:
        dtype = str(w.dtype).removeprefix("torch.")
        label = f"{rows}+" if rows == cpu_linear.TOP_BUCKET else f"<={rows}"
        return f"linear {dtype} {w.shape[0]}x{w.shape[1]} rows{label} threads={threads}"

    names = [name(w, rows) for w, rows in asked]
    if remeasure:
        chooser.forget(names)
    with torch.inference_mode():
        for w, rows in asked:
            cpu_linear.implementation(torch.randn(rows, w.shape[1]).to(w.dtype), w)
    table = {d.name: d for d in chooser.table()}
    return {
        "machine": chooser.key,
        "cache_file": str(chooser.path),
        "cache_ignored_reason": chooser.cache_reason,
        "decisions": [{**table[n].info, "name": n, "choice": table[n].choice,
                       "times_ms": table[n].times_ms,
                       "source": table[n].source}
                      for n in names if n in table],
    }


def format_kernel_table(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"CPU        {m['cpu_model']} (flags: {m['cpu_notable_flags'] or '-'}; "
             f"flags sha {m['cpu_flags_sha256']})",
             f"key        kernel sources {m['kernel_sources_sha256']}, torch {m['torch']}",
             f"cache      {r['cache_file']}"
             + (f" (ignored: reason={r['cache_ignored_reason']})"
                if r["cache_ignored_reason"] else ""), ""]
    names = sorted({c for d in r["decisions"] for c in d["times_ms"]})
    head = (f"{'op':<7}{'dtype':<10}{'weight':>11}{'rows':>7}{'thr':>4}  "
            + "".join(f"{n + ' ms':>18}" for n in names) + f"  {'choice':<14}{'':<9}load")
    lines += [head, "-" * len(head)]
    for d in r["decisions"]:
        times = "".join(f"{d['times_ms'][n]:>18.3f}" if n in d["times_ms"] else f"{'-':>18}"
                        for n in names)
        load = d.get("loadavg_1m")
        lines.append(f"{d.get('op', '?'):<7}{d.get('dtype', '?'):<10}{d.get('shape', '?'):>11}"
                     f"{d.get('rows', '?'):>7}{d.get('threads', '?'):>4}  {times}  "
                     f"{d['choice']:<14}{d['source']:<9}{'-' if load is None else load}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the engine's model as `kvscope bench` would and print its kernel choices."""
    from kvscope.engine import LLM
    from kvscope.engine.cli.options import engine_config_from_args

    args.max_num_seqs = args.concurrency
    llm = LLM(engine_config_from_args(args))
    report = decide(llm.engine.model, args.concurrency, args.remeasure_kernels)
    print_result(report, format_kernel_table, args.json)
    return 0
