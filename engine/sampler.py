"""Picks the next token of each sequence: greedy, or temperature with top-k / top-p, after the
request's repetition and presence penalties."""
from __future__ import annotations

import torch

from kvscope.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [S, vocab] float32, one row per sequence in seqs."""
    tokens = greedy_tokens(logits)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.penalized:
            row = apply_penalties(logits[i], seq.token_ids, seq.output_token_ids,
                                  p.repetition_penalty, p.presence_penalty)
            tokens[i] = int(row.argmax()) if p.greedy else sample_row(row, seq)
        elif not p.greedy:
            tokens[i] = sample_row(logits[i], seq)
    return tokens


def apply_penalties(row: torch.Tensor, token_ids: list[int], output_ids: list[int],
                    repetition: float, presence: float) -> torch.Tensor:
    """A penalised copy of one row [vocab]. repetition as Hugging Face's
    RepetitionPenaltyLogitsProcessor (over prompt and output: positive logits divided, negative
    multiplied); presence as OpenAI's (minus presence once per distinct output token)."""
    row = row.clone()
    if repetition != 1.0 and token_ids:
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        seen = row[ids]
        row[ids] = torch.where(seen < 0, seen * repetition, seen / repetition)
    if presence != 0.0 and output_ids:
        ids = torch.tensor(sorted(set(output_ids)), dtype=torch.long)
        row[ids] -= presence
    return row


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of every row (the first index on ties, like torch.argmax). On CPU through
    numpy: torch's CPU argmax over the last dim measured ~7x slower at 64 x 49152 and ~10x
    at a tiny vocabulary, which made it a large part of a step's host time."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        tokens: list[int] = logits.detach().numpy().argmax(axis=-1).tolist()
        return tokens
    return logits.argmax(dim=-1).tolist()


def sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0:
        logits = keep_top_k(logits, p.top_k)
    if p.top_p < 1.0:
        logits = keep_top_p(logits, p.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest set of tokens whose probability reaches top_p (the top token always stays)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
