"""A decoder (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma2/3, Phi-3, SmolLM) over the
paged KV cache.

The families differ by a few switches (engine.model.family: q/k norms, sandwich norms, GELU,
soft-capping, sliding windows, partial rotary), checked before anything loads
(engine.model.support). Weights come straight from a Hugging Face state dict
(engine.model.layer_weights). Q/K/V and gate/up are fused into one
matmul each, RoPE turns q and k in one go, and the norms are one op each, because decoding one
token on a CPU costs as much in per-op overhead as in FLOPs. The matmul weights are dense or
weight-only int4/int8 (engine.model.weight_formats). A mixture-of-experts layer routes each
token to its top-k experts and runs them grouped by expert (engine.model.moe); the fused CPU
decode has no experts, so such a model takes this ordinary forward (its reason is said).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from kvscope.engine.model.family import SUPPORTED_FAMILIES, FamilySpec, family_spec
from kvscope.engine.model.fused import decode as fused_decode
from kvscope.engine.model.fused import model_view as fused_model
from kvscope.engine.model.layer_weights import LayerWeights, fused_bias, load_weights
from kvscope.engine.model.moe import ExpertLoad, moe_mlp, moe_spec
from kvscope.engine.model.rescored_head import RescoredHead
from kvscope.engine.model.rope import rope_tables, signed_sin
from kvscope.engine.model.step_interrupt import StepInterrupt
from kvscope.engine.model.support import check_supported
from kvscope.engine.model.weight_formats import Linear, int4_supports, make_linear
from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import AttentionMetadata
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.ops import paged_attention, write_kv

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = SUPPORTED_FAMILIES
__all__ = ["LayerWeights", "PagedLlama", "fused_bias", "rope_tables"]

# One layer of the KV pool: (k_cache, v_cache, k_scale, v_scale, k_balance, anchors).
LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                KBalanceLayer | None, Anchors | None]


# (cos, sin) rows of a step's positions; an attention over (q, k, v) of a layer.
RopeRows = tuple[torch.Tensor, torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PagedPool(fused_model.FusedPool, Protocol):
    """The KV pool as the forward reads it (engine.kv_cache.pool.KVPool, whose module imports this
    one)."""

    def layer(self, i: int) -> LayerKV: ...


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: PretrainedConfig) -> ModelShape:
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face computes it (in float32, then back, then the weight), so greedy
    outputs match. On a CPU spelled out op for op: F.rms_norm decomposes there into more ops
    than these six and measured 3-4x slower at one row. On a GPU F.rms_norm is one fused
    kernel with the same bits."""
    if x.is_cuda:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as Hugging Face computes it: rolling by half a head and
    a sin whose first half is negated gives rotate_half(x) * sin exactly, in one op fewer.
    (A signed permutation matmul is exact too, but a bfloat16 matmul is slow on a CPU without
    bfloat16 units.)"""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def make_head(head: torch.Tensor | None, embed: torch.Tensor, weights: str
              ) -> Linear | RescoredHead:
    """The LM head. Tied to the embedding (SmolLM: `head` is None) under int4 weights: int4 logits
    rescored from the embedding's dense rows (engine.model.rescored_head), which the lookup keeps
    anyway. An untied head in int4 is int8 instead (more exact than int4, and a dense copy for
    rescoring would cost more bytes than it saves time)."""
    if head is None and weights == "int4" and int4_supports(embed):
        return RescoredHead(embed)
    return make_linear(embed if head is None else head, None,
                       "int8" if weights == "int4" else weights)



def windows_within(family: FamilySpec, max_model_len: int) -> FamilySpec:
    """The family with every window that never bites at this max_model_len (W >= it: a query
    sees every earlier key anyway) set to 0, so such a model runs as a global one."""
    windows = tuple(0 if w >= max_model_len else w for w in family.layer_windows)
    return replace(family, layer_windows=windows)


def query_scale(hf_config: PretrainedConfig, head_dim: int) -> float:
    """Gemma scales q.k by query_pre_attn_scalar ** -0.5, the others by head_dim ** -0.5."""
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    if hf_config.model_type in ("gemma2", "gemma3_text") and scalar:
        return float(scalar ** -0.5)
    return float(head_dim ** -0.5)


def local_layers(hf_config: PretrainedConfig) -> list[bool]:
    """Per layer, whether it takes gemma3's local rope (its sliding layers)."""
    n = hf_config.num_hidden_layers
    if hf_config.model_type != "gemma3_text":
        return [False] * n
    return [t == "sliding_attention" for t in hf_config.layer_types[:n]]


class PagedLlama:
    """Any supported family's decoder (the name is the first family's)."""

    def __init__(self, hf_config: PretrainedConfig, state_dict: dict[str, torch.Tensor],
                 device: str, dtype: torch.dtype, max_model_len: int, weights: str = "dense"
                 ) -> None:
        check_supported(hf_config, max_model_len)
        self.shape = s = ModelShape.from_hf_config(hf_config)
        self.family = windows_within(family_spec(hf_config), max_model_len)
        self.device, self.dtype, self.weights = device, dtype, weights
        self.scale: float = query_scale(hf_config, s.head_dim)
        # RoPE first: a config it cannot serve fails before any weight is converted.
        cos, sin = rope_tables(hf_config, max_model_len, dtype)
        self.cos, self.sin = cos.to(device), signed_sin(sin).to(device)
        self.rotary_dim = self.cos.shape[-1]  # < head_dim under a partial_rotary_factor
        locals_ = local_layers(hf_config)
        self.local_cos: torch.Tensor | None = None
        self.local_sin: torch.Tensor | None = None
        if any(locals_):
            cos, sin = rope_tables(hf_config, max_model_len, dtype, "sliding_attention")
            self.local_cos, self.local_sin = cos.to(device), signed_sin(sin).to(device)
        self.moe = moe_spec(hf_config)
        loaded = load_weights(self.family, state_dict, (s.num_heads + 2 * s.num_kv_heads)
                              * s.head_dim, locals_, device, dtype, weights, self.moe)
        # Tokens routed to each expert, per step and since load (the step frame, /metrics).
        self.expert_load = (None if self.moe is None else
                            ExpertLoad(self.moe.num_experts, device))
        self.embed = loaded.embed
        # Hugging Face multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = (None if self.family.embed_scale == 1.0 else
                            torch.tensor(self.family.embed_scale, dtype=dtype, device=device))
        self.lm_head = make_head(loaded.head, self.embed, weights)
        self.final_norm = loaded.final_norm
        self.layers = loaded.layers
        # Decode steps on the CPU (float32 int4, float32 or bfloat16 dense) fuse the glue
        # between matmuls, for the families the fused step covers.
        self.fused_reason = fused_model.unsupported_reason(self)
        # Off the fused step for its weights too (a bias, int8, float16): said, never silent.
        self.fused_rows, self.matmul_reason = (None, None) if self.fused_reason else \
            fused_model.matmul_plan(self.as_fused())
        self.fused_decode = self.fused_rows is not None
        self.interrupt: StepInterrupt | None = None  # set by the engine (priority policy)
        self.fused_tables = (fused_model.float32_tables(self.as_fused()) if self.fused_decode
                             else None)

    def as_fused(self) -> fused_model.FusedModel:
        """This model as the fused CPU step reads it: every layer with its dense MLP. Asked
        only where fused_reason is None, which a mixture of experts never is (its family is
        not one the fused step covers)."""
        if self.moe is not None:  # some layer has experts, not a dense MLP
            raise TypeError("the fused CPU decode was asked to run a layer without a dense MLP")
        return cast("fused_model.FusedModel", self)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the model keeps (weights in their stored form, norms, rope tables)."""
        out = [self.embed, *self.lm_head.tensors(), self.final_norm, self.cos, self.sin]
        out += [t for t in (self.local_cos, self.local_sin) if t is not None]
        for layer in self.layers:
            out += layer.norms()
            for linear in layer.linears():
                out += linear.tensors()
        return out

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        return h if self.embed_scale is None else h * self.embed_scale

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: PagedPool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch, after the final norm."""
        eps = self.shape.rms_norm_eps
        if self.expert_load is not None:
            self.expert_load.begin_step()
        if self.fused_decode and fused_model.supports_step(meta, pool):
            h = fused_decode.run_layers(self.as_fused(), input_ids, positions, meta, pool)
            return rms_norm(h.to(self.dtype), self.final_norm, eps)
        h = self.embed_tokens(input_ids)
        rope, local = self.rope_rows(positions)
        interrupt = self.interrupt
        for i, layer in enumerate(self.layers):
            if interrupt is not None:
                interrupt.check()  # engine.model.step_interrupt: an urgent request arrived
            cos, sin = local if layer.local_rope else rope
            h = self.run_layer(layer, h, cos, sin, partial(self._paged_attention, layer, meta,
                                                           pool.layer(i)))
        return rms_norm(h, self.final_norm, eps)

    def rope_rows(self, positions: torch.Tensor) -> tuple[RopeRows, RopeRows]:
        """(cos, sin) rows [T, 1, rotary_dim] of the positions, global and local (gemma3's
        sliding layers; the global ones again for the other families)."""
        rope = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        if self.local_cos is None or self.local_sin is None:
            return rope, rope
        return rope, (self.local_cos[positions][:, None, :], self.local_sin[positions][:, None, :])

    def run_layer(self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The residual stream after one layer; `attend(q, k, v)` is its attention (the paged
        pool's in the forward, a dense one in engine.model.dense_forward)."""
        eps = self.shape.rms_norm_eps
        q, k, v = self.project_qkv(layer, rms_norm(h, layer.input_norm, eps), cos, sin)
        a = layer.o_proj(attend(q, k, v).reshape(q.shape[0], -1))
        h = h + (a if layer.attn_out_norm is None else rms_norm(a, layer.attn_out_norm, eps))
        m = self._mlp(layer, rms_norm(h, layer.post_norm, eps))
        return h + (m if layer.mlp_out_norm is None else rms_norm(m, layer.mlp_out_norm, eps))

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over the heads [T, heads, head_dim]; only the first rotary_dim channels turn
        under a partial rotary factor (Phi-3), as Hugging Face does."""
        r = self.rotary_dim
        if r == qk.shape[-1]:
            return apply_rope(qk, cos, sin)
        return torch.cat((apply_rope(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)

    def project_qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d]: after the q/k norms and RoPE."""
        s = self.shape
        qkv = layer.qkv(x)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qk = qkv[:, :q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            eps = s.rms_norm_eps
            qk = torch.cat((rms_norm(qk[:, :s.num_heads], layer.q_norm, eps),
                            rms_norm(qk[:, s.num_heads:], layer.k_norm, eps)), dim=1)
        # q and k turn together: one RoPE over their heads side by side.
        qk = self.rotate(qk, cos, sin)
        v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        return qk[:, :s.num_heads], qk[:, s.num_heads:], v

    def _paged_attention(self, layer: LayerWeights, meta: AttentionMetadata, kv: LayerKV,
                         q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, k_scale, v_scale, k_balance, anchors = kv
        # Under a soft-cap the K balance has no shift (engine.kv_cache.calibration): a shift moves a
        # query's scores by one constant, which a tanh cap does not ignore.
        softcap = self.family.attn_softcap
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, meta.rotation,
                 k_balance, anchors, meta.anchor_fill)
        return paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
                               meta.rotation, k_balance, anchors, window=layer.window,
                               softcap=softcap)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if layer.experts is not None and self.moe is not None:
            return moe_mlp(x, layer.experts, self.moe, self.family.activation,
                           self.expert_load)
        if layer.gate_up is None or layer.down is None:
            raise ValueError("a layer has neither a dense MLP nor experts")
        gate_up = layer.gate_up(x)
        half = gate_up.shape[-1] // 2
        gate = gate_up[:, :half]
        act = (F.gelu(gate, approximate="tanh") if self.family.activation == "gelu_tanh"
               else F.silu(gate))
        return layer.down(act * gate_up[:, half:])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.family.final_softcap
        return logits if not cap else cap * torch.tanh(logits / cap)
