"""The fused decode's native KV paths for 1-byte and transformed pools: the RoPE call's write
through the pool's transforms and quantizer (kvscope_rope_write_kv, kernels/cpu_decode_glue.c)
against RoPE then the torch write (kernels.rotation, kernels.k_balance, kernels.kv_write_ref);
and the decode attention (kernels/cpu_decode_attention.c) over long sequences, cut into spans
that are merged, against float64 and the torch reference, anchors and windows included."""
from __future__ import annotations

import pytest
import torch

from kvscope.kernels import cpu_attention, native
from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.k_balance import KBalanceLayer, balance_k, balance_q
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.quant import quantize
from kvscope.kernels.rotation import rotate, rotation_matrix
from tests.kernels.test_attention_ref import build_batch, reference

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")
FP8 = torch.float8_e4m3fn
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 3, FP8: 4}


def rope_tables(d, positions=20):
    angle = torch.arange(positions)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    return cos.contiguous(), torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], -1).contiguous()


def pool(slots, kv_heads, d, dtype):
    """A poisoned pool: codes 0x80 (never written by a quantizer), NaN scales."""
    codes = torch.full((slots, kv_heads, d), -128, dtype=torch.int8)
    if dtype in (torch.float32, torch.bfloat16):
        return torch.full((slots, kv_heads, d), float("nan"), dtype=dtype), None
    return codes.view(dtype), torch.full((slots, kv_heads), float("nan"))


def ordered(cache):
    """Codes in value order (fp8 sign-magnitude made signed), one step apart = 1 apart."""
    if cache.dtype == torch.int8:
        return cache.int()
    b = cache.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


@pytest.mark.parametrize("dtype", [torch.int8, FP8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", ["calibrated", "hadamard", "none"])
@pytest.mark.parametrize("d", [64, 32])
def test_rope_write_kv_is_rope_then_the_torch_write(dtype, transform, d):
    heads, kv_heads, rows, slots_n = 6, 2, 3, 8
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g) * 2
    positions, slots = torch.tensor([0, 5, 11]), torch.tensor([6, 1, 3])
    cos, sin = rope_tables(d)
    r = None if transform == "none" else rotation_matrix("hadamard", d)
    kb = None
    if transform == "calibrated":
        kb = KBalanceLayer.of(torch.randn(kv_heads, d, generator=g),
                              torch.rand(kv_heads, d, generator=g) * 3 + 0.3)
    lib = native.library()
    # The plain RoPE call (tested against Hugging Face's rotate_half in test_cpu_glue) gives
    # the turned q, k and v the transforms start from.
    q0 = torch.empty(rows, heads, d)
    k0, v0 = torch.zeros(slots_n, kv_heads, d), torch.zeros(slots_n, kv_heads, d)
    lib.kvscope_rope_write(qkv.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(),
                           sin.data_ptr(), q0.data_ptr(), k0.data_ptr(), v0.data_ptr(),
                           slots.data_ptr(), heads, kv_heads, d, 0, 0)
    want_q = rotate(balance_q(q0, kb), r)
    (kw, ksw), (vw, vsw) = pool(slots_n, kv_heads, d, dtype), pool(slots_n, kv_heads, d, dtype)
    write_kv_ref(rotate(balance_k(k0[slots], kb), r), rotate(v0[slots], r), kw[:, None],
                 vw[:, None], slots, None if ksw is None else ksw[:, None],
                 None if vsw is None else vsw[:, None])
    q = torch.empty(rows, heads, d)
    (kc, ks), (vc, vs) = pool(slots_n, kv_heads, d, dtype), pool(slots_n, kv_heads, d, dtype)
    ptr = native.address
    lib.kvscope_rope_write_kv(
        qkv.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), d, None,
        None, 0.0, q.data_ptr(), kc.data_ptr(), vc.data_ptr(), ptr(ks), ptr(vs),
        slots.data_ptr(), heads, kv_heads, d, KINDS[dtype], 0, ptr(r),
        ptr(kb.shift if kb else None), ptr(kb.gain if kb else None),
        ptr(kb.q_gain if kb else None))
    # The rotation sums in another order than torch's matmul: float32 rounding.
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    written = slots.tolist()
    others = [i for i in range(slots_n) if i not in written]
    for got, exp, gs, es in ((kc, kw, ks, ksw), (vc, vw, vs, vsw)):
        if gs is None:  # float pools: the stored values, bfloat16 rounding aside
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got[written].float(), exp[written].float(), rtol=tol,
                                       atol=tol)
            assert got[others].float().isnan().all()
            continue
        torch.testing.assert_close(gs[written], es[written], rtol=1e-6, atol=0)
        diff = (ordered(got[written]) - ordered(exp[written])).abs()
        # a value on a code's rounding boundary may land one step away (rounding order)
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02
        if r is None:  # no sums: the same bits
            assert torch.equal(got[written].view(torch.int8), exp[written].view(torch.int8))
        assert gs[others].isnan().all() and (got[others].view(torch.int8) == -128).all()


def quantized(kc, vc, dtype):
    if dtype in (torch.int8, FP8):
        (k, ks), (v, vs) = quantize(kc, dtype), quantize(vc, dtype)
        return k, v, ks, vs
    return kc.to(dtype), vc.to(dtype), None, None


def with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("d", [64, 32])
def test_long_float32_sequences_cut_into_spans_match_float64(d):
    """One long sequence and a batch of mixed ones, past the span cut (256 positions at
    least): the merged spans are the softmax over every position."""
    for ctx in ([3000], [1500, 40, 2200, 1]):
        query, kc, vc, meta, tables = build_batch([1] * len(ctx), ctx, 16, 9, 3, d,
                                                  num_blocks=500, seed=len(ctx))
        got = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
        want = reference(query, kc, vc, meta, tables, 0.125)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, FP8, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 32])
def test_long_1_byte_sequences_match_the_reference_on_any_thread_count(dtype, d):
    """The reference dequantizes the same pool in float32; the kernel scales scores and
    softmax weights instead of values: float32 rounding order only. Thread count changes
    who computes a span, never the spans: the same bits."""
    ctx = [2600, 300, 1]
    query, kc, vc, meta, _ = build_batch([1] * 3, ctx, 16, 9, 3, d, num_blocks=300, seed=9)
    k, v, ks, vs = quantized(kc, vc, dtype)
    two = with_threads(2, lambda: cpu_attention.paged_attention_cpu(query, k, v, meta, 0.125,
                                                                     ks, vs))
    one = with_threads(1, lambda: cpu_attention.paged_attention_cpu(query, k, v, meta, 0.125,
                                                                     ks, vs))
    assert torch.equal(one, two)
    want = paged_attention_ref(query, k, v, meta, 0.125, ks, vs)
    torch.testing.assert_close(two, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_anchors_window_and_softcap_over_spans(dtype):
    ctx = [2000, 900, 3]
    query, kc, vc, meta, _ = build_batch([1] * 3, ctx, 16, 9, 3, 64, num_blocks=220, seed=4)
    k, v, ks, vs = quantized(kc, vc, dtype)
    g = torch.Generator().manual_seed(2)
    anchors = (torch.randn(2, 4, 3, 64, generator=g), torch.randn(2, 4, 3, 64, generator=g))
    meta.anchor_index = torch.tensor([1, -1, 0])  # the last sequence: 3 positions, 3 anchored
    for window, softcap in ((0, 0.0), (700, 0.0), (0, 30.0)):
        got = cpu_attention.paged_attention_cpu(query, k, v, meta, 0.125, ks, vs, anchors,
                                                window=window, softcap=softcap)
        want = paged_attention_ref(query, k, v, meta, 0.125, ks, vs, anchors, window=window,
                                   softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
