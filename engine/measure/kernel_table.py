"""`kvscope bench --kernels`: the kernel choices (kernels.kernel_choice) for one model's
matmuls on this machine, with the candidates' times, whether each was measured now or found
in the per-machine cache, and the machine key they are valid for.

It asks for the decisions a run of the model would ask for (each distinct weight shape,
dense, 4-bit or int8 (kernels/cpu_int8.py: its thread split), at every
row bucket up to the concurrency, the layers' weights also at the prefill
bucket; the LM head only ever sees one row per sequence), so the first run on a machine
measures them and later runs print the cache. --remeasure-kernels measures them again (a
choice made while the machine was busy shows a high load average in the table).
"""
from __future__ import annotations

from typing import Any

import torch


def model_decisions(model: Any, concurrency: int) -> list[tuple[Any, int]]:
    """(linear, rows) of every decision the model's matmuls need up to `concurrency` rows:
    dense weights the native kernel takes, 4-bit ones and int8 ones."""
    from kvscope.kernels import cpu_linear

    decode = sorted({cpu_linear.bucket(r) for r in range(1, concurrency + 1)})
    layers = [lin for layer in model.layers for lin in layer.linears()]
    out: list[tuple[Any, int]] = []
    seen: set[tuple[object, ...]] = set()
    for lin, buckets in [(x, [*decode, cpu_linear.TOP_BUCKET]) for x in layers] + [
            (model.lm_head, decode)]:
        shape = _decision_shape(lin)
        if shape is not None and shape not in seen:
            seen.add(shape)
            out += [(lin, b) for b in sorted(set(buckets))]
    return out


def _decision_shape(lin: Any) -> tuple[object, ...] | None:
    """What a decision for this linear is keyed by, or None: no choice is made for it."""
    from kvscope.engine.model.weight_formats import DenseLinear, Int4Linear, Int8Linear
    from kvscope.kernels import cpu_int4

    if isinstance(lin, DenseLinear) and lin.native:
        return (lin.weight.dtype, tuple(lin.weight.shape))
    if isinstance(lin, Int8Linear):
        return ("int8", *lin.shape) if lin.native else None
    if isinstance(lin, Int4Linear):
        n, k = lin.scale_zero.shape[1], lin.in_features
        # the tiles' layout has one kernel: what was chosen is the family ("int4 kernels")
        return ("int4", n, k) if cpu_int4.supports(n, k) and lin.tiles is None else None
    return None


def _name(lin: Any, rows: int) -> str:
    """The chooser's name for the decision of `rows` rows through this linear."""
    from kvscope.engine.model.weight_formats import DenseLinear, Int8Linear
    from kvscope.kernels import cpu_int4, cpu_int8, cpu_linear, kernel_choice

    if isinstance(lin, Int8Linear):
        return cpu_int8.decision_name(rows, *lin.shape)
    if not isinstance(lin, DenseLinear):
        return cpu_int4.decision_name(rows, lin.scale_zero.shape[1], lin.in_features)
    w, threads = lin.weight, torch.get_num_threads()
    label = cpu_linear.bucket_label(rows)
    dtype = str(w.dtype).removeprefix("torch.")
    return (f"linear {dtype} {w.shape[0]}x{w.shape[1]} rows{label} "
            f"{kernel_choice.threads_name(threads)}")


def _ask(lin: Any, rows: int) -> None:
    """Make the decision for `rows` rows through this linear, unless it is made already."""
    from kvscope.engine.model.weight_formats import DenseLinear, Int8Linear
    from kvscope.kernels import cpu_int4, cpu_int8, cpu_linear

    if isinstance(lin, Int8Linear):
        n, k = lin.shape
        if cpu_int8.implementation(rows, n, k) is None:
            cpu_int8.int8_mm(torch.randn(rows, k), lin.codes, lin.scales)
        return
    if isinstance(lin, DenseLinear):
        w = lin.weight
        cpu_linear.implementation(torch.randn(rows, w.shape[1]).to(w.dtype), w)
        return
    n, k = lin.scale_zero.shape[1], lin.in_features
    if lin.packed is not None and cpu_int4.implementation(rows, n, k) is None:
        cpu_int4.int4_mm(torch.randn(rows, k).to(torch.bfloat16), lin.packed, lin.scale_zero)


def decide(model: Any, concurrency: int, remeasure: bool,
           kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Ask for each decision (measuring what the cache lacks); the report dict. kv_dtype:
    the pool's, for the prefill attention's decision (a bfloat16 pool beside float32
    activations: kernels.cpu_prefill_attention)."""
    from kvscope.kernels import cpu_prefill_attention, kernel_choice

    chooser = kernel_choice.default()
    asked = model_decisions(model, concurrency)
    names = [_name(lin, rows) for lin, rows in asked]
    shape = model.shape
    attention = (kv_dtype == torch.bfloat16 and model.dtype == torch.float32
                 and cpu_prefill_attention.FLASH is not None)
    if attention:
        names.append(cpu_prefill_attention.decision_name(shape.num_heads, shape.num_kv_heads,
                                                         shape.head_dim))
    if remeasure:
        chooser.forget(names)
    with torch.inference_mode():
        for lin, rows in asked:
            _ask(lin, rows)
        if attention:
            cpu_prefill_attention.decide_for(shape.num_heads, shape.num_kv_heads,
                                             shape.head_dim)
    table = {d.name: d for d in chooser.table()}
    # the decode attention's thread split is decided by the calls themselves (on their own
    # pools, kernels/decode_split.py): shown as the runs on this machine left it
    names += sorted(n for n in table if n.startswith("decode-attention ") and n not in names)
    # which 4-bit kernels the process runs at every row count (kernels.cpu_int4.family),
    # decided once per machine when the first 4-bit weight was made
    names += sorted(n for n in table if n.startswith("int4 kernels ") and n not in names)
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
            + "".join(f"{n + ' ms':>22}" for n in names) + f"  {'choice':<19}{'':<9}load")
    lines += [head, "-" * len(head)]
    for d in r["decisions"]:
        times = "".join(f"{d['times_ms'][n]:>22.3f}" if n in d["times_ms"] else f"{'-':>22}"
                        for n in names)
        load = d.get("loadavg_1m")
        lines.append(f"{d.get('op', '?'):<7}{d.get('dtype', '?'):<10}{d.get('shape', '?'):>11}"
                     f"{d.get('rows', '?'):>7}{d.get('threads', '?'):>4}  {times}  "
                     f"{d['choice']:<19}{d['source']:<9}{'-' if load is None else load}")
    return "\n".join(lines)
