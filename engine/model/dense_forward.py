"""The model over one whole sequence with dense torch attention instead of the paged pool:
each layer's query and key after RoPE, as engine.kv_cache.calibration records them.

It runs the model's own layer step (PagedLlama.run_layer), so the keys are the ones the
forward writes into the pool, whatever the family (q/k norms, sandwich norms, local rope);
only the attention is this module's: causal, with the layer's window and the family's
soft-cap, in float32.
"""
from __future__ import annotations

import torch

from kvscope.engine.model.paged_decoder import PagedLlama


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, heads, d], k and v [T, kv_heads, d] of one sequence at positions 0..T-1 ->
    [T, heads, d]: a query at p sees keys p - window < j <= p (all j <= p without a window)."""
    t, heads, _ = q.shape
    groups = heads // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    keep = j <= i
    if window:
        keep &= j > i - window
    scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vf)
    return out.to(q.dtype)


@torch.inference_mode()
def queries_and_keys(model: PagedLlama, token_ids: list[int]
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (q [T, heads, d], k [T, kv_heads, d]) after RoPE, float32."""
    ids = torch.tensor(token_ids, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    rope, local = model.rope_rows(positions)
    h = model.embed_tokens(ids)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in model.layers:
        window, softcap = layer.window, model.family.attn_softcap

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   window: int = window, softcap: float = softcap) -> torch.Tensor:
            out.append((q.float(), k.float()))
            return dense_attention(q, k, v, model.scale, window, softcap)

        cos, sin = local if layer.local_rope else rope
        h = model.run_layer(layer, h, cos, sin, attend)
    return out
