"""A decode step on the CPU with the glue between matmuls fused.

A decode step's matmuls are cheap at a few rows (int4 weights read 8x fewer bytes than
float32; dense float32 ones go through the native small-row matmul, kernels.cpu_linear), and
the rest of a layer, thirty to seventy small torch ops (norms, RoPE, the KV write,
conversions, SiLU, residual adds), costs as much again in dispatch alone. Here a layer is its
four matmuls and four calls into kernels/cpu_decode_glue.c and the native decode attention:
norm (with the residual add), RoPE + KV write, attention, SiLU x up. Once every matmul's
implementation is chosen and native, engine.model.fused.one_region runs the same calls for every
layer inside one native call and one OpenMP region (the same bits, without a thread wake-up
per kernel); run_layers below is the kernel-by-kernel step it replaces.

The families of engine.model.family each fit in those calls: qwen3/gemma3's per-head q/k RMSNorm and
phi3's partial rotary in the RoPE call, gemma's gelu-tanh in the GLU call, gemma's sandwich norms
(attention and MLP outputs) in the residual add, gemma's embedding scale on the embedding, sliding
windows (gemma3's sliding layers with their own RoPE tables) and gemma2's score soft-capping in the
attention call. engine.model.fused.model_view says what a family would need that is not here; such a
model takes its ordinary forward.

Three kinds of model qualify: a float32 model whose every matmul is int4 without bias (the matmul
rows in and out are bfloat16, as torch's int4 kernel takes and gives them), or a float32 or
bfloat16 model whose every matmul is dense, or int8 (kernels/cpu_int8.py), without bias (rows in
the model's dtype). It runs when every row
of the step decodes, or its prompt tokens are few (each becomes a row of its own,
engine.model.fused.rows; speculative drafts always do), and the pool holds float32, bfloat16, int8
or fp8 K/V (rotated, K-balanced and anchored as the pool is: the RoPE call stores K/V through the
pool's transforms and quantizer, kernels/cpu_kv_write.c, and hands the attention the query as the
ordinary forward turns it, (q / g) @ R; the output is turned back by R^T on its way to o_proj;
anchors are read by the attention kernel); anything else (long prefill chunks, a step that fills
anchor rows, a float16 pool, a bias on a projection) takes the model's ordinary forward. The
residual stream is float32 here: for a float32 model that is the ordinary forward's too, and the
results differ from it only in float32 rounding order
(tests/engine/model/fused/test_fused_decode.py, tests/engine/model/fused/test_fused_families.py,
tests/engine/model/fused/test_fused_quantized.py; the greedy tokens still equal Hugging Face's,
tests/engine/model/test_embedded_model.py); a bfloat16 model's ordinary forward rounds the residual
stream to bfloat16 after every add, which this step does not."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.engine.model.fused import one_region as fused_one_region
from kvscope.engine.model.fused import rows as fused_rows
from kvscope.engine.model.fused import step_choice as fused_step_choice
from kvscope.engine.model.fused.model_view import (
    BF16,
    POOL_KINDS,
    Float32Tables,
    FusedLayer,
    FusedModel,
    FusedPool,
)
from kvscope.engine.model.weight_formats import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    int4_mm_bf16,
)
from kvscope.kernels import cpu_attention, cpu_int8, cpu_linear, native
from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import AttentionMetadata


def int4(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """bfloat16 x [T, in] -> bfloat16 [T, out], without the float32 round trip."""
    if not isinstance(linear, Int4Linear):  # matmul_plan chose int4 for every matmul
        raise TypeError(f"an int4 decode step got a {type(linear).__name__}")
    return int4_mm_bf16(x, linear)


def int8(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """x [T, in] in the model's dtype -> [T, out] in the same dtype."""
    if not isinstance(linear, Int8Linear):  # matmul_plan chose int8 for every matmul
        raise TypeError(f"an int8 decode step got a {type(linear).__name__}")
    return cpu_int8.int8_mm(x, linear.codes, linear.scales)


def dense(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    if not isinstance(linear, DenseLinear):  # matmul_plan chose dense for every matmul
        raise TypeError(f"a dense decode step got a {type(linear).__name__}")
    return cpu_linear.linear(x, linear.weight)


# A layer's (k_scale, v_scale, anchors) as the attention kernel takes them.
PoolLayer = tuple[torch.Tensor | None, torch.Tensor | None, Anchors | None]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
              kv: PoolLayer | None = None) -> torch.Tensor:
    """kv: a 1-byte or anchored pool layer's scales and anchors (None: a float pool)."""
    if kv is not None:
        return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale, *kv,
                                                 window=window, softcap=softcap)
    if not (window or softcap):  # the call as before the families came
        return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale)
    return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale, window=window,
                                             softcap=softcap)


@dataclass
class PoolPlan:
    """What a step needs of the KV pool beyond its caches: the RoPE call's kind, the rotation
    R and its transpose (float32, contiguous; None: unrotated), and per layer the scales,
    anchors and K balance (plain: a float pool without transforms, stored as before)."""
    pool: FusedPool
    kind: int
    r: torch.Tensor | None
    r_t: torch.Tensor | None

    @property
    def plain(self) -> bool:
        p = self.pool
        return self.r is None and p.k_balance is None and p.scales is None and p.anchors is None

    def layer(self, i: int) -> PoolLayer | None:
        p = self.pool
        if p.scales is None and p.anchors is None:
            return None
        ks, vs = p.scales[i] if p.scales is not None else (None, None)
        return ks, vs, p.anchors[i] if p.anchors is not None else None


def pool_plan(pool: FusedPool) -> PoolPlan:
    r = None if pool.rotation is None else pool.rotation.float().contiguous()
    return PoolPlan(pool, POOL_KINDS[pool.dtype], r, None if r is None else r.T.contiguous())


@dataclass
class Step:
    """One fused decode step's fixed parts: the library, the rows, and the buffers every layer
    reuses (the float32 residual stream h, the matmul input x, the turned queries q)."""
    lib: ctypes.CDLL
    model: FusedModel
    tables: Float32Tables
    io_dtype: torch.dtype
    rows: int
    h: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cache_bf16: int
    kv: PoolPlan | None = None  # None: a float pool without transforms

    @property
    def io(self) -> int:
        return int(self.io_dtype == BF16)

    def mm(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        # int4 rows are bfloat16 in a float32 model; dense and int8 rows the model's dtype
        if isinstance(linear, Int8Linear):
            return int8(x, linear)
        return dense(x, linear) if self.io_dtype == self.model.dtype else int4(x, linear)


def embed(model: FusedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream's start, float32: the embedding rows, times gemma's scale rounded
    to the model's dtype as Hugging Face rounds it."""
    h = F.embedding(input_ids, model.embed)
    scale = getattr(getattr(model, "family", None), "embed_scale", 1.0)
    if scale != 1.0:
        h = h * torch.tensor(scale, dtype=model.dtype)
    return h.float().contiguous()


@torch.inference_mode()
def run_layers(model: FusedModel, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, pool: FusedPool) -> torch.Tensor:
    """The residual stream [T, hidden] float32 after the last layer (before the final norm)."""
    meta = fused_rows.as_rows(meta)
    io_dtype, tables = model.fused_rows, model.fused_tables
    if io_dtype is None or tables is None:
        raise ValueError("this model's decode steps do not fuse (see matmul_plan)")
    rows = len(input_ids)
    h = embed(model, input_ids)
    positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
    plan = pool_plan(pool)
    if fused_one_region.run(model, plan, h, positions, slots, meta, io_dtype):
        return h

    def by_kernel() -> torch.Tensor:
        return run_kernel_by_kernel(model, embed(model, input_ids), positions, slots, meta,
                                    pool, plan)
    if fused_one_region.enabled():
        matmuls = fused_one_region.layer_table(model, plan).matmuls
        instead = fused_one_region.paths_instead_of_torch(matmuls, rows, io_dtype)
        if instead is not None:
            def one() -> torch.Tensor:
                out = embed(model, input_ids)
                if fused_one_region.run(model, plan, out, positions, slots, meta, io_dtype,
                                        instead):
                    return out
                return by_kernel()
            if fused_step_choice.one_region_wins(matmuls, rows, io_dtype, one, by_kernel):
                return one()
    return run_kernel_by_kernel(model, h, positions, slots, meta, pool, plan)


def run_kernel_by_kernel(model: FusedModel, h: torch.Tensor, positions: torch.Tensor,
                         slots: torch.Tensor, meta: AttentionMetadata, pool: FusedPool,
                         plan: PoolPlan) -> torch.Tensor:
    """run_layers' step one kernel call at a time (each matmul on its chosen implementation,
    torch's included): h, the embedding rows, becomes the residual stream."""
    io_dtype, tables = model.fused_rows, model.fused_tables
    if io_dtype is None or tables is None:
        raise ValueError("this model's decode steps do not fuse (see matmul_plan)")
    s, rows = model.shape, h.shape[0]
    step = Step(native.require_library(), model, tables, io_dtype, rows, h,
                torch.empty(rows, s.hidden_size, dtype=io_dtype),
                torch.empty(rows, s.num_heads, s.head_dim), positions, slots,
                int(pool.dtype == BF16))
    step.kv = None if plan.plain else plan
    step.lib.kvscope_add_rms_norm(step.h.data_ptr(), None, tables.input_norms[0].data_ptr(),
                                  s.rms_norm_eps, step.x.data_ptr(), rows, s.hidden_size,
                                  step.io)
    family = getattr(model, "family", None)
    softcap = family.attn_softcap if family is not None else 0.0
    gelu = family is not None and family.activation == "gelu_tanh"
    layers = model.layers
    interrupt = getattr(model, "interrupt", None)
    for i, layer in enumerate(layers):
        if interrupt is not None:
            interrupt.check()  # engine.model.step_interrupt: an urgent request arrived
        qkv = step.mm(step.x, layer.qkv)
        k_cache, v_cache = pool.caches[i]
        rope_write(step, i, layer, qkv, k_cache, v_cache)
        o = attention(step.q, k_cache, v_cache, meta, model.scale,
                      getattr(layer, "window", 0), softcap,
                      step.kv.layer(i) if step.kv is not None else None)
        y = step.mm(attention_rows(step, o), layer.o_proj)
        residual_add(step, y, tables.attn_out_norms[i], tables.post_norms[i])
        gate_up = step.mm(step.x, layer.gate_up)
        act = torch.empty(rows, gate_up.shape[1] // 2, dtype=io_dtype)
        glu = step.lib.kvscope_gelu_tanh_mul if gelu else step.lib.kvscope_silu_mul
        glu(gate_up.data_ptr(), act.data_ptr(), rows, act.shape[1], step.io)
        y = step.mm(act, layer.down)
        residual_add(step, y, tables.mlp_out_norms[i],
                     tables.input_norms[i + 1] if i + 1 < len(layers) else None)
    return step.h


def attention_rows(step: Step, o: torch.Tensor) -> torch.Tensor:
    """The attention output [rows, heads, d] float32 as o_proj's input rows: turned back by
    R^T when the pool is rotated (one native call that also narrows to the row dtype)."""
    kv = step.kv
    if kv is None or kv.r_t is None:
        return o.view(step.rows, -1).to(step.io_dtype)
    out = torch.empty(step.rows, o.shape[1] * o.shape[2], dtype=step.io_dtype)
    step.lib.kvscope_rotate_rows(o.data_ptr(), step.rows * o.shape[1], o.shape[2],
                                 kv.r_t.data_ptr(), out.data_ptr(), step.io)
    return out


def rope_write(step: Step, i: int, layer: FusedLayer, qkv: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q (and k, v into the cache) of layer i: turned by the layer's RoPE tables, after the
    family's per-head q/k norm, over the first rotary width of a head (the tables' width).
    A 1-byte or transformed pool: stored through its transforms and quantizer, and q turned
    as its keys are (kvscope_rope_write_kv)."""
    s, t = step.model.shape, step.tables
    cos, sin = t.rope(layer)
    q_norm, k_norm, rot = t.q_norms[i], t.k_norms[i], cos.shape[1]
    if step.kv is not None:
        rope_write_kv(step, i, qkv, (cos, sin), (q_norm, k_norm), k_cache, v_cache)
        return
    tail = (step.q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), step.slots.data_ptr(),
            s.num_heads, s.num_kv_heads, s.head_dim, step.cache_bf16, step.io)
    if q_norm is None and k_norm is None and rot == s.head_dim:
        step.lib.kvscope_rope_write(qkv.data_ptr(), step.rows, step.positions.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), *tail)
        return
    step.lib.kvscope_norm_rope_write(qkv.data_ptr(), step.rows, step.positions.data_ptr(),
                                     cos.data_ptr(), sin.data_ptr(), rot,
                                     native.address(q_norm), native.address(k_norm),
                                     s.rms_norm_eps, *tail)


def rope_write_kv(step: Step, i: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  norms: tuple[torch.Tensor | None, torch.Tensor | None], k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> None:
    kv, s, ptr = step.kv, step.model.shape, native.address
    if kv is None:
        raise ValueError("rope_write_kv needs the step's pool plan")
    cos, sin = rope
    layer_kv = kv.layer(i)
    ks, vs = (layer_kv[0], layer_kv[1]) if layer_kv is not None else (None, None)
    kb = kv.pool.k_balance[i] if kv.pool.k_balance is not None else None
    step.lib.kvscope_rope_write_kv(
        qkv.data_ptr(), step.rows, step.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[1], ptr(norms[0]), ptr(norms[1]), s.rms_norm_eps, step.q.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), ptr(ks), ptr(vs), step.slots.data_ptr(),
        s.num_heads, s.num_kv_heads, s.head_dim, kv.kind, step.io, ptr(kv.r),
        ptr(kb.shift if kb else None), ptr(kb.gain if kb else None),
        ptr(kb.q_gain if kb else None))


def residual_add(step: Step, y: torch.Tensor, out_norm: torch.Tensor | None,
                 next_norm: torch.Tensor | None) -> None:
    """h += y (through gemma's sandwich norm `out_norm` when there is one), then x = the next
    norm of h (none after the last layer)."""
    s, lib = step.model.shape, step.lib
    eps, n, x = s.rms_norm_eps, s.hidden_size, step.x.data_ptr()
    if out_norm is not None:
        lib.kvscope_add_normed_rms_norm(step.h.data_ptr(), y.data_ptr(), out_norm.data_ptr(),
                                        native.address(next_norm), eps,
                                        x if next_norm is not None else None, step.rows, n,
                                        step.io)
    elif next_norm is not None:
        lib.kvscope_add_rms_norm(step.h.data_ptr(), y.data_ptr(), next_norm.data_ptr(), eps, x,
                                 step.rows, n, step.io)
    else:
        lib.kvscope_add(step.h.data_ptr(), y.data_ptr(), step.rows * n, step.io)
