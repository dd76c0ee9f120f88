"""The long-context results as text: one line per setting and cell."""
from __future__ import annotations


def _pct(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.0%}"


def _cell_label(cell: dict) -> str:
    if "depth" in cell:
        return f"{cell['length']:>6} {cell['depth']:5.0%}"
    return f"{cell['length']:>6}     -"


def format_long(result: dict) -> str:
    head = (f"{result['task']} on {result['model']}, {result['date']}, {result['probes']} "
            f"probes, {result['seconds']:.0f} s ({result['machine']})")
    lines = [head, f"{'setting':12} {'length':>6} {'depth':>5} {'right':>5} {'=f32':>5} "
                   f"{'agree':>5} {'top1':>5} {'KL':>9} {'rank':>5}"]
    for name, setting in result["settings"].items():
        for c in setting["cells"]:
            lines.append(f"{name:12} {_cell_label(c)} {_pct(c.get('right'))} "
                         f"{_pct(c['same_as_float32'])} {_pct(c['agreement'])} "
                         f"{_pct(c['top1_agreement'])} {c['kl']:9.5f} {c['rank']:5.0f}")
    lines.append("")
    lines.append(f"{'setting':12} {'rotation':>10} {'anchors':>7} {'B/token':>7} {'right':>5} "
                 f"{'=f32':>5} {'mean KL':>9}")
    for name, s in result["settings"].items():
        cells = s["cells"]
        rights = [c["right"] for c in cells if "right" in c]
        right = sum(rights) / len(rights) if rights else None
        same = sum(c["same_as_float32"] for c in cells) / len(cells)
        mean_kl = sum(c["kl"] for c in cells) / len(cells)
        lines.append(f"{name:12} {s['kv_rotation']:>10} {s['kv_anchor_tokens']:7d} "
                     f"{s['kv_bytes_per_token']:7d} {_pct(right)} {_pct(same)} {mean_kl:9.5f}")
    return "\n".join(lines)
