"""Steps with a few prompt (or draft) tokens on the fused decode: every query token a row.

The fused CPU decode (engine.model.fused.decode) runs each layer row by row, and its attention
kernel takes, per row, a block table and a context length. A prefill chunk or a speculative
verify is causal attention of its tokens over their own sequence: the token at position p
reads the keys up to p. So a step of decodes plus a few such tokens fuses when each token
becomes a row of its sequence with context length p + 1: the layer writes every row's K/V
before any row attends, so the chunk's own earlier keys are there when a later token reads
them.

The kernel reads a sequence's cached K/V once per row, where the prefill attention reads it
once per chunk; past a few dozen tokens of a long context the ordinary forward's fixed cost is the
smaller one. The step fuses while its prompt tokens stay under MAX_ROWS and the keys they read under
MAX_KEYS (docs/notes/settled-experiments.md, fused_mixed: both sides measured). On the AMX Xeon of
2026-12-06, 16 decodes beside one chunk in a bfloat16 pool, both int4 kernel families: the fused
step took 0.42-0.64x the ordinary forward's time up to 64 tokens over 512 keys, 0.60-0.88x for 16-32
tokens over 2048 (32K-65K keys), 0.94-0.98x for 64 over 2048 (129K) and 1.12-1.43x for 32-64 over
4096 (130K-258K): the limit sits at 64K keys, below where the ordinary forward starts to win (it was
8K when the ordinary forward's matmuls and glue were slower than they are now).

A speculative verify (one decode token and its drafts, AttentionMetadata.verify_seqs) counts
against neither limit: its rows then round exactly as the plain decodes of the same positions
do, so greedy output with drafts equals greedy output without (the ordinary forward rounds
differently and can flip a near tie). Whether a long-context verify pays is the speculative
back-off's measurement to make (engine.spec_decode.backoff), not this one's.
"""
from __future__ import annotations

import torch

from kvscope.kernels.attention_ref import AttentionMetadata

MAX_ROWS = 64  # query tokens of the multi-token sequences in one step
MAX_KEYS = 64 * 1024  # summed context lengths of the expanded rows


def prompt_rows(meta: AttentionMetadata) -> tuple[int, int]:
    """(query tokens of the step's prompt chunks, the keys they read in all); speculative
    verifies are not counted."""
    qsl, ctx = meta.query_start_loc, meta.context_lens
    rows = keys = 0
    for i in meta.prefill_seqs:
        if i in meta.verify_seqs:
            continue
        n = qsl[i + 1] - qsl[i]
        rows += n
        keys += n * ctx[i] - n * (n - 1) // 2  # rows read ctx - n + 1 .. ctx keys
    return rows, keys


def fits(meta: AttentionMetadata, max_rows: int = MAX_ROWS) -> bool:
    """Whether the step's multi-token sequences are few enough to run as rows."""
    rows, keys = prompt_rows(meta)
    return rows <= max_rows and keys <= MAX_KEYS


def as_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step with every query token a sequence of one query: its sequence's block
    table and anchor entry, context length its position + 1. A step of decodes only is
    returned as it is."""
    if not meta.prefill_seqs:
        return meta
    qsl, ctx = meta.query_start_loc, meta.context_lens
    owner: list[int] = []
    lens: list[int] = []
    for i in range(len(ctx)):
        n = qsl[i + 1] - qsl[i]
        owner += [i] * n
        lens += range(ctx[i] - n + 1, ctx[i] + 1)
    index = torch.tensor(owner, dtype=torch.long)
    anchors = meta.anchor_index
    return AttentionMetadata(
        list(range(len(owner) + 1)), lens, meta.block_tables.index_select(0, index),
        meta.slot_mapping, [], [], meta.rotation,
        None if anchors is None else anchors.index_select(0, index), meta.anchor_fill)
