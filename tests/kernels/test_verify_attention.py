"""Speculative verification's shape on every attention path: a decoding sequence with K + 1
query tokens over a long cached context, beside ordinary one-token decode rows.

The verify row is a small prefill chunk to the kernels (engine.spec_decode.decoder), so the torch
reference, the native CPU path (decode rows in C, chunks in the reference) and the Triton
kernel (TRITON_INTERPRET=1 under tests/conftest.py) must each give every drafted position the
causal attention over its own prefix. The oracle: float64 dense softmax attention over the
gathered context. Tolerance 2e-5: float32 kernels over the same values differ only in
summation order and online-softmax rescaling (observed < 1e-6).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import native
from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.cpu_attention import paged_attention_cpu
from kvscope.testing.pools import build_batch

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# (query tokens, context length): decode rows, then verify rows of K + 1 = 2..6 tokens.
ROWS = [(1, 37), (5, 70), (1, 3), (2, 17), (6, 129), (1, 64), (3, 3)]


def dense_oracle(query, k_cache, v_cache, meta, tables, block_size):
    out = torch.empty(query.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for i, table in enumerate(tables):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = meta.context_lens[i]
        k = torch.cat([k_cache[b] for b in table])[:ctx].double()
        v = torch.cat([v_cache[b] for b in table])[:ctx].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for r in range(start, end):
            pos = ctx - (end - r)  # the query's own position: it sees keys 0..pos
            scores = torch.einsum("hd,thd->ht", query[r].double(), k[:pos + 1])
            p = torch.softmax(scores / math.sqrt(HEAD_DIM), dim=-1)
            out[r] = torch.einsum("ht,thd->hd", p, v[:pos + 1])
    return out


def batch(block_size):
    q_lens, ctx = zip(*ROWS, strict=True)
    return build_batch(list(q_lens), list(ctx), block_size, HEADS, KV_HEADS, HEAD_DIM,
                       num_blocks=160 // block_size * 4 + 8, seed=block_size)


def paths():
    yield "reference", paged_attention_ref
    if native.available():
        yield "native", paged_attention_cpu
    try:
        from kvscope.kernels.triton_attention import paged_attention_triton
    except ImportError:
        return
    yield "triton", paged_attention_triton


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", [n for n, _ in paths()])
def test_verify_rows_attend_causally_over_their_context(name, block_size):
    attend = dict(paths())[name]
    query, k_cache, v_cache, meta, tables = batch(block_size)
    want = dense_oracle(query, k_cache, v_cache, meta, tables, block_size)
    got = attend(query, k_cache, v_cache, meta, 1 / math.sqrt(HEAD_DIM))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
