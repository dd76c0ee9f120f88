"""The glue calls kernels/cpu_decode_glue.c added for more model families (qwen3/gemma3's q/k
norm, phi3's partial rotary, gemma's gelu-tanh GLU and sandwich norms), each against torch as
Hugging Face computes it, with float32 and bfloat16 matmul rows (io 0 and 1)."""
import math

import pytest
import torch
import torch.nn.functional as F

from kvscope.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")
IO = {torch.float32: 0, torch.bfloat16: 1}
EPS = 1e-6


def tol(dtype):  # bfloat16 outputs: one rounding (2^-8 relative); float32: rounding order
    bound = 1e-5 if dtype == torch.float32 else 8e-3
    return {"rtol": bound, "atol": bound}


def hf_rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope_tables(rot, positions=20):
    """cos and sin [positions, rot] as HF builds them, and the sin the glue takes (first half
    negated)."""
    angle = torch.arange(positions)[:, None] * (1.0 / 10000 ** (torch.arange(0, rot, 2) / rot))
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    signed = torch.cat([-sin[:, :rot // 2], sin[:, rot // 2:]], -1)
    return cos.contiguous(), sin, signed.contiguous()


def hf_rope(x, cos, sin):
    """Phi3's apply_rotary_pos_emb: rotate_half over the first cos.shape[-1] dims only."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    turned = x_rot * cos + torch.cat([-x_rot[..., half:], x_rot[..., :half]], -1) * sin
    return torch.cat([turned, x_pass], -1)


def call_norm_rope_write(qkv, positions, cos, signed_sin, q_norm, k_norm, heads, kv_heads, d,
                         cache):
    rows = qkv.shape[0]
    q = torch.empty(rows, heads, d)
    k_cache = torch.zeros(8, kv_heads, d, dtype=cache)
    v_cache = torch.zeros(8, kv_heads, d, dtype=cache)
    slots = torch.tensor([6, 1, 3])[:rows].contiguous()
    native.library().kvscope_norm_rope_write(
        qkv.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
        cos.shape[1], native.address(q_norm), native.address(k_norm), EPS, q.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), heads, kv_heads, d,
        int(cache == torch.bfloat16), IO[qkv.dtype])
    return q, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "rot", "norm"), [(16, 16, True), (24, 8, False), (24, 12, True)])
def test_norm_rope_write_against_hf(dtype, cache, d, rot, norm):
    """q/k RMSNorm per head (qwen3, gemma3) before RoPE, and rotary over the first rot dims
    (phi3); v goes to the cache as it is."""
    heads, kv_heads, rows = 4, 2, 3
    g = torch.Generator().manual_seed(d + rot)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    q_norm = torch.randn(d, generator=g) if norm else None
    k_norm = torch.randn(d, generator=g) if norm else None
    positions = torch.tensor([0, 5, 11])
    cos, sin, signed = rope_tables(rot)
    q, k_cache, v_cache, slots = call_norm_rope_write(qkv, positions, cos, signed, q_norm,
                                                      k_norm, heads, kv_heads, d, cache)
    x = qkv.float().view(rows, heads + 2 * kv_heads, d)
    xq, xk, xv = x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
    if norm:
        xq, xk = hf_rms_norm(xq, q_norm), hf_rms_norm(xk, k_norm)
    c, s = cos[positions][:, None], sin[positions][:, None]
    torch.testing.assert_close(q, hf_rope(xq, c, s), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[slots].float(), hf_rope(xk, c, s), **tol(cache))
    torch.testing.assert_close(v_cache[slots].float(), xv, **tol(cache))
    assert not k_cache[[0, 2, 4, 5, 7]].any() and not v_cache[[0, 2, 4, 5, 7]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_options_it_is_the_plain_rope_write_bit_for_bit(dtype):
    heads, kv_heads, d, rows = 4, 2, 32, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d,
                      generator=torch.Generator().manual_seed(3)).to(dtype)
    positions = torch.tensor([2, 7, 19])
    cos, _, signed = rope_tables(d)
    q, k_cache, v_cache, slots = call_norm_rope_write(qkv, positions, cos, signed, None, None,
                                                      heads, kv_heads, d, torch.float32)
    q0 = torch.empty_like(q)
    k0, v0 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    native.library().kvscope_rope_write(
        qkv.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), signed.data_ptr(),
        q0.data_ptr(), k0.data_ptr(), v0.data_ptr(), slots.data_ptr(), heads, kv_heads, d, 0,
        IO[dtype])
    assert torch.equal(q, q0) and torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def gelu_tanh_f64(x):
    """0.5 x (1 + tanh(u)) in float64, as x sigmoid(2u) (the same function): where tanh(u)
    nears -1, 1 + tanh(u) cancels even in float64."""
    x = x.double()
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [16, 200])
def test_gelu_tanh_mul_against_hf(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(4, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :10] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -1e-3, 20.0, -20.0, 3.0, -3.0])
    out = torch.empty(4, inter, dtype=dtype)
    native.library().kvscope_gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), 4, inter,
                                           IO[dtype])
    gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    # HF's gelu_pytorch_tanh is torch's gelu(approximate="tanh")
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out.float(), want, **tol(dtype))
    if dtype == torch.float32:  # the far negative tail, relative to float64 (below -8 it
        tail = (gate < -2.5) & (gate > -8)  # nears float32's smallest normals)
        rel = (out.double() - gelu_tanh_f64(gate) * up.double()).abs() / (
            gelu_tanh_f64(gate) * up.double()).abs()
        assert tail.sum() > 3 and float(rel[tail].max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 77])
def test_add_normed_rms_norm_is_gemmas_sandwich(dtype, n):
    """h += rms_norm(y) * y_w (post_attention / post_feedforward norm), then the next norm."""
    g = torch.Generator().manual_seed(n)
    h, y = torch.randn(3, n, generator=g), (torch.randn(3, n, generator=g) * 3).to(dtype)
    y_w, w = torch.randn(n, generator=g), torch.randn(n, generator=g)
    out = torch.empty(3, n, dtype=dtype)
    want_h = h + hf_rms_norm(y.float(), y_w)
    lib = native.library()
    h_last = h.clone()
    lib.kvscope_add_normed_rms_norm(h.data_ptr(), y.data_ptr(), y_w.data_ptr(), w.data_ptr(),
                                    EPS, out.data_ptr(), 3, n, IO[dtype])
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), hf_rms_norm(want_h, w), **tol(dtype))
    # The last layer: no next norm, and nothing written to out.
    lib.kvscope_add_normed_rms_norm(h_last.data_ptr(), y.data_ptr(), y_w.data_ptr(), None, EPS,
                                    None, 3, n, IO[dtype])
    assert torch.equal(h_last, h)
