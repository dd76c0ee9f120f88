"""Turns a scheduled step into one flattened varlen batch, runs the model, returns logits."""
from __future__ import annotations

import torch

from engine.kv_cache import KVPool
from engine.model import PagedLlama
from engine.scheduler import ScheduledSeq
from kernels.attention_ref import AttentionMetadata, group_decode_rows


class ModelRunner:
    def __init__(self, model: PagedLlama, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [S, vocab] for the sequences whose chunk reaches their last known token."""
        input_ids, positions, meta, last_rows = self.prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.pool)
        if not last_rows:
            return hidden.new_empty((0, self.model.shape.vocab_size))
        if len(last_rows) == hidden.shape[0]:  # all decode rows: no gather needed
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])

    def prepare(self, batch: list[ScheduledSeq]):
        """Plain lists first and one tensor per field at the end: building small tensors per
        sequence costs more than the whole list work at 64 sequences."""
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        starts, ctx_lens, last_rows, prefill = [0], [], [], []
        for i, item in enumerate(batch):
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # decode: the common case, without ranges
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                prefill.append(i)
            tables.append(table)
            starts.append(starts[-1] + n)
            ctx_lens.append(end)
            if end == seq.num_tokens:
                last_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=starts,
            context_lens=ctx_lens,
            block_tables=as_tensor(padded),
            slot_mapping=as_tensor(slots),
            decode_groups=group_decode_rows(starts, ctx_lens),
            prefill_seqs=prefill,
            rotation=self.pool.rotation,
        )
        return as_tensor(ids), as_tensor(positions), meta, last_rows
