"""Anchor rows (engine/kv_cache/anchors.py) as the kernels see them: per layer (k, v) float32 of
[entries, n, kv_heads, head_dim], the exact K/V of the first n positions of each opening, in
the pool's own space (rotated, and balanced for K). A sequence with an anchor entry attends
to those rows at positions 0..n-1 instead of the quantized ones; the quantized rows stay in
the pool, so a sequence without an entry attends exactly as without anchors.
"""
from __future__ import annotations

import torch

Anchors = tuple[torch.Tensor, torch.Tensor]


def write_anchors(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                  anchors: Anchors) -> None:
    """key/value [m, kv_heads, head_dim] (already in the pool's space) into anchor rows
    `slots` (entry * n + position)."""
    ak, av = anchors
    ak.view(-1, *ak.shape[2:]).index_copy_(0, slots, key.float())
    av.view(-1, *av.shape[2:]).index_copy_(0, slots, value.float())


def overlay_anchors(rows: torch.Tensor, index: torch.Tensor, anchor: torch.Tensor) -> None:
    """rows [b, span, kv_heads, head_dim] (gathered and dequantized, one row of positions per
    sequence): positions 0..n-1 of every sequence with an entry (index >= 0) become its
    anchor rows, in place."""
    n = min(anchor.shape[1], rows.shape[1])
    has = index >= 0
    if n == 0 or not bool(has.any()):
        return
    exact = anchor[index.clamp_min(0), :n].to(rows.dtype)
    rows[:, :n] = torch.where(has[:, None, None, None], exact, rows[:, :n])
