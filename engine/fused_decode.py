"""A decode step on the CPU with the glue between matmuls fused.

A decode step's matmuls are cheap at a few rows (int4 weights read 8x fewer bytes than
float32; dense float32 ones go through the native small-row matmul, kernels.cpu_linear), and
the rest of a layer, thirty to seventy small torch ops (norms, RoPE, the KV write,
conversions, SiLU, residual adds), costs as much again in dispatch alone. Here a layer is its
four matmuls and four calls into kernels/cpu_decode_glue.c and the native decode attention:
norm (with the residual add), RoPE + KV write, attention, SiLU x up.

Two kinds of model qualify: a float32 model whose every matmul is int4 without bias (the
matmul rows in and out are bfloat16, as torch's int4 kernel takes and gives them), or a
float32 or bfloat16 model whose every matmul is dense without bias (rows in the model's
dtype). It runs when every row of the step decodes and the pool holds float32 or bfloat16 K/V
unrotated; anything else (prefill chunks, 1-byte or rotated KV, a bias on a projection) takes
the model's ordinary forward. The residual stream is float32 here: for a float32 model that is
the ordinary forward's too, and the results differ from it only in float32 rounding order
(tests/engine/test_fused_decode.py; the greedy tokens still equal Hugging Face's,
tests/engine/test_embedded_model.py); a bfloat16 model's ordinary forward rounds the residual stream
to bfloat16 after every add, which this step does not.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvscope.engine.weight_formats import INT4_GROUP, DenseLinear, Int4Linear, Linear
from kvscope.kernels import cpu_attention, cpu_linear, native, ops
from kvscope.kernels.attention_ref import AttentionMetadata
from kvscope.kernels.k_balance import KBalanceLayer

BF16 = torch.bfloat16
# kvscope_rope_write turns a head in a stack buffer of this many floats, and the glue holds a
# row (hidden, intermediate, or q|k|v) in one of ROW_MAX (kernels/cpu_decode_glue.c).
MAX_HEAD_DIM = 1024
ROW_MAX = 16384


# What this module reads of the model (engine.model.PagedLlama) and of the KV pool
# (engine.kv_cache.KVPool), as protocols: engine.model imports this module and engine.kv_cache
# imports engine.model, so importing either class here would close an import cycle.
class FusedShape(Protocol):
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float


class FusedLayer(Protocol):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    gate_up: Linear
    down: Linear


class FusedModel(Protocol):
    device: str
    dtype: torch.dtype
    embed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float
    fused_rows: torch.dtype | None
    fused_tables: Float32Tables | None

    @property
    def shape(self) -> FusedShape: ...

    @property
    def layers(self) -> Sequence[FusedLayer]: ...


class FusedPool(Protocol):
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None
    dtype: torch.dtype
    rotation: torch.Tensor | None
    k_balance: list[KBalanceLayer] | None


def matmul_rows(model: FusedModel) -> torch.dtype | None:
    """The dtype of the matmuls' input/output rows if the model's decode steps can fuse
    (bfloat16 for int4, the model's dtype for dense), else None."""
    linears = [getattr(layer, n) for layer in model.layers
               for n in ("qkv", "o_proj", "gate_up", "down")]
    s = model.shape
    widest = max(s.hidden_size, model.layers[0].down.shape[1],
                 (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
    if (model.device != "cpu" or model.dtype not in (torch.float32, BF16)
            or s.head_dim > MAX_HEAD_DIM or widest > ROW_MAX
            or ops.backend(model.device) != "cpu"  # KVSCOPE_KERNELS=ref: torch only
            or any(x.bias is not None for x in linears)):
        return None
    if model.dtype == torch.float32 and all(isinstance(x, Int4Linear) for x in linears):
        return BF16
    if all(isinstance(x, DenseLinear) and x.native for x in linears):
        return model.dtype
    return None


@dataclass
class Float32Tables:
    """What the glue reads in float32: the norm weights and the RoPE tables. A float32 model's
    own tensors; for a bfloat16 model, float32 copies (a few MB, mostly the RoPE tables)."""
    input_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor


def float32_tables(model: FusedModel) -> Float32Tables:
    return Float32Tables([_float32(layer.input_norm) for layer in model.layers],
                         [_float32(layer.post_norm) for layer in model.layers],
                         _float32(model.cos), _float32(model.sin))


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()  # the same tensor when it is float32


def supports_step(meta: AttentionMetadata, pool: FusedPool) -> bool:
    return (not meta.prefill_seqs and pool.rotation is None and pool.k_balance is None
            and pool.scales is None
            and pool.dtype in (torch.float32, BF16) and native.available())


def int4(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """bfloat16 x [T, in] -> bfloat16 [T, out], without the float32 round trip."""
    if not isinstance(linear, Int4Linear):  # matmul_rows chose int4 for every matmul
        raise TypeError(f"an int4 decode step got a {type(linear).__name__}")
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(  # torch.ops is typed Any
        x, linear.packed, INT4_GROUP, linear.scale_zero)
    return y


def dense(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    if not isinstance(linear, DenseLinear):  # matmul_rows chose dense for every matmul
        raise TypeError(f"a dense decode step got a {type(linear).__name__}")
    return cpu_linear.linear(x, linear.weight)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale)


@torch.inference_mode()
def run_layers(model: FusedModel, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, pool: FusedPool) -> torch.Tensor:
    """The residual stream [T, hidden] float32 after the last layer (before the final norm)."""
    lib, s = native.require_library(), model.shape
    io_dtype, tables = model.fused_rows, model.fused_tables
    if io_dtype is None or tables is None:
        raise ValueError("this model's decode steps do not fuse (see matmul_rows)")
    io = int(io_dtype == BF16)
    mm = dense if io_dtype == model.dtype else int4  # int4 rows: bfloat16 in a float32 model
    rows, hidden, eps = len(input_ids), s.hidden_size, s.rms_norm_eps
    h = F.embedding(input_ids, model.embed).float().contiguous()
    x = torch.empty(rows, hidden, dtype=io_dtype)
    q = torch.empty(rows, s.num_heads, s.head_dim)
    positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
    cache_bf16 = int(pool.dtype == BF16)
    layers = model.layers
    lib.kvscope_add_rms_norm(h.data_ptr(), None, tables.input_norms[0].data_ptr(), eps,
                             x.data_ptr(), rows, hidden, io)
    for i, layer in enumerate(layers):
        qkv = mm(x, layer.qkv)
        k_cache, v_cache = pool.caches[i]
        lib.kvscope_rope_write(qkv.data_ptr(), rows, positions.data_ptr(), tables.cos.data_ptr(),
                               tables.sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slots.data_ptr(), s.num_heads,
                               s.num_kv_heads, s.head_dim, cache_bf16, io)
        o = attention(q, k_cache, v_cache, meta, model.scale)
        y = mm(o.view(rows, -1).to(io_dtype), layer.o_proj)
        lib.kvscope_add_rms_norm(h.data_ptr(), y.data_ptr(), tables.post_norms[i].data_ptr(), eps,
                                 x.data_ptr(), rows, hidden, io)
        gate_up = mm(x, layer.gate_up)
        act = torch.empty(rows, gate_up.shape[1] // 2, dtype=io_dtype)
        lib.kvscope_silu_mul(gate_up.data_ptr(), act.data_ptr(), rows, act.shape[1], io)
        y = mm(act, layer.down)
        if i + 1 < len(layers):
            lib.kvscope_add_rms_norm(h.data_ptr(), y.data_ptr(),
                                     tables.input_norms[i + 1].data_ptr(), eps, x.data_ptr(),
                                     rows, hidden, io)
        else:
            lib.kvscope_add(h.data_ptr(), y.data_ptr(), rows * hidden, io)
    return h
