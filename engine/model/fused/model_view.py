"""What the fused CPU decode (engine.model.fused.decode) reads of a model and a KV pool, and whether
it can take them.

The model and the pool as protocols (engine.model.paged_decoder imports the fused decode and
engine.kv_cache.pool imports engine.model.paged_decoder, so importing either class here would close
an import cycle); the families, activations, weight kinds and pool dtypes the native calls
implement, and the reasons a model, a pool or a step keeps the ordinary forward (logged once, and
shown in the window's status bar); the float32 norm and RoPE tables the glue reads.
engine.model.fused.decode runs the step."""
from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvscope.engine.model.fused import rows as fused_rows
from kvscope.engine.model.weight_formats import DenseLinear, Int4Linear, Int8Linear, Linear
from kvscope.kernels import cpu_attention, native, ops
from kvscope.kernels.attention_ref import AttentionMetadata
from kvscope.kernels.k_balance import KBalanceLayer

BF16 = torch.bfloat16
log = logging.getLogger("kvscope.engine")
# kvscope_rope_write turns a head in a stack buffer of this many floats, and the glue holds a
# row (hidden, intermediate, or q|k|v) in one of ROW_MAX (kernels/cpu_decode_glue.c).
MAX_HEAD_DIM = 1024
ROW_MAX = 16384
# The families (engine.model.family) whose math every call below implements, and the GLU
# activations the glue has.
COVERED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ACTIVATIONS = ("silu", "gelu_tanh")


# What the fused decode reads of the model (engine.model.paged_decoder.PagedLlama) and of the KV
# pool (engine.kv_cache.pool.KVPool).
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
    anchors: list[tuple[torch.Tensor, torch.Tensor]] | None


# The pool dtypes the RoPE call stores (kernels/cpu_decode_glue.c kvscope_rope_write_kv's
# kinds, the attention kernel's numbering).
POOL_KINDS = {torch.float32: 0, BF16: 1, torch.int8: 3, torch.float8_e4m3fn: 4}


def unsupported_reason(model: object) -> str | None:
    """Why the fused decode cannot take this model's family (None: it can, or the model is
    not on the CPU, where no fused step runs anyway). The model's ordinary forward runs
    instead; the first time a reason comes up it is logged (the status bar shows it too:
    decode_path_notice)."""
    reason = _family_reason(model)
    if reason is not None:
        _tell(reason)
    return reason


_told: set[str] = set()  # reasons logged already: one line per reason and process


def _tell(reason: str) -> None:
    if reason not in _told:
        _told.add(reason)
        log.warning("%s", reason)


def decode_path_notice(model: object) -> str:
    """The one-line notice for the window (EngineSettings.decode_path_notice): "" when the
    fused decode covers the model's family."""
    reason = _family_reason(model) or getattr(model, "matmul_reason", None)
    return reason or ""


def _family_reason(model: object) -> str | None:
    family = getattr(model, "family", None)
    if family is None or getattr(model, "device", "cpu") != "cpu":
        return None
    name = f"the fused CPU decode does not cover {family.model_type}"
    if family.model_type not in COVERED_FAMILIES:
        return f"{name} (its decode takes the ordinary, slower forward)"
    if family.activation not in ACTIVATIONS:
        return f"{name}: activation {family.activation!r} (it has {', '.join(ACTIVATIONS)})"
    shape, cos = getattr(model, "shape", None), getattr(model, "cos", None)
    if shape is not None and cos is not None and (
            cos.shape[-1] % 2 or cos.shape[-1] > shape.head_dim):
        return f"{name}: a rotary width of {cos.shape[-1]} in a head of {shape.head_dim}"
    taken = inspect.signature(cpu_attention.paged_attention_cpu).parameters
    if any(family.layer_windows) and "window" not in taken:
        return f"{name}: the native CPU attention takes no sliding window yet"
    if family.attn_softcap and "softcap" not in taken:
        return f"{name}: the native CPU attention takes no score soft-capping yet"
    return None


def matmul_plan(model: FusedModel) -> tuple[torch.dtype | None, str | None]:
    """(rows, why not): rows, the dtype of the matmuls' input/output rows if the model's
    decode steps can fuse (bfloat16 for int4, the model's dtype for dense and int8), else None; why
    not: why this model's matmuls keep its decode off the fused step,
    None when they do not or when the model is not on the CPU's native kernels at all (where
    nothing fuses by design). A reason is logged once, like unsupported_reason's."""
    rows, reason = _matmul_plan(model)
    if reason is not None:
        _tell(reason)
    return rows, reason


def _matmul_plan(model: FusedModel) -> tuple[torch.dtype | None, str | None]:
    linears = [getattr(layer, n) for layer in model.layers
               for n in ("qkv", "o_proj", "gate_up", "down")]
    s = model.shape
    widest = max(s.hidden_size, model.layers[0].down.shape[1],
                 (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
    if model.device != "cpu" or ops.backend(model.device) != "cpu":
        return None, None  # a GPU, or KVSCOPE_KERNELS=ref: torch only, as asked
    why = "the fused CPU decode does not take"
    if model.dtype not in (torch.float32, BF16):
        return None, f"{why} a {str(model.dtype).removeprefix('torch.')} model"
    if s.head_dim > MAX_HEAD_DIM or widest > ROW_MAX:
        return None, f"{why} heads over {MAX_HEAD_DIM} or rows over {ROW_MAX} values"
    if any(x.bias is not None for x in linears):
        return None, f"{why} projections with a bias (as qwen2's q/k/v)"
    if model.dtype == torch.float32 and all(isinstance(x, Int4Linear) for x in linears):
        return BF16, None
    if all(isinstance(x, DenseLinear) and x.native for x in linears):
        return model.dtype, None
    if all(isinstance(x, Int8Linear) and x.native for x in linears):
        return model.dtype, None  # the int8 kernel takes and gives the model's rows
    kinds = sorted({type(x).__name__ for x in linears})
    return None, f"{why} these weights ({', '.join(kinds)} in a {model.dtype} model)"


@dataclass
class Float32Tables:
    """What the glue reads in float32: the norm weights and the RoPE tables. A float32 model's
    own tensors; for a bfloat16 model, float32 copies (a few MB, mostly the RoPE tables).
    Per layer None where the family has no such norm; local_cos/local_sin: gemma3's sliding
    layers' tables (None: every layer takes cos/sin)."""
    input_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    q_norms: list[torch.Tensor | None]
    k_norms: list[torch.Tensor | None]
    attn_out_norms: list[torch.Tensor | None]
    mlp_out_norms: list[torch.Tensor | None]
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    def rope(self, layer: FusedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(layer, "local_rope", False):
            if self.local_cos is None or self.local_sin is None:
                raise ValueError("a layer takes the local RoPE tables and the model has none")
            return self.local_cos, self.local_sin
        return self.cos, self.sin


def float32_tables(model: FusedModel) -> Float32Tables:
    layers = model.layers
    local_cos, local_sin = getattr(model, "local_cos", None), getattr(model, "local_sin", None)
    return Float32Tables([_float32(layer.input_norm) for layer in layers],
                         [_float32(layer.post_norm) for layer in layers],
                         _float32(model.cos), _float32(model.sin),
                         _optional(layers, "q_norm"), _optional(layers, "k_norm"),
                         _optional(layers, "attn_out_norm"), _optional(layers, "mlp_out_norm"),
                         None if local_cos is None else _float32(local_cos),
                         None if local_sin is None else _float32(local_sin))


def _optional(layers: Sequence[FusedLayer], name: str) -> list[torch.Tensor | None]:
    """Each layer's norm weight `name` in float32, None where it has none (older layer
    objects lack the attribute altogether)."""
    got = [getattr(layer, name, None) for layer in layers]
    return [None if t is None else _float32(t) for t in got]


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()  # the same tensor when it is float32


def supports_step(meta: AttentionMetadata, pool: FusedPool) -> bool:
    """Whether this step fuses: every row decodes or the step's prompt and draft tokens are
    few enough to run as rows (engine.model.fused.rows), the pool is one the fused step stores
    (pool_reason), and no row fills anchor rows (a sequence's first positions: the ordinary
    forward writes those exact rows)."""
    if not native.available() or (meta.prefill_seqs and not fused_rows.fits(meta)):
        return False
    fill = meta.anchor_fill
    if fill is not None and len(fill[0]):
        return False
    if pool.dtype not in POOL_KINDS:
        reason = pool_reason(pool)
        if reason is not None:
            _tell(reason)
        return False
    return meta.rotation is pool.rotation


def pool_reason(pool: FusedPool) -> str | None:
    """Why the fused decode does not take this KV pool (None: it does)."""
    if pool.dtype in POOL_KINDS:
        return None
    name = str(pool.dtype).removeprefix("torch.")
    return f"the fused CPU decode does not store a {name} KV pool (its decode takes the " \
        "ordinary, slower forward)"
