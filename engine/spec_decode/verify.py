"""Verifying drafted tokens against the target model's logits at every drafted position.

Greedy: accept the longest prefix of the draft equal to the row-by-row argmax, then the argmax
after it (the bonus token). Sampled: the standard rejection rule (Leviathan et al. 2023,
Chen et al. 2023) with the draft distribution q a point mass on the drafted token, as an
n-gram draft is: accept draft d with probability min(1, p(d)/q(d)) = p(d); on the first
rejection sample from the residual max(0, p - q) renormalised, which is p with d removed; if
every draft is accepted sample the bonus from the last row. The output is distributed exactly
as the target model's sampling (temperature, top-k, top-p) would be.
"""
from __future__ import annotations

import torch

from kvscope.engine.sampler import greedy_tokens, keep_top_k, keep_top_p
from kvscope.engine.sampling_params import SamplingParams


def accept_greedy(rows: torch.Tensor, draft: list[int]) -> list[int]:
    """rows [k + 1, vocab] float32: the accepted drafts plus the bonus token."""
    target = greedy_tokens(rows)
    out: list[int] = []
    for want, got in zip(target, draft, strict=False):  # k comparisons, k <= 16
        if want != got:
            break
        out.append(got)
    out.append(target[len(out)])
    return out


def row_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's distribution, exactly as engine.sampler.sample_row draws from it. Row by
    row on purpose: torch parallelises small 2-D softmaxes over its threads, which measured
    ~300x slower (6.6 ms against 22 us at [3, 6]) on a loaded 2-core machine."""
    logits = row / p.temperature
    if p.top_k > 0:
        logits = keep_top_k(logits, p.top_k)
    if p.top_p < 1.0:
        logits = keep_top_p(logits, p.top_p)
    return torch.softmax(logits, dim=-1)


def target_probs(rows: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row_probs of every row, stacked (tests)."""
    return torch.stack([row_probs(r, p) for r in rows])


def accept_sampled(rows: torch.Tensor, draft: list[int], params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """rows [k + 1, vocab]: the accepted drafts plus one token from the residual or bonus.
    Each row's distribution is computed only once the drafts before it were accepted."""
    uniforms = torch.rand(len(draft), generator=generator).tolist()
    out: list[int] = []
    for i, (d, u) in enumerate(zip(draft, uniforms, strict=True)):
        probs = row_probs(rows[i], params)
        if u < float(probs[d]):
            out.append(d)
            continue
        probs[d] = 0.0  # the residual max(0, p - q) for a point-mass q; multinomial rescales
        out.append(int(torch.multinomial(probs, 1, generator=generator).item()))
        return out
    last = row_probs(rows[len(draft)], params)
    out.append(int(torch.multinomial(last, 1, generator=generator).item()))
    return out
