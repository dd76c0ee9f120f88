"""The fused K/V rotation in the Triton kernels against the torch path, under TRITON_INTERPRET=1.

The reference is kernels.ops on the `ref` backend: x @ R in torch float32, then the unchanged
reference write / attention. The kernels rotate in registers with a float32 dot, whose
summation order differs from torch's, so a value next to a rounding boundary may land one
code away: the write is compared after dequantizing (within one quantization step, and most
codes exactly equal), the attention with the same tolerances as the unrotated kernels.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import ops
from kvscope.kernels.attention_ref import AttentionMetadata, group_decode_rows
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


def rotated_write_bound(x: torch.Tensor, r: torch.Tensor, stored: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """How far two float32 evaluations of x @ R, each stored in `dtype`, may lie apart.

    A float32 dot of length d is within d * u * sum_i |x_i| |R_ij| of the exact value
    (u = 2**-24), whatever the summation order; two of them within twice that. The error is
    relative to the row, not to the element: a rotated element near zero, from a row with a
    large outlier, is off by the row's ulps (a fixed rtol failed on such an element). Storing
    in bfloat16 may then round the two to neighbouring codes: one bf16 ulp of the element."""
    d = x.shape[-1]
    dots = 2 * d * 2.0**-24 * (x.abs() @ r.abs())
    storage = (stored.float().abs() + dots) * (2.0**-7 if dtype == torch.bfloat16 else 0.0)
    return dots + storage + torch.finfo(torch.float32).tiny


def reference_write(key, value, pool, slots, r, monkeypatch):
    monkeypatch.setenv(ops.ENV, "ref")
    ops.write_kv(key, value, pool[0], pool[1], slots, pool[2], pool[3], rotation=r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, FP8], ids=str)
@pytest.mark.parametrize("head_dim", [16, 24])  # Hadamard; random orthogonal, padded tile
def test_rotated_write_matches_the_torch_path(monkeypatch, dtype, head_dim):
    seed = case_seed("rot-write", dtype, head_dim)
    g = torch.Generator().manual_seed(seed)
    kv_heads, block_size, num_blocks, n = 3, 4, 4, 9
    key = random_rows(g, n, kv_heads, head_dim)
    value = random_rows(g, n, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    r = rotation_matrix("hadamard", head_dim)
    pool = poisoned_pool(dtype, num_blocks, block_size, kv_heads, head_dim)
    got, want = clone_pool(pool), clone_pool(pool)
    write_kv_triton(key, value, got[0], got[1], slots, got[2], got[3], rotation=r)
    reference_write(key, value, want, slots, r, monkeypatch)

    msg = f"{dtype}, head_dim {head_dim} {where(seed)}"
    for i, name in enumerate(("k", "v")):
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, kv_heads, head_dim)

        a, b = rows(got[i])[slots], rows(want[i])[slots]
        assert not bool(poisoned(a).any()), f"{name}: a written slot is poisoned: {msg}"
        unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
        unwritten[slots] = False
        assert bool(poisoned(rows(got[i])[unwritten]).all()), f"{name}: slot changed: {msg}"
        if not is_quantized(dtype):
            bound = rotated_write_bound((key, value)[i], r, b, dtype)
            gap = (a.float() - b.float()).abs()
            worst = (gap / bound).max().item()
            assert worst <= 1.0, f"{name}: {worst:.2f}x the rounding bound: {msg}"
            continue
        sa, sb = got[2 + i].view(-1, kv_heads)[slots], want[2 + i].view(-1, kv_heads)[slots]
        torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0, msg=lambda m: f"{m}\n{msg}")
        da, db = dequantize(a, sa), dequantize(b, sb)
        step = sb[..., None] * (1.0 if dtype == torch.int8 else 32.0)  # fp8: 2**5 ulp at 448
        assert bool(((da - db).abs() <= step * 1.001).all()), f"{name} off by > 1 step: {msg}"
        same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean()
        assert same > 0.95, f"{name}: only {same:.1%} of codes equal: {msg}"


def test_rotated_write_really_rotates():
    """The pool holds x @ R, not x: a row with one outlier comes out flat."""
    head_dim = 16
    r = rotation_matrix("hadamard", head_dim)
    x = torch.zeros(1, 1, head_dim)
    x[0, 0, 3] = 8.0
    pool = poisoned_pool(torch.float32, 1, 4, 1, head_dim)
    write_kv_triton(x, x, pool[0], pool[1], torch.tensor([2]), rotation=r)
    torch.testing.assert_close(pool[0][0, 2, 0], torch.full((head_dim,), 8.0) * r[3])
    assert bool((pool[0][0, 2, 0].abs() == 2.0).all())  # 8 / sqrt(16) in every channel


@pytest.mark.parametrize("kv_dtype,q_dtype,head_dim,splits", [
    (torch.float32, torch.float32, 16, 1),
    (torch.int8, torch.float32, 16, 3),
    (FP8, torch.float32, 24, 1),
    (torch.int8, torch.bfloat16, 24, 2),
], ids=lambda x: str(x).split(".")[-1])
def test_rotated_attention_matches_the_torch_path(monkeypatch, kv_dtype, q_dtype, head_dim,
                                                  splits):
    """Same pool (written rotated), same query: the kernel's fused q rotation and output
    un-rotation against torch's rotate -> reference attention -> unrotate."""
    seed = case_seed("rot-attn", kv_dtype, q_dtype, head_dim, splits)
    r = rotation_matrix("hadamard", head_dim)
    query, pool, meta = build(kv_dtype, q_dtype, 4, 6, 2, head_dim, seed)
    scale = 1 / math.sqrt(head_dim)
    clean = sanitized(pool)
    got = paged_attention_triton(query, *pool[:2], meta, scale, *pool[2:], rotation=r,
                                 num_splits=splits, block_n=16)
    monkeypatch.setenv(ops.ENV, "ref")
    want = ops.paged_attention(query, *clean[:2], meta, scale, *clean[2:], rotation=r)
    msg = f"{kv_dtype} pool, {q_dtype} query, head_dim {head_dim}, splits {splits} {where(seed)}"
    assert not bool(torch.isnan(got).any()), msg
    tol = TOL[q_dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{m}\n{msg}")


def test_rotated_write_then_attention_equals_unrotated_float32():
    """End to end on a float32 pool: rotating is invisible in the output (R is orthogonal)."""
    seed = case_seed("rot-e2e")
    g = torch.Generator().manual_seed(seed)
    head_dim, kv_heads, heads, ctx = 16, 2, 4, 11
    r = rotation_matrix("hadamard", head_dim)
    k, v = torch.randn(ctx, kv_heads, head_dim, generator=g), torch.randn(
        ctx, kv_heads, head_dim, generator=g)
    slots = torch.arange(ctx)
    plain = poisoned_pool(torch.float32, 3, 4, kv_heads, head_dim)
    rotated = poisoned_pool(torch.float32, 3, 4, kv_heads, head_dim)
    write_kv_triton(k, v, plain[0], plain[1], slots)
    write_kv_triton(k, v, rotated[0], rotated[1], slots, rotation=r)
    starts, lens = [0, 1, 4], [ctx, ctx]
    meta = AttentionMetadata(starts, lens, torch.tensor([[0, 1, 2], [0, 1, 2]]),
                             torch.zeros(0, dtype=torch.long), group_decode_rows(starts, lens),
                             [1])
    query = torch.randn(4, heads, head_dim, generator=g)
    a = paged_attention_triton(query, *plain[:2], meta, 0.25, block_n=16)
    b = paged_attention_triton(query, *rotated[:2], meta, 0.25, rotation=r, block_n=16)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(plain[0], rotated[0], equal_nan=True)


def test_rotation_shape_is_checked():
    pool = poisoned_pool(torch.int8, 2, 4, 1, 16)
    with pytest.raises(ValueError, match="rotation has shape"):
        write_kv_triton(torch.randn(1, 1, 16), torch.randn(1, 1, 16), pool[0], pool[1],
                        torch.tensor([0]), pool[2], pool[3], rotation=torch.eye(8))


def test_int8_error_drops_with_rotation():
    """The point of it all, on outlier rows like real keys: the dequantized pool, rotated
    back, is closer to the input than the unrotated int8 pool."""
    g = torch.Generator().manual_seed(case_seed("rot-gain"))
    head_dim, n = 64, 32
    x = torch.randn(n, 1, head_dim, generator=g)
    x[..., 5] *= 30.0  # an outlier channel, as K has after RoPE
    r = rotation_matrix("hadamard", head_dim)
    errs = []
    for rot in (None, r):
        pool = poisoned_pool(torch.int8, 8, 4, 1, head_dim)
        write_kv_triton(x, x, pool[0], pool[1], torch.arange(n), pool[2], pool[3],
                        rotation=rot)
        back = dequantize(pool[0].view(-1, 1, head_dim)[:n], pool[2].view(-1, 1)[:n])
        if rot is not None:
            back = back @ r.T
        errs.append(float((back - x).pow(2).mean().sqrt()))
    assert errs[1] < errs[0] / 3, errs
