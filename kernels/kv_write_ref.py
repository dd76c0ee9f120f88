"""Scatter a step's new K/V rows into their slots of the paged pool (torch reference)."""
from __future__ import annotations

import torch

from kvscope.kernels.quant import is_quantized, quantize


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """key/value: [T, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim];
    scales (int8/fp8 caches only): [num_blocks, block_size, kv_heads] float32.

    A slot is block_id * block_size + offset, so the pool viewed as one long row of slots is
    indexed directly.
    """
    _write(key, k_cache, k_scale, slot_mapping)
    _write(value, v_cache, v_scale, slot_mapping)


def _write(x: torch.Tensor, cache: torch.Tensor, scale_cache: torch.Tensor | None,
           slot_mapping: torch.Tensor) -> None:
    num_slots = cache.shape[0] * cache.shape[1]
    flat = cache.view(num_slots, *cache.shape[2:])
    if not is_quantized(cache.dtype):
        flat.index_copy_(0, slot_mapping, x.to(cache.dtype))
        return
    if scale_cache is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its scale cache")
    codes, scale = quantize(x, cache.dtype)
    # index_copy_ has no fp8 kernel on CPU: move the codes as raw bytes.
    flat.view(torch.uint8).index_copy_(0, slot_mapping, codes.view(torch.uint8))
    scale_cache.view(num_slots, -1).index_copy_(0, slot_mapping, scale)
