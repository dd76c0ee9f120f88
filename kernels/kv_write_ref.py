"""Scatter a step's new K/V rows into their slots of the paged pool (torch reference)."""
from __future__ import annotations

import torch


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [T, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].

    A slot is block_id * block_size + offset, so the pool viewed as one long row of slots is
    indexed directly.
    """
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
