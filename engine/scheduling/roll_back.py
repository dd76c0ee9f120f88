"""Undo an abandoned step's schedule (engine.model.step_interrupt): a step a more urgent
arrival cut short advanced no token, so what scheduling it promised is taken back.

Here, beside the scheduler, rather than beside the flag the model polls: undoing reads the
block manager and the scheduler's batch, which sit above the model.
"""
from __future__ import annotations

from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.scheduling.scheduler import ScheduledSeq


def roll_back(bm: BlockManager, batch: list[ScheduledSeq], registered: list[int]) -> None:
    """Undo what scheduling an abandoned step promised: the hashes of the blocks its schedule
    registered (`registered`, BlockManager.journal), and any prefix hit a request admitted
    with it took on one of them. The blocks stay with their sequences, whose next chunk
    starts where this one did."""
    bm.forget_registered(registered)
    unfinished = set(registered)
    for item in batch:
        seq = item.seq
        computed = seq.num_computed_tokens // bm.block_size
        bad = next((i for i in range(computed) if seq.block_table[i] in unfinished), None)
        if bad is not None:
            bm.truncate(seq, bad)
            seq.num_computed_tokens = bad * bm.block_size
            seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_computed_tokens)
