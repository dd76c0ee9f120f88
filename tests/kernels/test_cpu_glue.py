"""kernels/cpu_decode_glue.c, each call against torch, with float32 and bfloat16 matmul rows
(io 0 and 1), row widths that are not multiples of the 16-wide vectors, and both signs."""
import pytest
import torch
import torch.nn.functional as F

from kvscope.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")
IO = {torch.float32: 0, torch.bfloat16: 1}


def tol(dtype):  # bfloat16 rows: one rounding of the output (2^-8 relative)
    bound = 1e-5 if dtype == torch.float32 else 8e-3
    return {"rtol": bound, "atol": bound}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 77])
def test_add_rms_norm(dtype, n):
    g = torch.Generator().manual_seed(n)
    h, y = torch.randn(3, n, generator=g), (torch.randn(3, n, generator=g) * 3).to(dtype)
    w, out = torch.randn(n, generator=g), torch.empty(3, n, dtype=dtype)
    want_h = h + y.float()
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-6))
    native.library().kvscope_add_rms_norm(h.data_ptr(), y.data_ptr(), w.data_ptr(), 1e-6,
                                          out.data_ptr(), 3, n, IO[dtype])
    torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [16, 200])
def test_silu_mul_over_both_signs(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(4, 2 * inter, generator=g) * 6).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -1e-3, 20.0, -20.0])
    out = torch.empty(4, inter, dtype=dtype)
    native.library().kvscope_silu_mul(gate_up.data_ptr(), out.data_ptr(), 4, inter, IO[dtype])
    want = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    torch.testing.assert_close(out.float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_rope_write_turns_q_and_k_and_stores_k_and_v(dtype, cache):
    heads, kv_heads, d, rows = 4, 2, 16, 3
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 11])
    angle = torch.arange(20)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    signed_sin = torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], -1).contiguous()
    q = torch.empty(rows, heads, d)
    k_cache = torch.zeros(8, kv_heads, d, dtype=cache)
    v_cache = torch.zeros(8, kv_heads, d, dtype=cache)
    slots = torch.tensor([6, 1, 3])
    native.library().kvscope_rope_write(
        qkv.data_ptr(), rows, positions.data_ptr(), cos.contiguous().data_ptr(),
        signed_sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), heads, kv_heads, d, int(cache == torch.bfloat16), IO[dtype])
    x = qkv.float().view(rows, heads + 2 * kv_heads, d)
    c, s = cos[positions][:, None], sin[positions][:, None]
    half = d // 2
    turned = x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s  # HF rotate_half
    torch.testing.assert_close(q, turned[:, :heads], rtol=1e-5, atol=1e-5)
    ctol = tol(cache)
    torch.testing.assert_close(k_cache[slots].float(), turned[:, heads:heads + kv_heads], **ctol)
    torch.testing.assert_close(v_cache[slots].float(), x[:, heads + kv_heads:], **ctol)
    assert not k_cache[[0, 2, 4, 5, 7]].any()  # no other slot written
