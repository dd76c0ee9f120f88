"""Poisoned KV pools and random paged batches, for the kernel tests and the device checks.

Poison: NaN for float pools, code -128 (never produced by the quantizer) or the fp8 NaN byte
0x7F for int8/fp8 pools, NaN scales. A slot a kernel should have written and did not is
still poisoned; one it should not have read carries NaN into the output.
"""
from __future__ import annotations

import torch

from kvscope.kernels.attention_ref import AttentionMetadata, group_decode_rows
from kvscope.kernels.quant import is_quantized

FP8 = torch.float8_e4m3fn


def poisoned_pool(dtype, num_blocks, block_size, kv_heads, head_dim, device="cpu"):
    """(k_cache, v_cache, k_scale, v_scale), every element poisoned."""
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def cache():
        if dtype == torch.int8:
            return torch.full(shape, -128, dtype=torch.int8, device=device)
        if dtype == FP8:
            return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def scales():
        if not is_quantized(dtype):
            return None
        return torch.full(shape[:3], float("nan"), device=device)

    return cache(), cache(), scales(), scales()


def clone_pool(pool):
    return tuple(None if t is None else t.clone() for t in pool)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN poison compares equal to itself."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """Mask of elements still holding the poison."""
    if t.dtype == torch.int8:
        return t == -128
    if t.dtype == FP8:
        return t.view(torch.uint8) == 0x7F
    return torch.isnan(t.float())


def sanitized(pool):
    """The pool with poison replaced by zeros (for the reference, whose gathers read whole
    blocks and would carry NaN into masked positions)."""
    out = []
    for t in pool:
        if t is not None:
            t = t.clone()
            (t.view(torch.uint8) if t.dtype == FP8 else t)[poisoned(t)] = 0
        out.append(t)
    return tuple(out)


def build_batch(q_lens, ctx_lens, block_size, heads, kv_heads, head_dim, num_blocks, seed):
    """Random float32 pool with a scattered block table per sequence; queries are each
    sequence's last q_len positions. Returns (query, k_cache, v_cache, meta, tables)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-ctx // block_size))] for ctx in ctx_lens]
    bt = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=g)
    meta = AttentionMetadata(
        query_start_loc=starts, context_lens=list(ctx_lens), block_tables=bt,
        slot_mapping=torch.zeros(0, dtype=torch.long),
        decode_groups=group_decode_rows(starts, list(ctx_lens), max_group=2),
        prefill_seqs=[i for i, n in enumerate(q_lens) if n > 1])
    return query, k_cache, v_cache, meta, tables
