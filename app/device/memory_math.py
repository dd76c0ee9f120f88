"""Where the device's memory went, as the segments of the Device panel's stacked bar.

Pure arithmetic over an `ipc.messages.DeviceFrame` (no Qt), so the numbers are testable on
their own. Segments, left to right: weights | KV used | KV free | KV cached | other (kvscope) |
other processes | free.
"""
from __future__ import annotations

from dataclasses import dataclass

# Fixed colours (dark theme): KV used matches the batch plots' KV curve, KV cached the block
# map's cached blocks, so one colour means one thing across the window.
COLORS = {
    "weights": "#e5c07b",
    "KV used": "#c678dd",
    "KV free": "#5b4266",
    "KV cached": "#466e96",
    "other (kvscope)": "#e06c75",
    "other processes": "#7f848e",
    "free": "#353b45",
}
NAMES = tuple(COLORS)


@dataclass(frozen=True)
class Segment:
    name: str
    bytes: int  # as measured (negatives clamped to 0): what the legend and tooltip say
    colour: str
    span: float  # bytes of the bar it covers: `bytes`, scaled down if the parts overflow


def memory_segments(frame) -> list[Segment]:
    """The bar's segments over `frame.memory_total`, in drawing order."""
    kv_used = max(0, frame.kv_used_bytes)
    kv_cached = max(0, frame.kv_cached_bytes)
    own_other = ((frame.activations_bytes or 0) + (frame.allocator_free_bytes or 0)
                 + frame.other_bytes)
    raw = {
        "weights": frame.weights_bytes,
        "KV used": kv_used,
        "KV free": frame.kv_pool_bytes - kv_used - kv_cached,
        "KV cached": kv_cached,
        "other (kvscope)": own_other,
        "other processes": frame.memory_used - frame.process_bytes,
        "free": frame.memory_free,
    }
    sizes = {name: max(0, int(v)) for name, v in raw.items()}
    total = max(0, frame.memory_total)
    parts = sum(sizes.values())
    # The parts come from different meters and can add up to more than the device: on CPU the
    # process is its resident set (pages touched) while weights and the KV pool are allocation
    # sizes (an untouched KV pool is not resident yet), and "free" is MemAvailable, which
    # counts reclaimable page cache that "used" may count too. Scale every part by the same
    # factor so the bar still spans exactly the device and the proportions stay honest.
    scale = total / parts if parts > total else 1.0
    return [Segment(name, sizes[name], COLORS[name], sizes[name] * scale) for name in NAMES]


def bar_edges(segments: list[Segment], total: int, width: int) -> list[tuple[int, int]]:
    """Pixel [start, end) of each segment on a bar `width` pixels wide. Edges are rounded
    from the running sum, so neighbours touch and widths stay proportional to bytes."""
    if total <= 0 or width <= 0:
        return [(0, 0) for _ in segments]
    edges, acc = [], 0.0
    for seg in segments:
        start = round(acc / total * width)
        acc += seg.span
        edges.append((start, min(width, round(acc / total * width))))
    return edges
