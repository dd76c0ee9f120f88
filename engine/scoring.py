"""Teacher-forced scoring through the paged cache: log-probs at every position of a sequence.

Used to measure what a KV dtype costs in accuracy: the sequence is prefilled in one chunk that
writes its K/V into the pool (quantizing if the pool is int8/fp8) and attends over that pool,
so every position sees the storage error, as in serving.
"""
from __future__ import annotations

import torch

from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.scheduler import ScheduledSeq
from kvscope.engine.sequence import Sequence


@torch.inference_mode()
def token_log_probs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """[len-1, vocab] log-softmax of the next-token distribution after each prefix."""
    assert not engine.has_unfinished(), "score on an idle engine"
    seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
    bm, runner = engine.block_manager, engine.runner
    if bm is None or runner is None:  # only until the engine has built its first pool
        raise RuntimeError("the engine has no KV pool")
    if not bm.can_allocate(seq, [], len(token_ids)):
        raise ValueError(f"{len(token_ids)} tokens do not fit in the KV pool")
    bm.allocate(seq, [], len(token_ids))
    try:
        item = ScheduledSeq(seq, len(token_ids))
        input_ids, positions, meta, _ = runner.prepare([item])
        hidden = runner.forward(input_ids, positions, meta)
        logits = engine.model.compute_logits(hidden[:-1])
    finally:
        bm.free(seq)
    return torch.log_softmax(logits.float(), dim=-1)


def mean_kl(ref_log_probs: torch.Tensor, log_probs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate)."""
    p = ref_log_probs.exp()
    return float((p * (ref_log_probs - log_probs)).sum(-1).mean())


def perplexity(log_probs: torch.Tensor, token_ids: list[int]) -> float:
    targets = torch.tensor(token_ids[1:])
    nll = -log_probs[torch.arange(len(targets)), targets]
    return float(nll.mean().exp())
