"""The KV tiers beside the pool in the block map (issue 56): a host-tier strip and a disk count.

The blocks frame carries the tiers' sizes (BlocksFrame.tier_*; zero from an engine without
tiers, and then nothing is shown). The strip is the host tier's fill in cells of the cached
colour, so a prefix evicted from the pool visibly lands there and leaves when copied back.
"""
from __future__ import annotations

from kvscope.app import colors
from kvscope.app.fmt import human_bytes

STRIP_CELLS = 24


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def tier_lines(frame) -> list[str]:
    """HTML lines for the totals label: the host tier's strip, the disk tier's count."""
    host = getattr(frame, "tier_host_blocks", 0)
    capacity = getattr(frame, "tier_host_capacity_blocks", 0)
    disk = getattr(frame, "tier_disk_blocks", 0)
    disk_bytes = getattr(frame, "tier_disk_bytes", 0)
    lines = []
    if capacity:
        filled = min(STRIP_CELLS, round(STRIP_CELLS * host / capacity))
        if host and not filled:
            filled = 1  # one block is still something to see
        strip = (f"<span style='color:{_hex(colors.CACHED_RGB)}'>{'▮' * filled}</span>"
                 f"<span style='color:{_hex(colors.FREE_RGB)}'>{'▮' * (STRIP_CELLS - filled)}"
                 "</span>")
        lines.append(f"host tier: <b>{host:,}</b> of {capacity:,} blocks<br>{strip}")
    if disk or disk_bytes:
        lines.append(f"disk tier: <b>{disk:,}</b> blocks · {human_bytes(disk_bytes)}")
    return lines
