"""Triton KV write: scatter a step's new K/V rows into their slots, quantizing on the way.

Same contract as `kernels.kv_write_ref.write_kv_ref` (the CPU path and the oracle).

Design: one program per token; it loads the token's K and V as [kv_heads, head_dim] tiles,
and for an int8/fp8 pool computes one scale per kv head (max|x| / qmax, at least 1e-8),
writes the codes into the slot and the scales into the scale cache. A negative slot is
skipped (vLLM's padding convention; the reference would reject it).

Bit-exactness with the reference (tested under TRITON_INTERPRET=1, checked on the GPU by
benchmarks/device/gpu_check.py):
* both divisions use IEEE round-to-nearest division (`tl.math.div_rn`; a plain `/` is an
  approximate division on NVIDIA GPUs), so scales and x / scale equal torch's bit for bit;
* int8 rounds half to even like `torch.round`, with the float trick
  (y + 1.5 * 2**23) - 1.5 * 2**23, exact for |y| < 2**22 (here |y| <= 127);
* fp8 e4m3fn codes are built with integer arithmetic (round to nearest even, subnormals
  included) and stored as bytes: Triton's interpreter converts float32 to fp8 wrongly (it
  drops the carry into the exponent and flushes subnormals) and GPUs before sm_89 have no
  e4m3 conversion, so one exact encoder serves the interpreter and every GPU.
* a float32/float16 row going into a bfloat16 pool is rounded to nearest even with integer
  arithmetic too (the interpreter truncates; on the GPU the result is the same as `.to`).
So int8 and fp8 codes, bfloat16 rows and the scales are expected to equal the reference
exactly; the tests require that.

With a rotation R (kernels/rotation.py) the program multiplies its [kv_heads, head_dim] K and V
tiles by R in registers (a float32 `tl.dot`, the kv-head rows padded to 16) before the scale
is taken: no extra pass over anything, and the pool holds x @ R. Its summation order is not
torch's, so rotated codes may sit one step from the torch path's
(tests/kernels/test_triton_rotation.py).
With a K balance (kernels/k_balance.py) the K tile is shifted and scaled per channel first,
(k - c) * g, two elementwise ops on the tile it already holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.quant import MIN_SCALE, QMAX, is_quantized

_KIND = {torch.int8: 1, torch.float8_e4m3fn: 2}


@triton.jit
def _round_half_even(y):
    # 1.5 * 2**23: adding and subtracting it rounds float32 |y| < 2**22 to an integer, ties to
    # even (IEEE addition rounds to nearest even; Triton does not reassociate float math).
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _bf16_rne(x):
    """float32 -> bfloat16, round to nearest even, with integer arithmetic (what the GPU's
    cvt.rn does; Triton's interpreter truncates instead)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)  # noqa: PLR0124 - NaN test: keep NaN a NaN
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_as(ptr, x, mask, BF16: tl.constexpr):
    if BF16:
        tl.store(ptr, _bf16_rne(x.to(tl.float32)), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8e4m3_bits(y):
    """float32 |y| <= 448 -> e4m3fn byte (as int32), round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range (|y| >= 2**-6): round the 23-bit mantissa to 3 bits in the integer domain;
    # a carry moves into the exponent by itself. Rebias the exponent from 127 to 7.
    norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals are multiples of 2**-9: round |y| * 2**9 (exact) to an integer 0..8;
    # 8 is the code of 2**-6, the smallest normal, so the two ranges join seamlessly.
    sub = _round_half_even(tl.abs(y) * 512.0).to(tl.int32)
    code = tl.where(a < 0x3C800000, sub, norm)
    return code | sign


@triton.jit
def _quantize_store(x, dst_ptr, scale_ptr, mask_h, mask,
                    KIND: tl.constexpr, QMAX_V: tl.constexpr, MIN_S: tl.constexpr):
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, QMAX_V), MIN_S)
    y = tl.math.div_rn(x, scale[:, None])
    if KIND == 1:
        code = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        code = _fp8e4m3_bits(y).to(tl.uint8)
    tl.store(dst_ptr, code, mask=mask)
    tl.store(scale_ptr, scale, mask=mask_h)


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    skt, skh, skd, svt, svh, svd,                       # key / value strides
    kcb, kcs, kch, kcd, vcb, vcs, vch, vcd,             # cache strides
    ksb, kss, ksh, vsb, vss, vsh,                       # scale cache strides
    rot_ptr,                                            # R [head_dim, head_dim] float32
    shift_ptr, gain_ptr,                                # K balance c, g [kv_heads, head_dim]
    block_size, kv_heads, head_dim,
    KIND: tl.constexpr, QMAX_V: tl.constexpr, MIN_S: tl.constexpr, BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
    BALANCE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask_h = h < kv_heads
        mask = mask_h[:, None] & (d < head_dim)[None, :]
        k = tl.load(key_ptr + t * skt + h[:, None] * skh + d[None, :] * skd, mask=mask, other=0.0)
        v = tl.load(value_ptr + t * svt + h[:, None] * svh + d[None, :] * svd, mask=mask,
                    other=0.0)
        if BALANCE:
            cg = h[:, None] * head_dim + d[None, :]
            c = tl.load(shift_ptr + cg, mask=mask, other=0.0)
            g = tl.load(gain_ptr + cg, mask=mask, other=0.0)
            k = (k.to(tl.float32) - c) * g
        if ROTATE:
            # x @ R in registers (BLOCK_H >= 16 rows for tl.dot; padded rows are zeros).
            d_ok = d < head_dim
            r = tl.load(rot_ptr + d[:, None] * head_dim + d[None, :],
                        mask=d_ok[:, None] & d_ok[None, :], other=0.0)
            k = tl.dot(k.to(tl.float32), r, input_precision="ieee")
            v = tl.dot(v.to(tl.float32), r, input_precision="ieee")
        k_dst = k_cache_ptr + blk * kcb + off * kcs + h[:, None] * kch + d[None, :] * kcd
        v_dst = v_cache_ptr + blk * vcb + off * vcs + h[:, None] * vch + d[None, :] * vcd
        if KIND == 0:
            _store_as(k_dst, k, mask, BF16)
            _store_as(v_dst, v, mask, BF16)
        else:
            _quantize_store(k.to(tl.float32), k_dst, k_scale_ptr + blk * ksb + off * kss + h * ksh,
                            mask_h, mask, KIND, QMAX_V, MIN_S)
            _quantize_store(v.to(tl.float32), v_dst, v_scale_ptr + blk * vsb + off * vss + h * vsh,
                            mask_h, mask, KIND, QMAX_V, MIN_S)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, *,
                    rotation: torch.Tensor | None = None,
                    k_balance: KBalanceLayer | None = None) -> None:
    """key/value: [T, kv_heads, head_dim] (any strides); caches: [num_blocks, block_size,
    kv_heads, head_dim]; scales (int8/fp8 caches only): [num_blocks, block_size, kv_heads]
    float32. Writes in place; slots < 0 are skipped. `rotation` R [head_dim, head_dim]
    float32: the pool gets key @ R and value @ R, rotated in registers before quantizing.
    `k_balance` (kernels.k_balance): the key is (key - c) * g before that."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K and V caches differ in dtype: {k_cache.dtype} vs {v_cache.dtype}")
    num_tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (kv_heads, head_dim) \
            or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, "
                         f"expected ({num_tokens},)")
    if num_tokens == 0:
        return
    quant = is_quantized(k_cache.dtype)
    if quant:
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs its scale caches")
        if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
            raise ValueError("the scale caches must be float32")
        kind, qmax = _KIND[k_cache.dtype], QMAX[k_cache.dtype]
        # fp8 codes travel as bytes (see the module docstring).
        kc = k_cache.view(torch.uint8) if kind == 2 else k_cache
        vc = v_cache.view(torch.uint8) if kind == 2 else v_cache
        ks, vs = k_scale, v_scale
    else:
        kind, qmax = 0, 1.0
        kc, vc = k_cache, v_cache
        ks = vs = k_cache  # unused placeholders (never dereferenced when KIND == 0)
    slots = slot_mapping if slot_mapping.device == key.device else slot_mapping.to(key.device)
    rot = check_rotation(rotation, head_dim, key.device)
    kb = check_k_balance(k_balance, kv_heads, head_dim, key.device)
    ksst = ks.stride() if quant else (0, 0, 0)
    vsst = vs.stride() if quant else (0, 0, 0)
    _kv_write_kernel[(num_tokens,)](
        key, value, kc, vc, ks, vs, slots,
        *key.stride(), *value.stride(), *kc.stride(), *vc.stride(), *ksst, *vsst,
        key if rot is None else rot,
        key if kb is None else kb.shift, key if kb is None else kb.gain,
        k_cache.shape[1], kv_heads, head_dim,
        KIND=kind, QMAX_V=qmax, MIN_S=MIN_SCALE,
        BF16=k_cache.dtype == torch.bfloat16
        and (key.dtype != torch.bfloat16 or rot is not None or kb is not None),
        BLOCK_H=triton.next_power_of_2(max(kv_heads, 16 if rot is not None else 1)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)) if rot is not None
        else triton.next_power_of_2(head_dim),
        ROTATE=rot is not None, BALANCE=kb is not None,
    )


def check_rotation(rotation: torch.Tensor | None, head_dim: int,
                   device: torch.device) -> torch.Tensor | None:
    """The rotation as the kernels read it: contiguous float32 [head_dim, head_dim] on device."""
    if rotation is None:
        return None
    if rotation.shape != (head_dim, head_dim):
        raise ValueError(f"rotation has shape {tuple(rotation.shape)}, expected "
                         f"({head_dim}, {head_dim})")
    return rotation.to(device=device, dtype=torch.float32).contiguous()


def check_k_balance(kb: KBalanceLayer | None, kv_heads: int, head_dim: int,
                    device: torch.device) -> KBalanceLayer | None:
    """The K balance as the kernels read it: contiguous float32 [kv_heads, head_dim] on device."""
    if kb is None:
        return None
    if kb.shift.shape != (kv_heads, head_dim):
        raise ValueError(f"K balance has shape {tuple(kb.shift.shape)}, expected "
                         f"({kv_heads}, {head_dim})")
    return kb.to(device)
