"""The KV pool: per layer K and V of [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import ModelShape


def kv_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    return budget_bytes // (block_size * bytes_per_token)


@dataclass
class KVPool:
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    bytes_per_token: int

    @classmethod
    def allocate(cls, shape: ModelShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str) -> KVPool:
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        caches = [(torch.zeros(dims, dtype=dtype, device=device),
                   torch.zeros(dims, dtype=dtype, device=device))
                  for _ in range(shape.num_layers)]
        return cls(caches, num_blocks, block_size, dtype, kv_bytes_per_token(shape, dtype))

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)
