"""A RunComparison as a plain-text or a Markdown table (runs as columns, each later run's
ratio to the first beside it), then what the runs share and whether outputs matched."""
from __future__ import annotations

from pathlib import Path

from kvscope.engine.traces.compare import PERCENTILES, Pair, RunComparison, RunStats

TOP_DELTAS = 5

_HEAD = [("requests", "requests"), ("succeeded", "succeeded"), ("failed", "failed"),
         ("output_tokens", "output tokens"), ("duration_s", "duration (s)"),
         ("request_throughput", "requests/s"), ("output_throughput", "output tok/s")]
_LATENCY = [(f"{m}_p{q}_ms", f"{label} p{q} (ms)")
            for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
            for q in PERCENTILES]


def _value(s: RunStats, key: str) -> float | int | None:
    if key in s.metrics:
        return s.metrics[key]
    value = getattr(s, key)
    return value if isinstance(value, (int, float)) else None


def _fmt(v: float | int | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _ratio(b: float | int | None, a: float | int | None) -> str:
    return f"{b / a:.3g}x" if a and b is not None else ""


def rows(c: RunComparison) -> tuple[list[str], list[list[str]]]:
    """The header and one row of text cells per metric."""
    letters = [chr(ord("A") + k) if k < 26 else str(k) for k in range(len(c.runs))]
    head = ["", letters[0]]
    for x in letters[1:]:
        head += [x, f"{x}/A"]
    keys = _HEAD + _LATENCY
    if c.slo:
        keys = [*keys, ("goodput", f"goodput req/s ({c.slo})"), ("slo_met", "within SLO")]
    out = []
    first = c.runs[0]
    for key, label in keys:
        row = [label, _fmt(_value(first, key))]
        for s in c.runs[1:]:
            row += [_fmt(_value(s, key)), _ratio(_value(s, key), _value(first, key))]
        out.append(row)
    return head, out


def _legend(c: RunComparison) -> list[str]:
    lines = []
    for k, s in enumerate(c.runs):
        where = f" via {s.server_url}" if s.server_url else ""
        lines.append(f"{chr(ord('A') + k) if k < 26 else k}: {Path(s.name).name} "
                     f"({s.kind}{where}, model {s.model or '-'})")
    return lines


def _pair_lines(c: RunComparison, p: Pair) -> list[str]:
    a, b = c.runs[p.a], c.runs[p.b]
    name = f"{chr(ord('A') + p.b) if p.b < 26 else p.b} vs A"
    lines = [f"{name}: {p.common} requests in both"
             + (f", {len(p.only_a)} only in A, {len(p.only_b)} only in "
                f"{name.split()[0]}" if p.only_a or p.only_b else "")
             + (f"; {p.prompt_len_differs} with other prompt lengths" if p.prompt_len_differs
                else "")]
    o = p.outputs
    if o.identical is None:
        lines.append(f"  greedy outputs not compared: {o.not_compared}")
    else:
        lines.append(f"  greedy outputs {'identical' if o.identical else 'differ'} "
                     f"({o.compared} compared" + (f", differing: {', '.join(o.differing[:8])}"
                                                  if o.differing else "") + ")")
    lines += [f"  not like for like: {note}" for note in p.not_like_for_like]
    med = p.median_delta
    lines.append(f"  median per-request delta: TTFT {_fmt(med['ttft_ms'])} ms, "
                 f"E2E {_fmt(med['e2e_ms'])} ms, output tokens {_fmt(med['output_tokens'])}")
    top = sorted((d for d in p.deltas if d.e2e_ms is not None),
                 key=lambda d: -abs(d.e2e_ms or 0.0))[:TOP_DELTAS]
    for d in top:
        lines.append(f"    {d.id}: E2E {d.e2e_ms:+.4g} ms, TTFT {_fmt(d.ttft_ms)} ms, "
                     f"tokens {d.output_tokens:+d}")
    for s in (a, b):
        for message, n in list(s.errors.items())[:5]:
            lines.append(f"  {Path(s.name).name}: {n} failed: {message}")
    return lines


def _notes(c: RunComparison) -> list[str]:
    lines = []
    for p in c.pairs:
        lines += _pair_lines(c, p)
    return lines


def as_text(c: RunComparison) -> str:
    head, body = rows(c)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = [f"{cell:>{w}}" if i else f"{cell:<{w}}" for i, (cell, w) in
           enumerate(zip(head, widths, strict=True))]
    lines = _legend(c) + ["", "  ".join(fmt).rstrip()]
    for r in body:
        lines.append("  ".join(f"{cell:>{w}}" if i else f"{cell:<{w}}"
                               for i, (cell, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join([*lines, "", *_notes(c)])


def as_markdown(c: RunComparison) -> str:
    head, body = rows(c)
    lines = [f"- {x}" for x in _legend(c)] + [""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in body]
    lines.append("")
    lines += [_bullet(x) for x in _notes(c)]
    return "\n".join(lines)


def _bullet(line: str) -> str:
    depth = len(line) - len(line.lstrip(" "))
    return " " * depth + "- " + line.strip()
