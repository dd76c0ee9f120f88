"""A fused decode step's layers in one native call and one OpenMP region
(kernels/cpu_decode_step.c).

Kernel by kernel (engine.model.fused.decode.run_layers), a layer opens five parallel regions and
libgomp's threads, spinning only briefly between them (GOMP_SPINCOUNT, kvscope/__init__.py),
sleep and are woken by a futex some 150 times a step. One region keeps them in the step:
the same kernels, the same arithmetic in the same order, the same bits.

The step's fixed part, a table of every layer's pointers (weights, RoPE tables, norms, KV
pool layer), is built once per model and pool and kept while both live. It runs when every
matmul's implementation is already chosen and none is torch's (kernels.kernel_choice): a
choice of torch is kept (this path calls only the native kernels), and an unmeasured one is
made first by the kernel-by-kernel step. KVSCOPE_ONE_REGION=off turns it off.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvscope.engine.model.fused.model_view import FusedModel
from kvscope.engine.model.step_interrupt import StepInterrupted
from kvscope.engine.model.weight_formats import DenseLinear, Int4Linear, Int8Linear, Linear
from kvscope.kernels import cpu_attention, cpu_int4, cpu_int8, cpu_linear, native
from kvscope.kernels.attention_ref import AttentionMetadata

# engine.model.fused.decode's PoolPlan: it imports this module, so importing it here, even for type
# checking only, would close an import cycle.
PoolPlan = Any

ENV = "KVSCOPE_ONE_REGION"
STOPPED = 2  # kvscope_decode_step's status when the step's stop flag was set
BF16 = torch.bfloat16
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MATMULS = ("qkv", "o_proj", "gate_up", "down")


class StepMatmul(ctypes.Structure):
    # int4: 0 dense, 1 torch's int4 packing, 2 the AMX tiles' layout, 3 int8 (scale_zero:
    # the int8 scales)
    _fields_ = [("w", P), ("scale_zero", P), ("n", I64), ("k", I64), ("int4", I64),
                ("paths", I64),  # paths: set per step from the chosen implementation
                ("block", I64)]  # torch's int4 packing width (kernels/cpu_int4.py)


class StepLayer(ctypes.Structure):
    _fields_ = [*((name, StepMatmul) for name in MATMULS),
                ("cos", P), ("sin", P), ("rot", I64), ("q_norm", P), ("k_norm", P),
                ("k_cache", P), ("v_cache", P), ("k_scale", P), ("v_scale", P),
                ("shift", P), ("gain", P), ("q_gain", P), ("anchor_k", P), ("anchor_v", P),
                ("anchor_len", I64), ("window", I64), ("softcap", F32),
                ("attn_out_norm", P), ("post_norm", P), ("mlp_out_norm", P),
                ("next_norm", P)]


class StepPlan(ctypes.Structure):
    _fields_ = [*((name, I64) for name in (
                    "layers", "rows", "hidden", "inter", "heads", "kv_heads", "head_dim",
                    "block_size", "kind", "io", "gelu", "table_stride", "seqs")),
                ("eps", F32), ("sm_scale", F32),
                *((name, P) for name in (
                    "h", "q", "o", "xf", "x", "qkv", "att", "y", "gate_up", "act",
                    "positions", "slots", "att_rows", "tables", "lens", "anchor_idx",
                    "R", "R_t", "first_norm", "stop"))]


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


@dataclass
class LayerTable:
    """Every layer's pointers, and the tensors they point into (kept alive with it)."""
    layers: ctypes.Array[StepLayer]
    keep: list[torch.Tensor]
    matmuls: list[Linear]  # one of each distinct (kind, shape): what eligibility asks about
    widest_in: int
    inter: int
    paths: dict[tuple[int, int], int] | None = None  # what the layers' StepMatmuls hold now


# model -> (what the table was built from, table): rebuilt when the model's pool (a
# reconfigure), tables or family change
# (weak references: a table must not keep an old pool's memory alive, and a dead source
# never matches a new one that happens to reuse its address)
_tables: weakref.WeakKeyDictionary[object, tuple[list[weakref.ref[object]], LayerTable]] = \
    weakref.WeakKeyDictionary()


def layer_table(model: FusedModel, kv: PoolPlan) -> LayerTable:
    source = _sources(model, kv)
    got = _tables.get(model)
    if got is not None and len(got[0]) == len(source) and all(
            ref() is now for ref, now in zip(got[0], source, strict=True)):
        return got[1]
    table = _build_table(model, kv)
    _tables[model] = ([weakref.ref(x) for x in source], table)
    return table


def _sources(model: FusedModel, kv: PoolPlan) -> list[object]:
    pool = kv.pool
    got: list[object] = [pool, model.fused_tables]
    for pairs in (pool.caches, pool.scales, pool.anchors):
        got += [t for pair in pairs or () for t in pair]
    got += [t for kb in pool.k_balance or () for t in (kb.shift, kb.gain, kb.q_gain)]
    family = getattr(model, "family", None)
    return got if family is None else [*got, family]


def _build_table(model: FusedModel, kv: PoolPlan) -> LayerTable:
    tables, pool, layers = model.fused_tables, kv.pool, model.layers
    if tables is None:
        raise ValueError("this model's decode steps do not fuse (see matmul_plan)")
    family = getattr(model, "family", None)
    softcap = family.attn_softcap if family is not None else 0.0
    keep: list[torch.Tensor] = []
    ptr = native.address
    out = (StepLayer * len(layers))()
    distinct: dict[tuple[str, int, int], Linear] = {}
    for i, layer in enumerate(layers):
        cos, sin = tables.rope(layer)
        row = out[i]
        for name in MATMULS:
            linear = getattr(layer, name)
            setattr(row, name, _matmul(linear, keep))
            distinct.setdefault((type(linear).__name__, *linear.shape), linear)
        layer_kv = kv.layer(i)
        ks, vs, anchors = layer_kv if layer_kv is not None else (None, None, None)
        ak, av = anchors if anchors is not None else (None, None)
        if ak is not None and av is not None and not (
                ak.is_contiguous() and av.is_contiguous() and ak.dtype == torch.float32):
            raise ValueError("anchor rows must be contiguous float32")
        kb = pool.k_balance[i] if pool.k_balance is not None else None
        k_cache, v_cache = pool.caches[i]
        row.cos, row.sin, row.rot = cos.data_ptr(), sin.data_ptr(), cos.shape[1]
        row.q_norm, row.k_norm = ptr(tables.q_norms[i]), ptr(tables.k_norms[i])
        row.k_cache, row.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        row.k_scale, row.v_scale = ptr(ks), ptr(vs)
        row.shift = ptr(kb.shift if kb else None)
        row.gain = ptr(kb.gain if kb else None)
        row.q_gain = ptr(kb.q_gain if kb else None)
        row.anchor_k, row.anchor_v = ptr(ak), ptr(av)
        row.anchor_len = ak.shape[1] if ak is not None else 0
        row.window, row.softcap = getattr(layer, "window", 0), softcap
        row.attn_out_norm, row.post_norm = ptr(tables.attn_out_norms[i]), ptr(tables.post_norms[i])
        row.mlp_out_norm = ptr(tables.mlp_out_norms[i])
        row.next_norm = ptr(tables.input_norms[i + 1]) if i + 1 < len(layers) else None
    widest = max(linear.shape[1] for linear in distinct.values())
    return LayerTable(out, keep, list(distinct.values()), widest, layers[0].down.shape[1])


def _matmul(linear: Linear, keep: list[torch.Tensor]) -> StepMatmul:
    n, k = linear.shape
    if isinstance(linear, Int4Linear):
        if linear.tiles is not None:
            return StepMatmul(linear.tiles.data_ptr(), None, n, k, 2)
        assert linear.packed is not None  # one of the two layouts is always kept
        return StepMatmul(linear.packed.data_ptr(), linear.scale_zero.data_ptr(), n, k, 1, 0,
                          cpu_int4.torch_block() or 0)
    if isinstance(linear, Int8Linear):  # int4 = 3: the int8 kernel, codes and scales
        return StepMatmul(linear.codes.data_ptr(), linear.scales.data_ptr(), n, k, 3)
    if not isinstance(linear, DenseLinear) or not linear.weight.is_contiguous():
        raise TypeError(f"a one-region decode step got a {type(linear).__name__}")
    keep.append(linear.weight)
    return StepMatmul(linear.weight.data_ptr(), None, n, k, 0)


def chosen_paths(matmuls: Sequence[Linear], rows: int, io_dtype: torch.dtype
                 ) -> dict[tuple[int, int], int] | None:
    """Per dense weight shape, the bfloat16 hardware paths its chosen native implementation
    takes (cpu_linear.paths); None unless every matmul has an implementation chosen for this
    row count and none is torch's (the one-region step calls the native kernels only)."""
    got = _native_paths(matmuls, rows, io_dtype, instead_of_torch=False)
    return got[0] if got is not None else None


def paths_instead_of_torch(matmuls: Sequence[Linear], rows: int, io_dtype: torch.dtype
                           ) -> dict[tuple[int, int], int] | None:
    """Where every matmul has its implementation chosen and some chose torch's: the paths the
    one region would run each dense weight on with torch's choices replaced by the fastest
    native variant measured beside them (a 4-bit weight: the native kernel). None where a
    choice is missing, a weight has no native kernel here, or none chose torch."""
    got = _native_paths(matmuls, rows, io_dtype, instead_of_torch=True)
    return got[0] if got is not None and got[1] else None


def _native_paths(matmuls: Sequence[Linear], rows: int, io_dtype: torch.dtype,
                  instead_of_torch: bool) -> tuple[dict[tuple[int, int], int], bool] | None:
    """(per dense shape, its paths; whether a torch choice was replaced), or None where a
    choice is missing, a weight has no native kernel, or torch was chosen and may not be
    (or has no native time to stand in for it)."""
    paths: dict[tuple[int, int], int] = {}
    replaced = False
    for linear in matmuls:
        n, k = linear.shape
        if isinstance(linear, Int4Linear):
            if not cpu_int4.supports(n, k):
                return None
            # the tiles' kernels are the only ones for their layout: nothing to choose
            impl = cpu_int4.TILES if linear.tiles is not None \
                else cpu_int4.implementation(rows, n, k)
        elif isinstance(linear, Int8Linear) and linear.native:
            impl = cpu_int8.implementation(rows, n, k)  # a thread split: never torch's
        elif isinstance(linear, DenseLinear) and linear.native:
            impl = cpu_linear.chosen(io_dtype, n, k, rows)
            if impl == cpu_linear.TORCH and instead_of_torch:
                impl = cpu_linear.best_native(io_dtype, n, k, rows)
                replaced = True
            if impl is not None and impl != cpu_linear.TORCH:
                paths[(n, k)] = cpu_linear.paths(impl, n, k)
        else:
            return None
        if impl == cpu_linear.TORCH and instead_of_torch:  # a 4-bit torch choice
            replaced = True
        elif impl is None or impl == cpu_linear.TORCH:
            return None
    return paths, replaced


def set_paths(table: LayerTable, paths: dict[tuple[int, int], int]) -> None:
    """Each dense matmul's hardware paths for this step (only written when they change)."""
    if table.paths == paths:
        return
    for row in table.layers:
        for name in MATMULS:
            m = getattr(row, name)
            m.paths = paths.get((m.n, m.k), 0) if not m.int4 else 0
    table.paths = dict(paths)


def run(model: FusedModel, kv: PoolPlan, h: torch.Tensor, positions: torch.Tensor,
        slots: torch.Tensor, meta: AttentionMetadata, io_dtype: torch.dtype,
        paths: dict[tuple[int, int], int] | None = None) -> bool:
    """Every layer of the step in one native call: h (the embedding rows, float32) becomes
    the residual stream after the last layer. False (h untouched) when this step cannot go
    this way (disabled, or a matmul not chosen native yet). paths: run the dense weights on
    these (paths_instead_of_torch) rather than on their chosen implementations'."""
    if not enabled():
        return False
    table = layer_table(model, kv)
    rows = h.shape[0]
    if paths is None:
        paths = chosen_paths(table.matmuls, rows, io_dtype)
    if paths is None:
        return False
    set_paths(table, paths)
    s, pool = model.shape, kv.pool
    att_rows, block_tables, lens, anchor_idx = cpu_attention.decode_rows(meta)
    qkv_n = model.layers[0].qkv.shape[0]
    q = torch.empty(rows, s.num_heads * s.head_dim)
    buffers = {"x": torch.empty(rows, s.hidden_size, dtype=io_dtype),
               "qkv": torch.empty(rows, qkv_n, dtype=io_dtype),
               "att": torch.empty(rows, s.num_heads * s.head_dim, dtype=io_dtype),
               "y": torch.empty(rows, s.hidden_size, dtype=io_dtype),
               "gate_up": torch.empty(rows, 2 * table.inter, dtype=io_dtype),
               "act": torch.empty(rows, table.inter, dtype=io_dtype),
               "q": q, "o": torch.empty_like(q), "xf": torch.empty(rows, table.widest_in)}
    tables = model.fused_tables
    if tables is None:  # layer_table refused such a model already
        raise ValueError("this model's decode steps do not fuse (see matmul_plan)")
    family = getattr(model, "family", None)
    plan = StepPlan(
        layers=len(model.layers), rows=rows, hidden=s.hidden_size, inter=table.inter,
        heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
        block_size=pool.caches[0][0].shape[1], kind=kv.kind, io=int(io_dtype == BF16),
        gelu=int(family is not None and family.activation == "gelu_tanh"),
        table_stride=block_tables.shape[1], seqs=len(att_rows), eps=s.rms_norm_eps,
        sm_scale=model.scale, h=h.data_ptr(),
        positions=positions.data_ptr(), slots=slots.data_ptr(), att_rows=att_rows.data_ptr(),
        tables=block_tables.data_ptr(), lens=lens.data_ptr(),
        anchor_idx=native.address(anchor_idx), R=native.address(kv.r),
        R_t=native.address(kv.r_t), first_norm=tables.input_norms[0].data_ptr(),
        **{name: t.data_ptr() for name, t in buffers.items()})
    interrupt = getattr(model, "interrupt", None)
    if interrupt is not None and interrupt.armed:
        plan.stop = ctypes.addressof(interrupt.flag)
    status = native.require_library().kvscope_decode_step(ctypes.addressof(plan),
                                                          ctypes.addressof(table.layers))
    if status == STOPPED:
        raise StepInterrupted
    if status:
        raise MemoryError("the one-region decode step could not allocate its scratch")
    return True
