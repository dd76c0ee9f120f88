"""The exact K shift and q/k channel balance that let int8 keys keep the answers.

Measured on the embedded model (tests' diagnosis, docs/kv-dtypes.md): after the Hadamard
rotation, int8 error in K costs about five times what int8 error in V does, for two reasons a
per-token scale cannot see:
* keys carry a large constant offset per channel (after RoPE the slow channels hardly turn),
  so a key's range, and its quantization step, is mostly spent on a vector every key shares;
* a few channels carry most of the query's energy, and an error in those channels moves the
  scores most, while the rotation spreads the error evenly over every channel.

Both are fixed by exact transforms, calibrated once per model (engine/kv_cache/calibration.py):
* shift: k - c, with c a constant vector per (layer, KV head). Every score of a query moves
  by the same q.c, so softmax, and the output, are unchanged;
* balance: k * g and q / g with a positive vector g per (layer, KV head, channel); the
  products q_j k_j are unchanged. g_j = sqrt(rms(q_j) / rms(k_j - c_j)) (normalised to a
  geometric mean of 1) minimises the score error of a quantizer whose error is even across
  channels (Cauchy-Schwarz; a full matrix measured no better than this diagonal).

So the pool holds ((k - c) * g) @ R and the query is attended as (q / g) @ R; V is only
rotated. The bytes per token do not change: c and g are per model, not per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KBalanceLayer:
    """One layer's transform: shift c and gain g [kv_heads, head_dim] float32, and 1 / g
    (what the query is multiplied by, computed once so every path multiplies the same bits)."""
    shift: torch.Tensor
    gain: torch.Tensor
    q_gain: torch.Tensor

    @classmethod
    def of(cls, shift: torch.Tensor, gain: torch.Tensor) -> KBalanceLayer:
        shift, gain = shift.float().contiguous(), gain.float().contiguous()
        if shift.shape != gain.shape or shift.dim() != 2:
            raise ValueError(f"K shift {tuple(shift.shape)} and gain {tuple(gain.shape)} must "
                             "both be [kv_heads, head_dim]")
        if not bool((gain > 0).all()) or not bool(torch.isfinite(gain).all()):
            raise ValueError("K balance gains must be positive and finite")
        return cls(shift, gain, (1.0 / gain).contiguous())

    def to(self, device: torch.device | str) -> KBalanceLayer:
        return KBalanceLayer(*(t.to(device) for t in (self.shift, self.gain, self.q_gain)))


def balance_k(key: torch.Tensor, kb: KBalanceLayer | None) -> torch.Tensor:
    """key [T, kv_heads, head_dim] -> (key - c) * g in float32; key itself if kb is None."""
    if kb is None:
        return key
    return (key.float() - kb.shift) * kb.gain


def balance_q(query: torch.Tensor, kb: KBalanceLayer | None) -> torch.Tensor:
    """query [T, heads, head_dim] -> query / g of its KV head, in float32 (GQA: the heads of a
    group share their KV head's g); query itself if kb is None."""
    if kb is None:
        return query
    kv_heads = kb.q_gain.shape[0]
    group = query.shape[1] // kv_heads
    return query.float() * kb.q_gain.repeat_interleave(group, dim=0)
