"""The fused K shift and q/k balance in the Triton kernels against the torch path, under
TRITON_INTERPRET=1 (kernels/k_balance.py).

The reference is kernels.ops on the `ref` backend: (k - c) * g and q / g in torch float32, then
the rotation and the unchanged reference write / attention. Without a rotation the kernel does
the same float32 elementwise ops, so codes must be equal; with one, the float32 dot's summation
order may put a value one code away (as in tests/kernels/test_triton_rotation.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import ops
from kvscope.kernels.attention_ref import AttentionMetadata, group_decode_rows
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.quant import dequantize, is_quantized
from kvscope.kernels.rotation import rotation_matrix
from kvscope.kernels.triton_attention import paged_attention_triton
from kvscope.kernels.triton_kv_write import write_kv_triton
from tests.kernels.test_triton_kernels import (
    FP8,
    TOL,
    build,
    case_seed,
    clone_pool,
    poisoned,
    poisoned_pool,
    random_rows,
    sanitized,
    where,
)


def random_balance(g, kv_heads, head_dim):
    return KBalanceLayer.of(torch.randn(kv_heads, head_dim, generator=g),
                            torch.rand(kv_heads, head_dim, generator=g) * 3 + 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, FP8], ids=str)
@pytest.mark.parametrize("head_dim,rotated", [(16, True), (24, True), (16, False)])
def test_balanced_write_matches_the_torch_path(monkeypatch, dtype, head_dim, rotated):
    seed = case_seed("kb-write", dtype, head_dim, rotated)
    g = torch.Generator().manual_seed(seed)
    kv_heads, block_size, num_blocks, n = 3, 4, 4, 9
    key = random_rows(g, n, kv_heads, head_dim)
    value = random_rows(g, n, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    r = rotation_matrix("hadamard", head_dim) if rotated else None
    kb = random_balance(g, kv_heads, head_dim)
    pool = poisoned_pool(dtype, num_blocks, block_size, kv_heads, head_dim)
    got, want = clone_pool(pool), clone_pool(pool)
    write_kv_triton(key, value, got[0], got[1], slots, got[2], got[3], rotation=r, k_balance=kb)
    monkeypatch.setenv(ops.ENV, "ref")
    ops.write_kv(key, value, want[0], want[1], slots, want[2], want[3], rotation=r,
                 k_balance=kb)

    msg = f"{dtype}, head_dim {head_dim}, rotated {rotated} {where(seed)}"
    for i, name in enumerate(("k", "v")):
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, kv_heads, head_dim)

        a, b = rows(got[i])[slots], rows(want[i])[slots]
        assert not bool(poisoned(a).any()), f"{name}: a written slot is poisoned: {msg}"
        if not is_quantized(dtype):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol,
                                       msg=lambda m, name=name: f"{name}: {m}\n{msg}")
            continue
        sa, sb = got[2 + i].view(-1, kv_heads)[slots], want[2 + i].view(-1, kv_heads)[slots]
        torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0, msg=lambda m: f"{m}\n{msg}")
        if not rotated:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} codes: {msg}"
            continue
        da, db = dequantize(a, sa), dequantize(b, sb)
        step = sb[..., None] * (1.0 if dtype == torch.int8 else 32.0)
        assert bool(((da - db).abs() <= step * 1.001).all()), f"{name} off by > 1 step: {msg}"
        same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean()
        assert same > 0.95, f"{name}: only {same:.1%} of codes equal: {msg}"


def test_balanced_write_really_shifts_and_scales():
    """The pool holds (k - c) * g (no rotation here): checked against plain arithmetic."""
    kb = KBalanceLayer.of(torch.full((1, 16), 2.0), torch.full((1, 16), 0.5))
    x = torch.arange(16, dtype=torch.float32).view(1, 1, 16)
    pool = poisoned_pool(torch.float32, 1, 4, 1, 16)
    write_kv_triton(x, x, pool[0], pool[1], torch.tensor([1]), k_balance=kb)
    torch.testing.assert_close(pool[0][0, 1, 0], (x[0, 0] - 2.0) * 0.5)
    torch.testing.assert_close(pool[1][0, 1, 0], x[0, 0])  # V untouched


@pytest.mark.parametrize("kv_dtype,q_dtype,head_dim,splits,rotated", [
    (torch.float32, torch.float32, 16, 1, True),
    (torch.int8, torch.float32, 16, 3, True),
    (FP8, torch.float32, 24, 1, True),
    (torch.int8, torch.bfloat16, 24, 2, True),
    (torch.int8, torch.float32, 16, 1, False),
], ids=lambda x: str(x).split(".")[-1])
def test_balanced_attention_matches_the_torch_path(monkeypatch, kv_dtype, q_dtype, head_dim,
                                                   splits, rotated):
    """Same pool, same query: the kernel's fused q / g (and rotation) against torch's."""
    seed = case_seed("kb-attn", kv_dtype, q_dtype, head_dim, splits, rotated)
    g = torch.Generator().manual_seed(seed)
    r = rotation_matrix("hadamard", head_dim) if rotated else None
    query, pool, meta = build(kv_dtype, q_dtype, 4, 6, 2, head_dim, seed)
    kb = random_balance(g, 2, head_dim)
    scale = 1 / math.sqrt(head_dim)
    clean = sanitized(pool)
    got = paged_attention_triton(query, *pool[:2], meta, scale, *pool[2:], rotation=r,
                                 k_balance=kb, num_splits=splits, block_n=16)
    monkeypatch.setenv(ops.ENV, "ref")
    want = ops.paged_attention(query, *clean[:2], meta, scale, *clean[2:], rotation=r,
                               k_balance=kb)
    msg = f"{kv_dtype} pool, {q_dtype} query, head_dim {head_dim}, splits {splits} {where(seed)}"
    assert not bool(torch.isnan(got).any()), msg
    tol = TOL[q_dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{m}\n{msg}")


def test_balanced_write_then_attention_equals_plain_float32():
    """End to end on a float32 pool: the shift and balance are invisible in the output."""
    g = torch.Generator().manual_seed(case_seed("kb-e2e"))
    head_dim, kv_heads, heads, ctx = 16, 2, 4, 11
    r = rotation_matrix("hadamard", head_dim)
    kb = random_balance(g, kv_heads, head_dim)
    k, v = torch.randn(ctx, kv_heads, head_dim, generator=g), torch.randn(
        ctx, kv_heads, head_dim, generator=g)
    slots = torch.arange(ctx)
    plain = poisoned_pool(torch.float32, 3, 4, kv_heads, head_dim)
    balanced = poisoned_pool(torch.float32, 3, 4, kv_heads, head_dim)
    write_kv_triton(k, v, plain[0], plain[1], slots)
    write_kv_triton(k, v, balanced[0], balanced[1], slots, rotation=r, k_balance=kb)
    starts, lens = [0, 1, 4], [ctx, ctx]
    meta = AttentionMetadata(starts, lens, torch.tensor([[0, 1, 2], [0, 1, 2]]),
                             torch.zeros(0, dtype=torch.long), group_decode_rows(starts, lens),
                             [1])
    query = torch.randn(4, heads, head_dim, generator=g)
    a = paged_attention_triton(query, *plain[:2], meta, 0.25, block_n=16)
    b = paged_attention_triton(query, *balanced[:2], meta, 0.25, rotation=r, k_balance=kb,
                               block_n=16)
    torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_balance_shape_is_checked():
    pool = poisoned_pool(torch.int8, 2, 4, 1, 16)
    kb = KBalanceLayer.of(torch.zeros(2, 16), torch.ones(2, 16))
    with pytest.raises(ValueError, match="K balance has shape"):
        write_kv_triton(torch.randn(1, 1, 16), torch.randn(1, 1, 16), pool[0], pool[1],
                        torch.tensor([0]), pool[2], pool[3], k_balance=kb)
