"""Preallocated buffers for a step's packed metadata: one host-to-device copy, no allocation.

engine.model_runner packs every integer field of a step (input ids, positions, slots, the
block tables) into one int64 host tensor. Here that tensor lands in a buffer allocated once:
on CUDA a pinned host staging buffer and a device buffer, so the copy is a non-blocking DMA
and no step allocates; on the CPU the device buffer is the destination itself. The buffers
grow (never shrink) when a step is larger than any before, e.g. a scoring pass over a long
prompt.

Reusing the pinned buffer is safe because every step ends in a host read of its logits (the
sampler), which waits for the stream, so the previous step's copy is done before the next
step writes the staging buffer again.
"""
from __future__ import annotations

import torch


class StepBuffers:
    def __init__(self, device: str, capacity: int = 4096) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.capacity = 0
        self.staging: torch.Tensor | None = None
        self.buffer = torch.empty(0, dtype=torch.long)
        self._grow(capacity)

    def _grow(self, need: int) -> None:
        size = max(need, 2 * self.capacity)
        if self.pinned:
            self.staging = torch.empty(size, dtype=torch.long, pin_memory=True)
        self.buffer = torch.empty(size, dtype=torch.long, device=self.device)
        self.capacity = size

    def load(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed` (int64, on the host) copied into the device buffer; its view there."""
        n = packed.numel()
        if n > self.capacity:
            self._grow(n)
        dst = self.buffer[:n]
        if self.staging is None:
            dst.copy_(packed)
            return dst
        stage = self.staging[:n]
        stage.copy_(packed)
        dst.copy_(stage, non_blocking=True)
        return dst
