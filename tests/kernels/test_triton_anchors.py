"""Anchor tokens (kernels/anchors.py) in the Triton attention kernel against the torch
reference, under TRITON_INTERPRET=1: the first positions of a sequence with an anchor entry are
read from the float32 anchor rows (unit scale) instead of the pool's codes."""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import ops
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.rotation import rotation_matrix
from kvscope.kernels.triton_attention import paged_attention_triton
from tests.kernels.test_triton_kernels import (
    FP8,
    TOL,
    build,
    case_seed,
    sanitized,
    where,
)


def with_anchors(meta, kv_heads, head_dim, n, seed):
    """Two anchor entries of n rows; every other sequence has none."""
    g = torch.Generator().manual_seed(seed)
    anchors = tuple(torch.randn(2, n, kv_heads, head_dim, generator=g) for _ in range(2))
    meta.anchor_index = torch.tensor([(i % 3) - 1 for i in range(len(meta.context_lens))])
    return anchors


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.int8, torch.float32),
                                              (torch.int8, torch.bfloat16),
                                              (FP8, torch.float32), (FP8, torch.float16)],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("block_size,n", [(1, 4), (16, 4), (4, 1)])
def test_attention_reads_anchor_rows_as_the_reference(monkeypatch, kv_dtype, q_dtype,
                                                      block_size, n):
    seed = case_seed("anchors", kv_dtype, q_dtype, block_size, n)
    query, pool, meta = build(kv_dtype, q_dtype, block_size, 4, 2, 16, seed)
    anchors = with_anchors(meta, 2, 16, n, seed)
    scale = 1 / math.sqrt(16)
    got = paged_attention_triton(query, *pool[:2], meta, scale, *pool[2:], anchors=anchors,
                                 block_n=16)
    want = ops.paged_attention_ref(query, *sanitized(pool)[:2], meta, scale,
                                   *sanitized(pool)[2:], anchors)
    plain = ops.paged_attention_ref(query, *sanitized(pool)[:2], meta, scale,
                                    *sanitized(pool)[2:])
    msg = f"{kv_dtype} pool, {q_dtype} query, block size {block_size}, n {n} {where(seed)}"
    assert not bool(torch.isnan(got).any()), msg
    tol = TOL[q_dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{m}\n{msg}")
    assert not torch.allclose(plain.float(), want.float(), atol=tol, rtol=tol), \
        f"the anchors changed nothing: the test cannot see them ({msg})"


def test_anchors_with_rotation_balance_and_splits(monkeypatch):
    """Through kernels.ops with the rotation and K balance the engine uses: the anchor rows
    are in the pool's rotated, balanced space, like its codes."""
    seed = case_seed("anchors-rot")
    g = torch.Generator().manual_seed(seed)
    query, pool, meta = build(torch.int8, torch.float32, 4, 6, 2, 16, seed, long_ctx=70)
    anchors = with_anchors(meta, 2, 16, 4, seed)
    r = rotation_matrix("hadamard", 16)
    kb = KBalanceLayer.of(torch.randn(2, 16, generator=g),
                          torch.rand(2, 16, generator=g) * 3 + 0.3)
    got = paged_attention_triton(
        ops.rotate(ops.balance_q(query, kb), r).to(query.dtype), *pool[:2], meta, 0.25,
        *pool[2:], anchors=anchors, num_splits=3, block_n=16)
    got = ops.unrotate(got, r)
    monkeypatch.setenv(ops.ENV, "ref")
    want = ops.paged_attention(query, *sanitized(pool)[:2], meta, 0.25, *sanitized(pool)[2:],
                               rotation=r, k_balance=kb, anchors=anchors)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32],
                               msg=lambda m: f"{m}\n{where(seed)}")


def test_anchor_rows_of_the_wrong_shape_are_refused():
    query, pool, meta = build(torch.int8, torch.float32, 4, 4, 2, 16, case_seed("bad"))
    meta.anchor_index = torch.zeros(len(meta.context_lens), dtype=torch.long)
    bad = (torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, 16))
    with pytest.raises(ValueError, match="anchor rows"):
        paged_attention_triton(query, *pool[:2], meta, 0.25, *pool[2:], anchors=bad)
