"""Copy one KV block out of the pool and back in, bit for bit: every tensor that holds it.

A block of a KVPool lives at index block_id of each layer's K and V and, for int8/fp8, of
their per-(slot, head) scales. The rotation and the K calibration are per pool (per model),
not per block: they are in the tier key (engine/kv_cache/tier_key.py), so a block only ever
goes back into a pool that reads it the same way. Anchor rows are per opening, not per block;
a pool that keeps them takes no tiers (engine/config.py refuses the combination).

On CUDA, read() copies asynchronously into pinned host memory on the compute stream: a later
kernel that overwrites the block is ordered after the copy, and PyTorch's pinned allocator
keeps the host buffer until the copy is done. write() is asynchronous the same way.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvscope.engine.kv_cache.pool import KVPool

Layout = list[tuple[tuple[int, ...], torch.dtype]]  # per tensor of a block: shape, dtype


class BlockIO(Protocol):
    """What the tiers need of a pool: its block layout, and block copies out and in."""

    layout: Layout
    block_nbytes: int

    def read(self, block_id: int) -> list[torch.Tensor]: ...

    def read_now(self, block_id: int) -> list[torch.Tensor]: ...

    def write(self, block_id: int, payload: list[torch.Tensor]) -> None: ...


def block_tensors(pool: KVPool) -> list[torch.Tensor]:
    """The pool tensors a block lives in, in a fixed order (the disk format's): per layer K,
    V, then K and V scales when quantized."""
    out: list[torch.Tensor] = []
    for i, (k, v) in enumerate(pool.caches):
        out += [k, v]
        if pool.scales is not None:
            out += list(pool.scales[i])
    return out


class PoolBlocks:
    """BlockIO over a KVPool's tensors (leading dimension: the block id)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.layout: Layout = [(tuple(t.shape[1:]), t.dtype) for t in tensors]
        self.block_nbytes = sum(t[0].nbytes for t in tensors)
        self.pinned = bool(tensors) and tensors[0].device.type == "cuda"

    @classmethod
    def of(cls, pool: KVPool) -> PoolBlocks:
        return cls(block_tensors(pool))

    def read(self, block_id: int) -> list[torch.Tensor]:
        out = []
        for t in self.tensors:
            src = t[block_id]
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pinned)
            dst.copy_(src, non_blocking=self.pinned)
            out.append(dst)
        return out

    def read_now(self, block_id: int) -> list[torch.Tensor]:
        """read(), complete on return (what a file write needs)."""
        out = self.read(block_id)
        if self.pinned:
            torch.cuda.current_stream(self.tensors[0].device).synchronize()
        return out

    def write(self, block_id: int, payload: list[torch.Tensor]) -> None:
        for t, src in zip(self.tensors, payload, strict=True):
            t[block_id].copy_(src, non_blocking=self.pinned)
