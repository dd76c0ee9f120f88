"""The start-up self-check: one graphed decode step against the eager step on the same inputs.

Graphs go on by default only behind it (issue 54): a few made-up sequences are prefilled
eagerly into blocks of the fresh pool (nothing has used it yet; the block manager never
handed those blocks out, so nothing reads what is left there), then one decode step runs
eagerly and once more through its bucket's graph, with a padded row when the buckets allow.
The logits must agree within a tolerance of the model's dtype; the caller turns graphs off,
and says why, when they do not.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvscope.engine.cuda_graphs.dispatch import choose_path
from kvscope.engine.cuda_graphs.graph_runner import DecodeGraphs
from kvscope.engine.kv_cache.pool import KVPool
from kvscope.engine.model.paged_decoder import PagedLlama
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.scheduler import ScheduledSeq
from kvscope.engine.sequence import Sequence
from kvscope.kernels.attention_ref import AttentionMetadata

# Largest |graphed - eager| over the largest |eager| logit: float32 steps differ only in
# summation order; half-precision ones by a rounding or two of bfloat16.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}


class Runner(Protocol):
    """engine.model_runner.ModelRunner as the check uses it (that module sits above this)."""
    model: PagedLlama
    pool: KVPool
    graphs: DecodeGraphs | None

    def prepare(self, batch: list[ScheduledSeq]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]: ...
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor: ...
    def run_graphed(self, batch: list[ScheduledSeq], size: int) -> torch.Tensor: ...


def self_check(runner: Runner, max_model_len: int, seed: int = 0) -> str | None:
    """None when the graphed step matches the eager one; else what differed."""
    graphs = runner.graphs
    if graphs is None:
        return "no graphs"
    pool, model = runner.pool, runner.model
    bs = pool.block_size
    pos = min(bs + 1, max_model_len - 1)  # the decode token: past a block boundary if it fits
    per_seq = pos // bs + 1
    # Three rows pad to bucket 4 (a padded row) when that bucket exists.
    rows = max(1, min(3, graphs.sizes[-1], pool.num_blocks // per_seq))
    if rows * per_seq > pool.num_blocks:
        pos, per_seq = 0, 1
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(rows):
        ids = torch.randint(0, model.shape.vocab_size, (pos + 1,), generator=g).tolist()
        seq = Sequence(f"graph-self-check-{i}", ids, SamplingParams())
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    if pos:
        runner.forward(*runner.prepare([ScheduledSeq(s, pos) for s in seqs])[:3])
        for seq in seqs:
            seq.num_computed_tokens = pos
    batch = [ScheduledSeq(s, 1) for s in seqs]
    ids_t, positions, meta, _ = runner.prepare(batch)
    eager = model.compute_logits(runner.forward(ids_t, positions, meta))
    path = choose_path([1] * rows, False, graphs.sizes, None)
    graphed = runner.run_graphed(batch, path.bucket)
    if not bool(torch.isfinite(graphed).all()):
        return f"the graphed step (bucket {path.bucket}) gave non-finite logits"
    diff = float((graphed - eager).abs().max()) / max(float(eager.abs().max()), 1e-6)
    tol = TOLERANCE.get(model.dtype, 1e-3)
    if diff > tol:
        return (f"the graphed step (bucket {path.bucket}, {rows} rows) differs from the eager "
                f"step by {diff:.2e} of the largest logit (tolerance {tol:.0e})")
    return None
