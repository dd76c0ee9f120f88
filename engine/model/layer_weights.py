"""A Hugging Face state dict, per family, into the engine's layer weights.

Checkpoints name and pack the same matrices differently: Phi-3 ships q/k/v as one qkv_proj and
gate/up as one gate_up_proj (already the engine's fused layout, so they are kept as they are),
the others as separate projections (concatenated here). A mixture-of-experts layer (Qwen3-MoE,
Mixtral) holds a router and experts instead of the dense MLP (engine.model.moe_weights reads
them in any of their layouts). Gemma's RMSNorm scales by (1 + w);
its weights are stored with the 1 added (in float32), so every norm of the forward is the plain
w * x / rms(x). Every floating tensor of the checkpoint must be used: one left over means the
checkpoint has a part the engine does not compute, and it fails rather than run without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.model.family import GEMMA_FAMILIES, FamilySpec
from kvscope.engine.model.moe import Experts, MoeSpec
from kvscope.engine.model.moe_weights import load_experts
from kvscope.engine.model.weight_formats import Linear, make_linear

# Buffers some checkpoints save that carry no weights (the rope tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor            # the norm before the MLP
    gate_up: Linear | None             # the dense MLP; None in a mixture-of-experts layer
    down: Linear | None
    q_norm: torch.Tensor | None = None         # [head_dim], qwen3 / gemma3
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # gemma's post_attention_layernorm
    mlp_out_norm: torch.Tensor | None = None   # gemma's post_feedforward_layernorm
    window: int = 0                            # 0 = global attention
    local_rope: bool = False                   # gemma3 sliding layers: rope_local_base_freq
    experts: Experts | None = None             # a mixture-of-experts layer's router and experts

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.post_norm, self.q_norm, self.k_norm,
                            self.attn_out_norm, self.mlp_out_norm) if t is not None]

    def linears(self) -> list[Linear]:
        dense = [x for x in (self.qkv, self.o_proj, self.gate_up, self.down) if x is not None]
        return dense + (self.experts.linears() if self.experts is not None else [])


@dataclass
class ModelWeights:
    embed: torch.Tensor
    head: torch.Tensor | None  # None: tied to the embedding
    final_norm: torch.Tensor
    layers: list[LayerWeights]


def fused_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The bias of projections fused into one matmul: theirs end to end, None if none has one."""
    present = [b for b in biases if b is not None]
    if not present:
        return None
    if len(present) < len(biases):
        raise ValueError("only some of the projections fused into one matmul have a bias")
    return torch.cat(present).contiguous()


class Checkpoint:
    """The state dict (prefix "model." dropped), remembering which tensors were used."""

    def __init__(self, tensors: dict[str, torch.Tensor], gemma: bool) -> None:
        self.tensors, self.gemma = tensors, gemma
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.tensors:
            return None
        self.used.add(name)
        return self.tensors[name]

    def take(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise ValueError(f"the checkpoint has no tensor {name!r} (model.{name})")
        return tensor

    def norm(self, name: str) -> torch.Tensor:
        w = self.take(name)
        return (1.0 + w.float()).to(w.dtype) if self.gemma else w

    def leftovers(self) -> list[str]:
        return sorted(n for n in self.tensors
                      if n not in self.used and not n.endswith(IGNORED_SUFFIXES))


def _projections(ck: Checkpoint, prefix: str, fused: str, parts: tuple[str, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused matmul's weight and bias: the checkpoint's fused tensor (phi3), or its parts
    end to end."""
    if ck.has(prefix + fused + ".weight"):
        return ck.take(prefix + fused + ".weight"), ck.get(prefix + fused + ".bias")
    weight = torch.cat([ck.take(prefix + p + ".weight") for p in parts]).contiguous()
    return weight, fused_bias([ck.get(prefix + p + ".bias") for p in parts])


def _check_rows(name: str, weight: torch.Tensor, rows: int) -> None:
    if weight.shape[0] != rows:
        raise ValueError(f"{name} has {weight.shape[0]} rows, the config implies {rows}")


def _dense_mlp(ck: Checkpoint, i: int, weights: str) -> tuple[Linear, Linear]:
    mlp = f"layers.{i}.mlp."
    gate_up_w, gate_up_b = _projections(ck, mlp, "gate_up_proj", ("gate_proj", "up_proj"))
    return (make_linear(gate_up_w, gate_up_b, weights),
            make_linear(ck.take(mlp + "down_proj.weight"), ck.get(mlp + "down_proj.bias"),
                        weights))


def load_layer(ck: Checkpoint, family: FamilySpec, i: int, qkv_rows: int, weights: str,
               local_rope: bool, moe: MoeSpec | None = None) -> LayerWeights:
    p, attn = f"layers.{i}.", f"layers.{i}.self_attn."
    qkv_w, qkv_b = _projections(ck, attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    _check_rows(f"layer {i} q/k/v", qkv_w, qkv_rows)
    experts = load_experts(ck, i, moe, weights) if moe and moe.sparse_layers[i] else None
    gate_up, down = (None, None) if experts is not None else _dense_mlp(ck, i, weights)
    sandwich = family.sandwich_norms
    return LayerWeights(
        input_norm=ck.norm(p + "input_layernorm.weight"),
        qkv=make_linear(qkv_w, qkv_b, weights),
        o_proj=make_linear(ck.take(attn + "o_proj.weight"), ck.get(attn + "o_proj.bias"),
                           weights),
        post_norm=ck.norm(p + ("pre_feedforward_layernorm.weight" if sandwich
                               else "post_attention_layernorm.weight")),
        gate_up=gate_up,
        down=down,
        q_norm=ck.norm(attn + "q_norm.weight") if family.qk_norm else None,
        k_norm=ck.norm(attn + "k_norm.weight") if family.qk_norm else None,
        attn_out_norm=ck.norm(p + "post_attention_layernorm.weight") if sandwich else None,
        mlp_out_norm=ck.norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
        window=family.layer_windows[i],
        local_rope=local_rope,
        experts=experts,
    )


def load_weights(family: FamilySpec, state_dict: dict[str, torch.Tensor], qkv_rows: int,
                 local_layers: list[bool], device: str, dtype: torch.dtype, weights: str,
                 moe: MoeSpec | None = None) -> ModelWeights:
    """Every weight of the model on `device` in `dtype`, matmuls in the `weights` format;
    `local_layers`: per layer, whether it takes the local rope tables (gemma3); `moe`: which
    layers are mixtures of experts, and their expert count."""
    tensors = {k.removeprefix("model."): v.to(device=device, dtype=dtype)
               for k, v in state_dict.items() if v.is_floating_point()}
    ck = Checkpoint(tensors, family.model_type in GEMMA_FAMILIES)
    out = ModelWeights(
        embed=ck.take("embed_tokens.weight"),
        head=ck.get("lm_head.weight"),
        final_norm=ck.norm("norm.weight"),
        layers=[load_layer(ck, family, i, qkv_rows, weights, local, moe)
                for i, local in enumerate(local_layers)],
    )
    left = ck.leftovers()
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(f"{family.model_type}: the checkpoint has tensors the engine does not "
                         f"compute ({shown}); refusing to run the model without them")
    return out
