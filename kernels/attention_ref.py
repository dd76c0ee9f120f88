"""Paged attention over block tables for a varlen batch of decode rows and prefill chunks.

Torch reference: the CPU path of the engine and the oracle the Triton kernels are tested
against. Queries of a sequence are the last q_len of its context_len tokens, whose K/V are
already in the pool; each query attends causally to everything up to its own position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.quant import dequantize


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch; the *_list fields avoid device syncs."""
    query_start_loc: list[int]        # [B + 1] offsets of each sequence's queries
    context_lens: list[int]           # [B] tokens in the cache after this step's write
    block_tables: torch.Tensor        # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor        # [T] int64
    # Single-query sequences in groups of similar length: (query rows, context lengths, batch indices).
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    prefill_seqs: list[int]           # indices of sequences with several queries
    # The pool's K/V rotation R [head_dim, head_dim] (kernels.rotation), None if unrotated;
    # kernels.ops applies it, the references here always see plain tensors.
    rotation: torch.Tensor | None = None


def group_decode_rows(query_start_loc: list[int], context_lens: list[int],
                      max_group: int = 256, max_padding: float = 0.25
                      ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decode sequences sorted by length and cut into as few groups as keep the padding
    (gathered slots past a sequence's length) under `max_padding` of a group's slots, so
    one long sequence does not make every short one gather out to its length, while
    similar lengths share one gather and one attention call per layer."""
    decode = [i for i in range(len(context_lens))
              if query_start_loc[i + 1] - query_start_loc[i] == 1]
    decode.sort(key=lambda i: context_lens[i])
    groups: list[list[int]] = []
    used = 0
    for i in decode:
        n = context_lens[i]
        group = groups[-1] if groups else None
        # Sorted ascending: a new member is the longest, so the group pads out to it.
        if group is None or len(group) >= max_group \
                or (len(group) + 1) * n * (1 - max_padding) > used + n:
            groups.append([i])
            used = n
        else:
            group.append(i)
            used += n
    return [(torch.tensor([query_start_loc[i] for i in g], dtype=torch.long),
             torch.tensor([context_lens[i] for i in g], dtype=torch.long),
             torch.tensor(g, dtype=torch.long)) for g in groups]


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor,
                  scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """cache[tables] in the compute dtype, dequantized when the pool holds int8/fp8 codes.
    index_select over the flattened table: on CPU it copies whole blocks, where advanced
    indexing computes an offset per element (about twice as slow here)."""
    flat = tables.reshape(-1)
    shape = (*tables.shape, *cache.shape[1:])
    if scales is None:
        return cache.index_select(0, flat).view(shape).to(dtype)
    # Indexing has no fp8 kernel on CPU; the codes travel as raw bytes.
    codes = cache.view(torch.uint8).index_select(0, flat).view(cache.dtype).view(shape)
    return dequantize(codes, scales.index_select(0, flat).view(shape[:-1])).to(dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   scales: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[length, kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = gather_blocks(cache, block_table[:num_blocks], scales, dtype)
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """query: [T, heads, head_dim] -> [T, heads, head_dim]; scales for int8/fp8 pools."""
    out = torch.empty_like(query)
    pool = (k_cache, v_cache, k_scale, v_scale)
    for rows, lens, seqs in meta.decode_groups:
        _decode_attention(query, pool, meta.block_tables[seqs], rows, lens, scale, out)
    for i in meta.prefill_seqs:
        _prefill_attention(query, pool, meta, i, scale, out)
    return out


def _decode_attention(query, pool, tables, starts, lens, scale, out) -> None:
    """A group of single-query sequences at once: one gather of their blocks, then SDPA in
    float32 (CPU SDPA in bfloat16 measured 2-3x slower at one query row), masking the slots
    past each sequence's length."""
    k_cache, v_cache, k_scale, v_scale = pool
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    max_blocks = -(-int(lens.max()) // block_size)
    tables = tables[:, :max_blocks]
    b, span = tables.shape[0], max_blocks * block_size
    k = gather_blocks(k_cache, tables, k_scale, torch.float32)
    v = gather_blocks(v_cache, tables, v_scale, torch.float32)
    k = k.view(b, span, kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, span, kv_heads, head_dim).transpose(1, 2)
    dev = query.device
    starts = starts.to(dev)
    q = query[starts].float().unsqueeze(2)                           # [b, heads, 1, d]
    mask = None
    if int(lens.min()) < span:
        mask = (torch.arange(span, device=dev) < lens.to(dev)[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[starts] = o.squeeze(2).to(out.dtype)


def _prefill_attention(query, pool, meta, i, scale, out) -> None:
    k_cache, v_cache, k_scale, v_scale = pool
    start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
    q_len, ctx = end - start, meta.context_lens[i]
    k = gather_context(k_cache, meta.block_tables[i], ctx, k_scale, query.dtype)
    v = gather_context(v_cache, meta.block_tables[i], ctx, v_scale, query.dtype)
    q = query[start:end].transpose(0, 1)                      # [heads, q_len, d]
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    if q_len == ctx:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:end] = o.transpose(0, 1)
