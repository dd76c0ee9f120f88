"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): the router, its top-k, and a step's experts
computed grouped by expert.

Each token's router scores every expert; the token goes through the top_k gated MLPs and takes
their outputs' sum weighted by its routing weights. The routing is Hugging Face's, op for op:
softmax over all experts in float32, top-k of those probabilities (ties and order as
torch.topk gives them), then the k weights renormalised to sum to 1 (Mixtral always,
Qwen3-MoE when norm_topk_prob). Qwen3-MoE casts the weights back to the model's dtype before
weighting; Mixtral keeps them in float32, so its weighted outputs are float32 until the sum
is rounded to the residual's dtype (in a float32 model the two are one).

A step's (token, expert) pairs are sorted by expert and every expert with tokens runs once
over all of them (its gate|up and down matmuls), never token by token: a decode step of 16
sequences at top-2 runs at most num_experts matmul pairs per layer, not 32. The weighted rows
go back to token order and each token's k rows are summed in rank order, as Hugging Face's
default experts implementation (grouped_mm) sums them.
The router stays dense; the experts take the model's weight format (dense, int4 or int8).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvscope.engine.model.weight_formats import Linear
from kvscope.kvmath.model_support import MOE_FAMILIES, num_experts, sparse_layers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["MOE_FAMILIES", "ExpertLoad", "Experts", "MoeSpec", "moe_mlp", "moe_spec", "route"]


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    normalize: bool         # the top-k weights renormalised to sum to 1
    float32_weights: bool   # routing weights kept in float32 (Mixtral), else the model's dtype
    sparse_layers: tuple[bool, ...]  # per layer: experts, or (False) the dense MLP


def moe_spec(hf_config: PretrainedConfig) -> MoeSpec | None:
    """The mixture-of-experts setup of a Mixtral or Qwen3-MoE config (None: a dense family,
    or a Qwen3-MoE whose every layer is dense)."""
    model_type = hf_config.model_type
    if model_type not in MOE_FAMILIES:
        return None
    layers = sparse_layers(hf_config)
    if not any(layers):
        return None
    mixtral = model_type == "mixtral"
    return MoeSpec(
        num_experts=num_experts(hf_config),
        top_k=int(hf_config.num_experts_per_tok),
        normalize=True if mixtral else bool(getattr(hf_config, "norm_topk_prob", False)),
        float32_weights=mixtral,
        sparse_layers=layers,
    )


@dataclass
class Experts:
    """One mixture-of-experts layer: the dense router [num_experts, hidden] and, per expert,
    its gate|up [2 x intermediate, hidden] and down [hidden, intermediate] matmuls."""
    router: Linear
    gate_up: list[Linear]
    down: list[Linear]

    def linears(self) -> list[Linear]:
        return [self.router, *self.gate_up, *self.down]


def route(x: torch.Tensor, router: Linear, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k], experts [T, top_k]) of the rows x [T, hidden], as the family's
    Hugging Face router gives them."""
    logits = router(x)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if spec.float32_weights else weights.to(logits.dtype)), experts


class ExpertLoad:
    """Tokens routed to each expert, summed over the model's MoE layers (a token counts once
    per MoE layer): in the latest forward, which is one engine step, and since the model
    loaded. Kept as tensors, one add per layer; read as lists between steps."""

    def __init__(self, num_experts: int, device: str) -> None:
        self.step = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.before = torch.zeros_like(self.step)

    def begin_step(self) -> None:
        self.before += self.step
        self.step.zero_()

    def add(self, counts: torch.Tensor) -> None:
        self.step += counts

    def last_step(self) -> list[int]:
        return [int(v) for v in self.step.tolist()]

    def totals(self) -> list[int]:
        return [int(v) for v in (self.before + self.step).tolist()]


def activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a gate|up row block."""
    half = gate_up.shape[-1] // 2
    gate = gate_up[:, :half]
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return act * gate_up[:, half:]


def moe_mlp(x: torch.Tensor, experts: Experts, spec: MoeSpec, activation: str,
            load: ExpertLoad | None = None) -> torch.Tensor:
    """The layer's MLP output [T, hidden] for the rows x [T, hidden]."""
    weights, chosen = route(x, experts.router, spec)
    flat = chosen.reshape(-1)
    # Stable: within an expert its tokens stay in row order.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.num_experts)
    if load is not None:
        load.add(counts)
    tokens = order // spec.top_k
    rows = x[tokens]
    outs: list[torch.Tensor] = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not n:
            continue
        part = rows[start:start + n]
        outs.append(experts.down[e](activate(experts.gate_up[e](part), activation)))
        start += n
    y = torch.cat(outs) if len(outs) > 1 else outs[0]
    weighted = y * weights.reshape(-1)[order, None]
    # Back to (token, rank) order and summed over the k ranks, as Hugging Face's default
    # (grouped_mm) experts do; index_copy_ with a permutation moves each row once (CPU
    # index_add_ measured 20 ms for 32 rows of 512).
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return unsorted.view(x.shape[0], spec.top_k, -1).sum(dim=1).to(x.dtype)
