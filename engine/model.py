"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Weights come straight from a Hugging Face state dict. Q/K/V and gate/up are fused into one
matmul each, RoPE turns q and k in one go, and the norms are one op each, because decoding one
token on a CPU costs as much in per-op overhead as in FLOPs. The matmul weights are dense or
weight-only int4/int8 (engine.weight_formats).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from kvscope.engine import fused_decode
from kvscope.engine.lm_head import RescoredHead
from kvscope.engine.weight_formats import Linear, int4_supports, make_linear
from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import AttentionMetadata
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.ops import paged_attention, write_kv

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

# One layer of the KV pool: (k_cache, v_cache, k_scale, v_scale, k_balance, anchors).
LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                KBalanceLayer | None, Anchors | None]


class PagedPool(fused_decode.FusedPool, Protocol):
    """The KV pool as the forward reads it (engine.kv_cache.KVPool, whose module imports this
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


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


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


def rope_tables(hf_config: PretrainedConfig, num_positions: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed by transformers' own rotary module so every
    rope_scaling variant (linear, dynamic, llama3, yarn...) matches the reference exactly."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # Typed for a LlamaConfig, but it reads only the RoPE fields every Llama-family config has.
    rotary = LlamaRotaryEmbedding(config=hf_config)  # type: ignore[arg-type]
    positions = torch.arange(num_positions)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, positions)
    return cos[0].to(dtype), sin[0].to(dtype)


def make_head(head: torch.Tensor | None, embed: torch.Tensor, weights: str
              ) -> Linear | RescoredHead:
    """The LM head. Tied to the embedding (SmolLM: `head` is None) under int4 weights: int4
    logits rescored from the embedding's dense rows (engine.lm_head), which the lookup keeps
    anyway. An untied head in int4 is int8 instead (more exact than int4, and a dense copy
    for rescoring would cost more bytes than it saves time)."""
    if head is None and weights == "int4" and int4_supports(embed):
        return RescoredHead(embed)
    return make_linear(embed if head is None else head, None,
                       "int8" if weights == "int4" else weights)


def fused_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The bias of projections fused into one matmul: theirs end to end, None if none has one."""
    present = [b for b in biases if b is not None]
    if not present:
        return None
    if len(present) < len(biases):
        raise ValueError("only some of the projections fused into one matmul have a bias")
    return torch.cat(present).contiguous()


class PagedLlama:
    def __init__(self, hf_config: PretrainedConfig, state_dict: dict[str, torch.Tensor],
                 device: str, dtype: torch.dtype, max_model_len: int, weights: str = "dense"
                 ) -> None:
        if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {hf_config.model_type!r} is not supported: "
                             f"expected one of {SUPPORTED_ARCHITECTURES}")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.device, self.dtype, self.weights = device, dtype, weights
        self.scale: float = self.shape.head_dim ** -0.5
        sd = {k.removeprefix("model."): v.to(device=device, dtype=dtype)
              for k, v in state_dict.items() if v.is_floating_point()}
        self.embed = sd["embed_tokens.weight"]
        self.lm_head = make_head(sd.get("lm_head.weight"), self.embed, weights)
        self.final_norm = sd["norm.weight"]
        self.layers = [self._layer(sd, i, weights) for i in range(self.shape.num_layers)]
        cos, sin = rope_tables(hf_config, max_model_len, dtype)
        half = self.shape.head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.cos, self.sin = cos.to(device), signed_sin.to(device)
        # Decode steps on the CPU (float32 int4, float32 or bfloat16 dense) fuse the glue
        # between matmuls.
        self.fused_rows = fused_decode.matmul_rows(self)  # the matmul rows' dtype, or None
        self.fused_decode = self.fused_rows is not None
        self.fused_tables = fused_decode.float32_tables(self) if self.fused_decode else None

    @staticmethod
    def _layer(sd: dict[str, torch.Tensor], i: int, weights: str) -> LayerWeights:
        p = f"layers.{i}."
        qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        bias = [sd.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        return LayerWeights(
            input_norm=sd[p + "input_layernorm.weight"],
            qkv=make_linear(torch.cat(qkv).contiguous(), fused_bias(bias), weights),
            o_proj=make_linear(sd[p + "self_attn.o_proj.weight"], None, weights),
            post_norm=sd[p + "post_attention_layernorm.weight"],
            gate_up=make_linear(torch.cat([sd[p + "mlp.gate_proj.weight"],
                                           sd[p + "mlp.up_proj.weight"]]).contiguous(),
                                None, weights),
            down=make_linear(sd[p + "mlp.down_proj.weight"], None, weights),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the model keeps (weights in their stored form, norms, rope tables)."""
        out = [self.embed, *self.lm_head.tensors(), self.final_norm, self.cos, self.sin]
        for layer in self.layers:
            out += [layer.input_norm, layer.post_norm]
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                out += linear.tensors()
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool: PagedPool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch, after the final norm."""
        eps = self.shape.rms_norm_eps
        if self.fused_decode and fused_decode.supports_step(meta, pool):
            h = fused_decode.run_layers(self, input_ids, positions, meta, pool)
            return rms_norm(h.to(self.dtype), self.final_norm, eps)
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer, rms_norm(h, layer.input_norm, eps),
                                    cos, sin, meta, pool.layer(i))
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, eps))
        return rms_norm(h, self.final_norm, eps)

    def _attention(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, meta: AttentionMetadata, kv: LayerKV) -> torch.Tensor:
        s = self.shape
        qkv = layer.qkv(x)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        # q and k turn together: one RoPE over their heads side by side.
        qk = apply_rope(qkv[:, :q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads,
                                                        s.head_dim), cos, sin)
        q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
        v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        k_cache, v_cache, k_scale, v_scale, k_balance, anchors = kv
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, meta.rotation,
                 k_balance, anchors, meta.anchor_fill)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
                            meta.rotation, k_balance, anchors)
        return layer.o_proj(o.reshape(-1, q_size))

    @staticmethod
    def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(x)
        half = gate_up.shape[-1] // 2
        return layer.down(F.silu(gate_up[:, :half]) * gate_up[:, half:])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
