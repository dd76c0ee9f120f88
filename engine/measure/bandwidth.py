"""The machine's memory bandwidth as a decode sees it: read and copy, on the benchmark's threads.

A decode step reads every weight once, from memory, so its speed limit is bytes per token over
the memory's read rate. Both are measured here, in the benchmark's own run (a shared or virtual
machine's bandwidth moves from hour to hour): read = a sum over a buffer far larger than the
caches (torch's reduction streams it on every thread), copy = bytes read plus bytes written by
a copy between two such buffers. Best of `rounds`, after a warm-up that touches every page.
"""
from __future__ import annotations

import time

MIB = 1 << 20
DEFAULT_MIB = 512


def measure(mib: int = DEFAULT_MIB, rounds: int = 5) -> dict[str, float]:
    """{"read_gbs", "copy_gbs", "buffer_mib"}: GB/s (10^9 bytes) of the best round each."""
    import torch

    n = mib * MIB // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    b.copy_(a)  # first touch of every page, outside the timing
    float(a.sum())
    read = copy = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        float(a.sum())
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        copy = min(copy, time.perf_counter() - t)
    nbytes = n * 4
    return {"read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9,
            "buffer_mib": float(mib)}


def share(bytes_per_token: float, tok_s: float, gbs: float) -> float:
    """The fraction of `gbs` a decode at tok_s reading bytes_per_token a token achieves."""
    return bytes_per_token * tok_s / (gbs * 1e9)
