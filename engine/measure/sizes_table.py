"""The table `kvscope bench --sizes` prints (engine/measure/sizes.py): per shape and weight
format, kvscope beside llama.cpp's peer format, the ratio, and each decode's achieved read
bandwidth as a share of the bandwidth measured in the same run."""
from __future__ import annotations

from kvscope.engine.measure.bandwidth import share

WIDTHS = (14, 13, 14, 10, 10, 8, 17, 17)


def _rate(rates: dict, n: int) -> float | None:
    """rates[n]; a result read back from --json has its keys as strings."""
    got = rates.get(n, rates.get(str(n)))
    return float(got) if got else None


def metrics(result: dict) -> list[tuple[str, int, str]]:
    """(kind, length or B, label) of every row a format gets."""
    rows = [("prefill", result["prompt"], f"prefill {result['prompt']}")]
    rows += [("decode", n, f"decode @{n}") for n in result["contexts"]]
    rows += [("batched", b, f"B={b} S t/s") for b in result["batches"]]
    return rows


def decode_bandwidth(side: dict, kv_per_token: float, context: int, gbs: float
                     ) -> tuple[float, float] | None:
    """(GB/s achieved, share of gbs) of one side's decode after `context` tokens, or None."""
    rate = _rate(side.get("decode", {}), context)
    if rate is None or "weight_bytes" not in side:
        return None
    per_token = side["weight_bytes"] + kv_per_token * context
    return per_token * rate / 1e9, share(per_token, rate, gbs)


def _bw_cell(got: tuple[float, float] | None) -> str:
    return f"{got[0]:.1f} GB/s {100 * got[1]:3.0f}%" if got else "-"


def _line(cells: list[str]) -> str:
    first = "".join(f"{c:<{w}}" for c, w in zip(cells[:3], WIDTHS[:3], strict=True))
    return first + "".join(f"{c:>{w}}" for c, w in zip(cells[3:], WIDTHS[3:], strict=True))


def format_table(r: dict) -> str:
    bw = r["bandwidth"]
    lines = [f"{r['cpu']} ({r.get('cpu_flags', '')}), {r['threads']} threads, OpenMP wait "
             f"{r['omp_wait']}, kvscope KV {r['kv_dtype']}",
             f"memory, measured in this run: read {bw['read_gbs']:.1f} GB/s, copy "
             f"{bw['copy_gbs']:.1f} GB/s",
             f"decode: median of {r['steps']} steps; B requests: PP {r['batch_prompt']} in, "
             f"TG {r['batch_tokens']} out, S t/s = (PP + TG) x B / seconds",
             "BW: a decode token's bytes (weights as stored + KV at that context) x tok/s, "
             "and its share of the read bandwidth", ""]
    if not r.get("native_kernels", True):
        lines.insert(0, "(the native CPU kernels did not build: kvscope ran its torch kernels)")
    lines.append(_line(["shape", "format", "row", "kvscope", "llama.cpp", "ratio",
                        "kvscope BW", "llama.cpp BW"]))
    read = bw["read_gbs"]
    for name, shape in r["shapes"].items():
        for fmt, row in shape["formats"].items():
            ours, theirs = row["kvscope"], row.get("llama.cpp", {})
            for kind, n, label in metrics(r):
                a, b = _rate(ours[kind], n), _rate(theirs.get(kind, {}), n)
                cells = [name, f"{fmt} / {row['peer']}", label,
                         f"{a:.1f}" if a else "-", f"{b:.1f}" if b else "-",
                         f"{a / b:.2f}x" if a and b else "-", "-", "-"]
                if kind == "decode":
                    cells[6] = _bw_cell(decode_bandwidth(ours, ours["kv_bytes_per_token"], n,
                                                         read))
                    cells[7] = _bw_cell(decode_bandwidth(
                        theirs, shape.get("f16_kv_bytes_per_token", 0), n, read))
                lines.append(_line(cells))
            if not ours.get("fused_decode", True):
                lines.append(f"  (kvscope {fmt}: {ours.get('decode_path') or 'not fused'})")
            lines += [f"  llama.cpp error: {e}" for e in theirs.get("errors", [])]
        if "llama_error" in shape:
            lines.append(f"  llama.cpp: {shape['llama_error']}")
    if "llama_skipped" in r:
        lines += ["", f"llama.cpp: skipped ({r['llama_skipped']})"]
    return "\n".join(lines)
