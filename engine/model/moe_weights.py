"""A mixture-of-experts layer's router and experts from a checkpoint, in any layout it ships.

Checkpoints store experts three ways: one tensor per expert and projection under the mlp
(Qwen3-MoE: experts.{e}.gate_proj / up_proj / down_proj), the same under block_sparse_moe
with Mixtral's names (experts.{e}.w1 = gate, w3 = up, w2 = down), or stacked as transformers 5
holds them in memory (experts.gate_up_proj [experts, 2 x intermediate, hidden] and
experts.down_proj [experts, hidden, intermediate]; gate rows first). All three become the same
per-expert gate|up and down matmuls (engine.model.moe.Experts), in the model's weight format;
the router (gate.weight) stays dense.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvscope.engine.model.moe import Experts, MoeSpec
from kvscope.engine.model.weight_formats import make_linear

# Per-expert tensor names: (gate, up, down) under each layout.
PER_EXPERT_NAMES = {"mlp.": ("gate_proj", "up_proj", "down_proj"),
                    "block_sparse_moe.": ("w1", "w3", "w2")}


class Tensors(Protocol):
    """The checkpoint as engine.model.layer_weights.Checkpoint reads it."""

    def has(self, name: str) -> bool: ...

    def take(self, name: str) -> torch.Tensor: ...


def _stacked(ck: Tensors, base: str, spec: MoeSpec, i: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, down = ck.take(base + "experts.gate_up_proj"), ck.take(base + "experts.down_proj")
    if gate_up.shape[0] != spec.num_experts or down.shape[0] != spec.num_experts:
        raise ValueError(f"layer {i}: the checkpoint stacks {gate_up.shape[0]} experts, the "
                         f"config says {spec.num_experts}")
    return gate_up, down


def _per_expert(ck: Tensors, p: str, base: str, spec: MoeSpec
                ) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, down = PER_EXPERT_NAMES[base]
    e = f"{p}{base}experts."
    gate_up = torch.stack([torch.cat([ck.take(f"{e}{x}.{gate}.weight"),
                                      ck.take(f"{e}{x}.{up}.weight")])
                           for x in range(spec.num_experts)])
    return gate_up, torch.stack([ck.take(f"{e}{x}.{down}.weight")
                                 for x in range(spec.num_experts)])


def load_experts(ck: Tensors, i: int, spec: MoeSpec, weights: str) -> Experts:
    """Layer i's router and experts; `weights`: the experts' matmul format."""
    p = f"layers.{i}."
    base = next((b for b in PER_EXPERT_NAMES if ck.has(p + b + "gate.weight")), None)
    if base is None:
        raise ValueError(f"the checkpoint has no router for layer {i} (model.{p}mlp.gate.weight "
                         f"or model.{p}block_sparse_moe.gate.weight)")
    router = ck.take(p + base + "gate.weight")
    if router.shape[0] != spec.num_experts:
        raise ValueError(f"layer {i}'s router scores {router.shape[0]} experts, the config "
                         f"says {spec.num_experts}")
    stacked = ck.has(p + base + "experts.gate_up_proj")
    gate_up, down = (_stacked(ck, p + base, spec, i) if stacked
                     else _per_expert(ck, p, base, spec))
    gate_up, down = gate_up.contiguous(), down.contiguous()
    return Experts(router=make_linear(router, None, "dense"),
                   gate_up=[make_linear(w, None, weights) for w in gate_up.unbind(0)],
                   down=[make_linear(w, None, weights) for w in down.unbind(0)])
