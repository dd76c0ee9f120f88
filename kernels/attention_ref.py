"""Paged attention over block tables for a varlen batch of decode rows and prefill chunks.

Torch reference: the CPU path of the engine and the oracle the Triton kernels are tested
against. Queries of a sequence are the last q_len of its context_len tokens, whose K/V are
already in the pool; each query attends causally to everything up to its own position, or
with a sliding window W to the last W positions up to it (blocks wholly before the window
are never read: the block manager may have freed them), optionally with gemma2's logit
soft-capping.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.kernels.anchors import Anchors, overlay_anchors
from kvscope.kernels.quant import dequantize

# One group of single-query sequences: (query rows, context lengths, batch indices).
DecodeGroup = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# One layer's pool as the references read it: (k_cache, v_cache, k_scale, v_scale, anchors).
LayerPool = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                  Anchors | None]


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch; the *_list fields avoid device syncs."""
    query_start_loc: list[int]        # [B + 1] offsets of each sequence's queries
    context_lens: list[int]           # [B] tokens in the cache after this step's write
    block_tables: torch.Tensor        # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor        # [T] int64
    # Single-query sequences in groups of similar length (engine.model_runner builds them
    # lazily, as a Sequence that groups on first use).
    decode_groups: Sequence[DecodeGroup]
    prefill_seqs: list[int]           # indices of sequences with several queries
    # The pool's K/V rotation R [head_dim, head_dim] (kernels.rotation), None if unrotated;
    # kernels.ops applies it, the references here always see plain tensors.
    rotation: torch.Tensor | None = None
    # Anchor tokens (kernels.anchors, 1-byte pools): per sequence its anchor entry, -1 for
    # none ([B] int64 on the host), and the step's anchor writes (batch rows, anchor rows).
    anchor_index: torch.Tensor | None = None
    anchor_fill: tuple[torch.Tensor, torch.Tensor] | None = None
    # Of prefill_seqs, those whose queries are one decode token and its speculative drafts.
    verify_seqs: frozenset[int] = frozenset()


def group_decode_rows(query_start_loc: list[int], context_lens: list[int],
                      max_group: int = 256, max_padding: float = 0.25
                      ) -> list[DecodeGroup]:
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
                   dtype: torch.dtype = torch.float32, first_block: int = 0) -> torch.Tensor:
    """[length - first_block * block_size, kv_heads, head_dim]: positions from the start of
    block `first_block` (a window's first block) to `length` of one sequence, read through
    its block table; entries before `first_block` are never read."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = gather_blocks(cache, block_table[first_block:num_blocks], scales, dtype)
    rows = rows.reshape((num_blocks - first_block) * block_size, *cache.shape[2:])
    return rows[:length - first_block * block_size]


def check_window_softcap(window: int, softcap: float) -> None:
    """The window/softcap arguments every attention path takes, validated the same way."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window), got {window!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")


def window_start(position: int, window: int) -> int:
    """The first key position a query at `position` attends to (0 without a window)."""
    return max(0, position - window + 1) if window else 0


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        anchors: Anchors | None = None, *, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """query: [T, heads, head_dim] -> [T, heads, head_dim]; scales for int8/fp8 pools;
    anchors (kernels.anchors, with meta.anchor_index) replace the first positions of the
    sequences that have an entry. window W > 0: a query at position p attends to keys j with
    p - W < j <= p, and blocks wholly before the window of a sequence's first query are
    never read (their table entries may be -1). softcap c > 0: every score s becomes
    c * tanh(s / c) before masking and softmax (gemma2)."""
    check_window_softcap(window, softcap)
    if meta.anchor_index is None:
        anchors = None
    pool: LayerPool = (k_cache, v_cache, k_scale, v_scale, anchors)
    plans = decode_plans(meta, k_cache.shape[1], query.device, window)
    if len(plans) == 1 and not meta.prefill_seqs and plans[0].rows == slice(0, len(query)):
        # Every row decodes in one group, in order (a single chat, a steady batch): the
        # attention output is the result, with no scatter into a fresh tensor.
        return _decode_attention(query, pool, plans[0], scale, softcap).to(query.dtype)
    out = torch.empty_like(query)
    for plan in plans:
        out[plan.rows] = _decode_attention(query, pool, plan, scale, softcap).to(out.dtype)
    for i in meta.prefill_seqs:
        _prefill_attention(query, pool, meta, i, scale, out, window, softcap)
    return out


@dataclass
class DecodePlan:
    """What every layer of a step needs for one decode group, worked out once per step: the
    layers differ only in the pool they read."""
    rows: slice | torch.Tensor   # the group's query rows (a slice when they are consecutive)
    flat_blocks: torch.Tensor    # [b * max_blocks] the blocks to gather, row by row
    num_seqs: int
    span: int                    # max_blocks * block_size slots gathered per sequence
    # [b, 1, 1, span] float: 0 for slots within each length (and window), -inf elsewhere
    # (additive, so SDPA does not convert a boolean mask in every layer); None if every slot
    # counts.
    mask: torch.Tensor | None
    anchor_index: torch.Tensor | None = None  # [b] the group's anchor entries (-1: none)
    # [b] the position of each sequence's first gathered slot (its window's first block);
    # None when every gather starts at position 0.
    first_pos: torch.Tensor | None = None


def decode_plans(meta: AttentionMetadata, block_size: int, device: torch.device | str,
                 window: int = 0) -> list[DecodePlan]:
    """The step's decode plans for a window (0: none), built on the first layer's call and
    kept on `meta`."""
    key = f"_decode_plans_{block_size}_{window}"
    plans: list[DecodePlan] | None = meta.__dict__.get(key)
    if plans is None:
        plans = [_plan(meta.block_tables, g, block_size, device, window)
                 for g in meta.decode_groups]
        if meta.anchor_index is not None:
            for plan, (_, _, seqs) in zip(plans, meta.decode_groups, strict=True):
                plan.anchor_index = meta.anchor_index.index_select(
                    0, seqs.to(meta.anchor_index.device)).to(device)
        meta.__dict__[key] = plans
    return plans


def _plan(block_tables: torch.Tensor, group: DecodeGroup, block_size: int,
          device: torch.device | str, window: int) -> DecodePlan:
    rows, lens, seqs = group
    rows_l, lens_l = rows.tolist(), lens.tolist()
    # Each sequence gathers from its window's first block to its last; a shorter one pads
    # with its own last block again (masked), never with a table entry outside its window,
    # which may be -1 or a freed block.
    first = [window_start(n - 1, window) // block_size for n in lens_l]
    ends = [-(-n // block_size) for n in lens_l]
    max_blocks = max(e - f for e, f in zip(ends, first, strict=True))
    span = max_blocks * block_size
    tables = block_tables.index_select(0, seqs.to(block_tables.device))
    if any(first) or min(ends) < max_blocks:
        cols = torch.arange(max_blocks)[None, :] + torch.tensor(first)[:, None]
        cols = cols.minimum(torch.tensor(ends)[:, None] - 1)
        flat = tables.gather(1, cols.to(tables.device))
    else:
        flat = tables[:, :max_blocks]
    first_pos = torch.tensor(first, device=device) * block_size
    pos = first_pos[:, None] + torch.arange(span, device=device)
    lens_d = lens.to(device)[:, None]
    valid = pos < lens_d
    if window:
        valid &= pos >= lens_d - window
    mask = None
    if not bool(valid.all()):
        mask = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    consecutive = rows_l == list(range(rows_l[0], rows_l[0] + len(rows_l)))
    return DecodePlan(
        rows=slice(rows_l[0], rows_l[0] + len(rows_l)) if consecutive else rows.to(device),
        flat_blocks=flat.reshape(-1).contiguous(), num_seqs=len(rows_l), span=span, mask=mask,
        first_pos=first_pos if any(first) else None)


def overlay_anchors_at(rows: torch.Tensor, index: torch.Tensor, anchor: torch.Tensor,
                       first_pos: torch.Tensor) -> None:
    """kernels.anchors.overlay_anchors for rows gathered from a window's first block: slot s
    of sequence b holds position first_pos[b] + s, so only anchor positions at or past that
    land in the rows."""
    n = anchor.shape[1]
    m = min(n, rows.shape[1])
    pos = first_pos.to(rows.device)[:, None] + torch.arange(m, device=rows.device)
    take = (index[:, None] >= 0) & (pos < n)
    if m == 0 or not bool(take.any()):
        return
    exact = anchor[index.clamp_min(0)[:, None], pos.clamp_max(n - 1)].to(rows.dtype)
    rows[:, :m] = torch.where(take[:, :, None, None], exact, rows[:, :m])


def _overlay(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, anchors: Anchors,
             first_pos: torch.Tensor | None) -> None:
    if first_pos is None:
        overlay_anchors(k, index, anchors[0])
        overlay_anchors(v, index, anchors[1])
    else:
        overlay_anchors_at(k, index, anchors[0], first_pos)
        overlay_anchors_at(v, index, anchors[1], first_pos)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, softcap: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over the last two dims (mask additive float or
    boolean); with a softcap the scores go through c * tanh(s / c) first, which SDPA cannot
    do, so that case is spelled out in float32."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, dim=-1) @ v.float()


def _decode_attention(query: torch.Tensor, pool: LayerPool, plan: DecodePlan, scale: float,
                      softcap: float = 0.0) -> torch.Tensor:
    """A group of single-query sequences at once: one gather of their blocks, then SDPA in
    float32 (CPU SDPA in bfloat16 measured 2-3x slower at one query row), masking the slots
    past each sequence's length or before its window. The query heads that share a KV head
    become that head's query rows, so SDPA needs no GQA expansion. Returns
    [b, heads, head_dim] float32."""
    k_cache, v_cache, k_scale, v_scale, anchors = pool
    _, _, kv_heads, head_dim = k_cache.shape
    b, heads = plan.num_seqs, query.shape[1]
    k = gather_blocks(k_cache, plan.flat_blocks, k_scale, torch.float32)
    v = gather_blocks(v_cache, plan.flat_blocks, v_scale, torch.float32)
    k = k.view(b, plan.span, kv_heads, head_dim)
    v = v.view(b, plan.span, kv_heads, head_dim)
    if anchors is not None and plan.anchor_index is not None:
        _overlay(k, v, plan.anchor_index, anchors, plan.first_pos)
    q = query[plan.rows].float().view(b, kv_heads, heads // kv_heads, head_dim)
    o = attend(q, k.transpose(1, 2), v.transpose(1, 2), plan.mask, scale, softcap)
    return o.reshape(b, heads, head_dim)


def _prefill_attention(query: torch.Tensor, pool: LayerPool, meta: AttentionMetadata, i: int,
                       scale: float, out: torch.Tensor, window: int = 0,
                       softcap: float = 0.0) -> None:
    k_cache, v_cache, k_scale, v_scale, anchors = pool
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
    q_len, ctx = end - start, meta.context_lens[i]
    # Keys from the block holding the first query's window start: earlier blocks are out of
    # every query's window (and may be freed).
    first = window_start(ctx - q_len, window) // block_size
    table = meta.block_tables[i]
    k = gather_context(k_cache, table, ctx, k_scale, query.dtype, first)
    v = gather_context(v_cache, table, ctx, v_scale, query.dtype, first)
    if anchors is not None and meta.anchor_index is not None:
        index = meta.anchor_index[i:i + 1].to(k.device)
        first_pos = torch.tensor([first * block_size]) if first else None
        _overlay(k[None], v[None], index, anchors, first_pos)
    # [1, heads, q_len, d]: with a batch dimension torch's CPU SDPA takes its fused (flash)
    # kernel; three-dimensional inputs fall back to the unfused math, 3-4x slower here.
    q = query[start:end].transpose(0, 1)[None]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == ctx and not window and not softcap:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
        return
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    k_pos = torch.arange(first * block_size, ctx, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    if not softcap:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:  # the query heads sharing a KV head as one more dimension: no K/V expansion
        heads, d = q.shape[1], q.shape[3]
        g = heads // kv_heads
        o = attend(q.view(1, kv_heads, g, q_len, d), k[:, :, None], v[:, :, None], mask,
                   scale, softcap).view(1, heads, q_len, d)
    out[start:end] = o[0].transpose(0, 1)
