"""The LM head of a 4-bit model: 4-bit logits for the whole vocabulary, then each row's top
candidates recomputed exactly from the dense embedding table.

The head is the largest matmul of a small model (SmolLM2: 49152 x 576, a fifth of its
weights), so its format decides much of a CPU decode step. Every logit in 4-bit reads 8x fewer
bytes than float32, but 4-bit logits are off by a few tenths, enough to swap two close
candidates. Greedy decoding only needs the winner right, and sampling draws almost all its
mass from the top few: so the few leading candidates of each row get their logits again as
dense dot products with the float rows of the tied embedding table, which the model keeps
anyway for the token lookup. The winner is then the dense head's unless the true winner
falls outside the int4 head's top RESCORE_TOP, which needs an int4 error larger than the gap
to the 32nd candidate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.engine.model.weight_formats import Int4Linear

RESCORE_TOP = 32


class RescoredHead:
    """int4 logits, with each row's top RESCORE_TOP logits taken from the dense weight."""

    def __init__(self, dense_weight: torch.Tensor) -> None:
        self.dense = dense_weight          # shared with the embedding: no extra bytes
        self.approx = Int4Linear(dense_weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.approx(x).float()
        top = logits.topk(min(RESCORE_TOP, logits.shape[-1]), dim=-1).indices    # [B, K]
        rows = F.embedding(top, self.dense)                                       # [B, K, H]
        exact = torch.bmm(rows, x.to(self.dense.dtype)[:, :, None]).squeeze(-1)
        return logits.scatter_(1, top, exact.float())

    @property
    def shape(self) -> tuple[int, int]:
        return self.approx.shape

    def tensors(self) -> list[torch.Tensor]:
        """What the head adds to the model: the packed codes (the dense table is the
        embedding's, counted there)."""
        return self.approx.tensors()
