"""A decode step of a 4-bit model on the CPU with the glue between matmuls fused.

With int4 weights a decode step's matmuls are cheap (8x fewer bytes than float32), and the
rest of a layer, some seventy small torch ops (norms, RoPE, the KV write, conversions to and
from the kernel's bfloat16, SiLU, residual adds), costs as much again in dispatch alone. Here a
layer is its four int4 matmuls, which take and give bfloat16 directly, and four calls into
kernels/cpu_decode_glue.c and the native decode attention: norm (with the residual add) to
bfloat16, RoPE + KV write, attention, SiLU x up to bfloat16.

It runs when every row of the step decodes and the pool holds float32 or bfloat16 K/V
unrotated; anything else (prefill chunks, 1-byte or rotated KV, a bias on a projection)
takes the model's ordinary forward. The residual stream stays float32, as in that forward;
the results differ from it only in float32 rounding order (tests/test_fused_decode.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.weight_formats import INT4_GROUP, Int4Linear
from kernels import cpu_attention, native

BF16 = torch.bfloat16
# kvscope_rope_write turns a head in a stack buffer of this many floats.
MAX_HEAD_DIM = 1024


def supports_model(model) -> bool:
    """A float32 model on the CPU whose every matmul is int4 without bias, kernels built."""
    linears = [getattr(layer, n) for layer in model.layers
               for n in ("qkv", "o_proj", "gate_up", "down")]
    return (model.device == "cpu" and model.dtype == torch.float32
            and model.shape.head_dim <= MAX_HEAD_DIM
            and all(isinstance(x, Int4Linear) and x.bias is None for x in linears)
            and native.available())


def supports_step(meta, pool) -> bool:
    return (not meta.prefill_seqs and pool.rotation is None and pool.k_balance is None
            and pool.scales is None
            and pool.dtype in (torch.float32, BF16) and native.available())


def int4(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    """bfloat16 x [T, in] -> bfloat16 [T, out], without the float32 round trip."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, INT4_GROUP,
                                                      linear.scale_zero)


@torch.inference_mode()
def run_layers(model, input_ids: torch.Tensor, positions: torch.Tensor, meta, pool
               ) -> torch.Tensor:
    """The residual stream [T, hidden] float32 after the last layer (before the final norm)."""
    lib, s = native.library(), model.shape
    rows, hidden, eps = len(input_ids), s.hidden_size, s.rms_norm_eps
    h = F.embedding(input_ids, model.embed).contiguous()
    x = torch.empty(rows, hidden, dtype=BF16)
    q = torch.empty(rows, s.num_heads, s.head_dim)
    positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
    cache_bf16 = int(pool.dtype == BF16)
    layers = model.layers
    lib.kvscope_add_rms_norm_bf16(h.data_ptr(), None, layers[0].input_norm.data_ptr(), eps,
                                  x.data_ptr(), rows, hidden)
    for i, layer in enumerate(layers):
        qkv = int4(x, layer.qkv)
        k_cache, v_cache = pool.caches[i]
        lib.kvscope_rope_write(qkv.data_ptr(), rows, positions.data_ptr(), model.cos.data_ptr(),
                               model.sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slots.data_ptr(), s.num_heads,
                               s.num_kv_heads, s.head_dim, cache_bf16)
        o = cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, model.scale)
        y = int4(o.view(rows, -1).to(BF16), layer.o_proj)
        lib.kvscope_add_rms_norm_bf16(h.data_ptr(), y.data_ptr(), layer.post_norm.data_ptr(),
                                      eps, x.data_ptr(), rows, hidden)
        gate_up = int4(x, layer.gate_up)
        act = torch.empty(rows, gate_up.shape[1] // 2, dtype=BF16)
        lib.kvscope_silu_mul_bf16(gate_up.data_ptr(), act.data_ptr(), rows, act.shape[1])
        y = int4(act, layer.down)
        if i + 1 < len(layers):
            lib.kvscope_add_rms_norm_bf16(h.data_ptr(), y.data_ptr(),
                                          layers[i + 1].input_norm.data_ptr(), eps,
                                          x.data_ptr(), rows, hidden)
        else:
            lib.kvscope_add_bf16(h.data_ptr(), y.data_ptr(), rows * hidden)
    return h
