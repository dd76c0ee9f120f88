"""Calibrate the exact K shift and q/k balance (kernels/k_balance.py) once per loaded model.

One forward pass over a fixed calibration text (below: prose, code, Q&A, history; never an
evaluation prompt) in float32 with dense causal attention, recording every layer's query and
key after RoPE. Per (layer, KV head): c = the mean key; g = sqrt(rms(q) / rms(k - c)) per
channel, over the group's query heads, normalised to a geometric mean of 1. Both are exact
transforms whatever their values, so the calibration text only decides how much they help.

The forward is the model's own layer step over dense attention (engine.model.dense_forward);
tests/engine/kv_cache/test_k_balance.py checks its keys against the ones the model writes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvscope.engine.chat_template import chat_prompt_ids
from kvscope.engine.model import dense_forward as model_dense
from kvscope.engine.model.paged_decoder import PagedLlama
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


def queries_and_keys(model: PagedLlama, token_ids: list[int]
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (q [T, heads, d], k [T, kv_heads, d]) after RoPE, float32: the model's own
    layer step over dense attention (engine.model.dense_forward), whatever its family."""
    return model_dense.queries_and_keys(model, token_ids)


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
    layers = [k_balance_from(q, k).to(model.device) for q, k in queries_and_keys(model, ids)]
    if model.family.attn_softcap:
        # A K shift moves a query's scores by one constant: softmax ignores it, a tanh cap
        # (gemma2) does not. The gains alone stay exact.
        layers = [KBalanceLayer.of(torch.zeros_like(b.shift), b.gain) for b in layers]
    return layers
