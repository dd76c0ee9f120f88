"""The CPU decode attention kernel (kernels/cpu_decode_attention.c, built by kernels.native),
called once per layer for every decode row of the step.

Why native code: the torch path gathers each sequence's blocks into a padded copy, converts
it to float32 and runs SDPA over it, three passes and a dozen ops per layer; the kernel reads
every cached K and V row once, through the block table, with no copies and no padding.
Prefill chunks take kernels.cpu_prefill_attention. With a sliding window each row's loop
starts at its window (the blocks before it are never read); soft-capping bends the scores
before the softmax.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvscope.kernels import decode_split, native
from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import (
    AttentionMetadata,
    LayerPool,
    check_window_softcap,
)
from kvscope.kernels.cpu_prefill_attention import prefill_attention_cpu

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3,
         torch.float8_e4m3fn: 4}
# The pool dtype as the thread split's decisions name it (kernels.decode_split).
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in KINDS}
IO_DTYPES = (torch.float32, torch.bfloat16)  # query/output rows the kernel reads and writes
# (query rows, block tables, context lengths, anchor entries or None) of a step's decode rows.
DecodeRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


class Attention(NamedTuple):
    """A layer's attention constants: query scale, sliding window (0: none), softcap (0: off),
    and the positions the step's decode rows read under that window."""
    scale: float
    window: int
    softcap: float
    cached_rows: int


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and k_cache.dtype in KINDS and k_cache.is_contiguous()
            and native.available())


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        anchors: Anchors | None = None, *, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """As kernels.attention_ref.paged_attention_ref (window and softcap included): decode
    rows through the kernel, prefill chunks through kernels.cpu_prefill_attention."""
    check_window_softcap(window, softcap)
    rows, tables, lens, anchor_idx = decode_rows(meta)
    if not len(rows):
        return prefill_attention_cpu(query, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                     anchors, window=window, softcap=softcap)
    attn = Attention(scale, window, softcap, cached_rows(meta, lens, window))
    pool: LayerPool = (k_cache, v_cache, k_scale, v_scale,
                       anchors if anchor_idx is not None else None)
    if not meta.prefill_seqs and query.dtype in IO_DTYPES:  # rows in and out as they are
        q = query.contiguous()
        out = torch.empty_like(q)
        _run(out, q, rows, tables, lens, anchor_idx, pool, attn)
        return out
    q = query.float().contiguous()
    if meta.prefill_seqs:  # the prefill path fills the prefill rows; the kernel the rest
        out = prefill_attention_cpu(query, k_cache, v_cache, _prefill_only(meta), scale,
                                    k_scale, v_scale, anchors, window=window,
                                    softcap=softcap).float().contiguous()
    else:
        out = torch.empty_like(q)
    _run(out, q, rows, tables, lens, anchor_idx, pool, attn)
    return out.to(query.dtype)


def decode_rows(meta: AttentionMetadata) -> DecodeRows:
    """(query rows, block tables, context lengths, anchor entries or None) of the step's
    decode rows, int64 and contiguous, worked out on the first layer's call and kept on
    `meta`."""
    got: DecodeRows | None = meta.__dict__.get("_cpu_decode_rows")
    if got is None:
        qsl, ctx = meta.query_start_loc, meta.context_lens
        idx = [i for i in range(len(ctx)) if qsl[i + 1] - qsl[i] == 1]
        tables = meta.block_tables
        if len(idx) < len(ctx):
            tables = tables.index_select(0, torch.tensor(idx, dtype=torch.long))
        anchors = meta.anchor_index
        if anchors is not None:
            anchors = anchors.index_select(0, torch.tensor(idx, dtype=torch.long)).contiguous()
        got = (torch.tensor([qsl[i] for i in idx], dtype=torch.long), tables.contiguous(),
               torch.tensor([ctx[i] for i in idx], dtype=torch.long), anchors)
        meta.__dict__["_cpu_decode_rows"] = got
    return got


def cached_rows(meta: AttentionMetadata, lens: torch.Tensor, window: int) -> int:
    """The positions the step's decode rows read (under `window`), for the thread split's
    bucket (kernels.decode_split): summed on the first layer's call per window, kept on
    `meta`."""
    known: dict[int, int] = meta.__dict__.setdefault("_cpu_cached_rows", {})
    if window not in known:
        known[window] = int((lens.clamp(max=window) if window else lens).sum())
    return known[window]


def _prefill_only(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.query_start_loc, meta.context_lens, meta.block_tables,
                             meta.slot_mapping, [], meta.prefill_seqs, meta.rotation,
                             meta.anchor_index)


def _run(out: torch.Tensor, q: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
         lens: torch.Tensor, anchor_idx: torch.Tensor | None, pool: LayerPool, attn: Attention
         ) -> None:
    lib = native.require_library()
    k_cache, v_cache, k_scale, v_scale, anchors = pool
    _, block_size, kv_heads, head_dim = k_cache.shape
    ptr = native.address
    ak, av = anchors if anchors is not None else (None, None)
    if ak is None or av is None:
        anchor_idx = None
    elif not (ak.is_contiguous() and av.is_contiguous() and ak.dtype == torch.float32):
        raise ValueError("anchor rows must be contiguous float32")

    def call(parallel: int) -> None:
        status = lib.kvscope_paged_decode(
            out.data_ptr(), q.data_ptr(), rows.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), 0, len(rows), k_cache.data_ptr(), v_cache.data_ptr(),
            ptr(k_scale), ptr(v_scale), q.shape[1], kv_heads, head_dim, block_size,
            KINDS[k_cache.dtype], attn.scale, int(q.dtype == torch.bfloat16), ptr(ak), ptr(av),
            ptr(anchor_idx), ak.shape[1] if ak is not None else 0, attn.window, attn.softcap,
            parallel)
        if status:
            raise MemoryError("the CPU attention kernel could not allocate its score buffer")

    call(decode_split.parallel(call, DTYPE_NAMES[k_cache.dtype], attn.cached_rows * kv_heads))
