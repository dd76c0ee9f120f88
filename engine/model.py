"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Weights come straight from a Hugging Face state dict. Q/K/V and gate/up are fused into one
matmul each because on a CPU every extra small GEMM costs as much in overhead as in FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_ref import AttentionMetadata
from kernels.ops import paged_attention, write_kv

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


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
    def from_hf_config(cls, cfg) -> ModelShape:
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
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face computes it (in float32, then back), so greedy outputs match."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(hf_config, num_positions: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed by transformers' own rotary module so every
    rope_scaling variant (linear, dynamic, llama3, yarn...) matches the reference exactly."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=hf_config)
    positions = torch.arange(num_positions)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, positions)
    return cos[0].to(dtype), sin[0].to(dtype)


class PagedLlama:
    def __init__(self, hf_config, state_dict: dict[str, torch.Tensor], device: str,
                 dtype: torch.dtype, max_model_len: int) -> None:
        if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {hf_config.model_type!r} is not supported: "
                             f"expected one of {SUPPORTED_ARCHITECTURES}")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.device, self.dtype = device, dtype
        self.scale = self.shape.head_dim ** -0.5
        sd = {k.removeprefix("model."): v.to(device=device, dtype=dtype)
              for k, v in state_dict.items() if v.is_floating_point()}
        self.embed = sd["embed_tokens.weight"]
        self.lm_head = sd.get("lm_head.weight", self.embed)  # tied embeddings (SmolLM)
        self.final_norm = sd["norm.weight"]
        self.layers = [self._layer(sd, i) for i in range(self.shape.num_layers)]
        cos, sin = rope_tables(hf_config, max_model_len, dtype)
        self.cos, self.sin = cos.to(device), sin.to(device)

    @staticmethod
    def _layer(sd: dict, i: int) -> LayerWeights:
        p = f"layers.{i}."
        qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        bias = [sd.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        return LayerWeights(
            input_norm=sd[p + "input_layernorm.weight"],
            qkv=torch.cat(qkv).contiguous(),
            qkv_bias=torch.cat(bias).contiguous() if bias[0] is not None else None,
            o_proj=sd[p + "self_attn.o_proj.weight"],
            post_norm=sd[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([sd[p + "mlp.gate_proj.weight"],
                               sd[p + "mlp.up_proj.weight"]]).contiguous(),
            down=sd[p + "mlp.down_proj.weight"],
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch, after the final norm."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(layer, rms_norm(h, layer.input_norm, self.shape.rms_norm_eps),
                                    cos, sin, meta, pool.layer(i))
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, self.shape.rms_norm_eps))
        return rms_norm(h, self.final_norm, self.shape.rms_norm_eps)

    def _attention(self, layer, x, cos, sin, meta, kv) -> torch.Tensor:
        s = self.shape
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        c, sn = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * sn
        k = k * c + rotate_half(k) * sn
        k_cache, v_cache, k_scale, v_scale = kv
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, meta.rotation)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
                            meta.rotation)
        return F.linear(o.reshape(-1, q_size), layer.o_proj)

    @staticmethod
    def _mlp(layer, x) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
