"""Hugging Face's own answer, the reference the engine's outputs are compared against."""
from __future__ import annotations

from typing import Any

import torch


def hf_greedy(hf: Any, prompt: list[int], n: int, device: str = "cpu") -> list[int]:
    """The n tokens HF `generate` picks greedily after `prompt` (hf on `device`)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        # An explicit mask: otherwise generate treats any token equal to pad_token_id as padding.
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())
