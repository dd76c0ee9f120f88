"""Calibrate the exact K shift and q/k balance (kernels/k_balance.py) once per loaded model.

One forward pass over a fixed calibration text (below: prose, code, Q&A, history; never an
evaluation prompt) in float32 with dense causal attention, recording every layer's query and
key after RoPE. Per (layer, KV head): c = the mean key; g = sqrt(rms(q) / rms(k - c)) per
channel, over the group's query heads, normalised to a geometric mean of 1. Both are exact
transforms whatever their values, so the calibration text only decides how much they help.

The forward mirrors PagedLlama.forward without the paged pool (a full causal SDPA over the
one sequence); tests/engine/test_k_balance.py checks its keys against the ones the model writes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvscope.engine.chat_template import chat_prompt_ids
from kvscope.engine.model import PagedLlama, apply_rope, rms_norm
from kvscope.kernels.k_balance import KBalanceLayer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CALIBRATION_TEXT = (
    "The museum opened its new wing on a rainy Tuesday. Visitors queued under umbrellas, "
    "children pressed their faces to the glass, and a string quartet played in the atrium. "
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] "
    "< b[0] else b.pop(0))\n    return out + a + b\n"
    "Q: How many legs does a spider have? A: Eight. Q: And an insect? A: Six. "
    "In 1905 Einstein published four papers that changed physics: on the photoelectric "
    "effect, Brownian motion, special relativity and the equivalence of mass and energy."
)
# Gains are clamped to this range around 1 so that a channel the text barely excites cannot
# get an extreme scale (the transform stays exact, but an extreme gain would spend the
# quantizer's range on calibration noise).
MAX_GAIN = 16.0


def calibration_ids(tokenizer: PreTrainedTokenizerBase, max_len: int) -> list[int]:
    """The calibration text as the model sees a chat turn (plain text if it has no template)."""
    try:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": CALIBRATION_TEXT}])
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template
        ids = list(tokenizer.encode(CALIBRATION_TEXT))
    return ids[:max_len]


@torch.inference_mode()
def queries_and_keys(model: PagedLlama, token_ids: list[int]
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (q [T, heads, d], k [T, kv_heads, d]) after RoPE, float32."""
    s = model.shape
    ids = torch.tensor(token_ids, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    cos, sin = model.cos[positions][:, None, :], model.sin[positions][:, None, :]
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    h = F.embedding(ids, model.embed)
    out = []
    for layer in model.layers:
        qkv = layer.qkv(rms_norm(h, layer.input_norm, s.rms_norm_eps))
        qk = apply_rope(qkv[:, :q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads,
                                                        s.head_dim), cos, sin)
        q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
        v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        out.append((q.float(), k.float()))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True,
                                           scale=model.scale, enable_gqa=True)
        h = h + layer.o_proj(o.transpose(0, 1).reshape(-1, q_size))
        h = h + model._mlp(layer, rms_norm(h, layer.post_norm, s.rms_norm_eps))
    return out


def k_balance_from(q: torch.Tensor, k: torch.Tensor) -> KBalanceLayer:
    """One layer's shift and gains from its calibration queries and keys."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    q, k = q.double(), k.double()
    shift = k.mean(0)
    k_rms = (k - shift).pow(2).mean(0).sqrt()
    q_rms = q.view(tokens, kv_heads, heads // kv_heads, d).pow(2).mean((0, 2)).sqrt()
    # A floor relative to each head's mean, so a dead channel gives a finite ratio.
    k_rms = k_rms.clamp_min(1e-3 * k_rms.mean(-1, keepdim=True) + 1e-12)
    q_rms = q_rms.clamp_min(1e-3 * q_rms.mean(-1, keepdim=True) + 1e-12)
    gain = (q_rms / k_rms).sqrt()
    gain = gain / gain.log().mean(-1, keepdim=True).exp()
    return KBalanceLayer.of(shift, gain.clamp(1 / MAX_GAIN, MAX_GAIN))


def calibrate_k_balance(model: PagedLlama, tokenizer: PreTrainedTokenizerBase, max_len: int
                        ) -> list[KBalanceLayer]:
    """Every layer's K balance for this model, on the model's device."""
    ids = calibration_ids(tokenizer, max_len)
    return [k_balance_from(q, k).to(model.device) for q, k in queries_and_keys(model, ids)]
