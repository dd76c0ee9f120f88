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
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])

    def prepare(self, batch: list[ScheduledSeq]):
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, ctx_lens, last_rows = [0], [], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            starts.append(starts[-1] + item.num_tokens)
            ctx_lens.append(end)
            if end == seq.num_tokens:
                last_rows.append(starts[-1] - 1)
        meta = self._metadata(batch, starts, ctx_lens, slots)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        return as_tensor(ids), as_tensor(positions), meta, last_rows

    def _metadata(self, batch, starts, ctx_lens, slots) -> AttentionMetadata:
        width = max(len(item.seq.block_table) for item in batch)
        tables = torch.zeros((len(batch), width), dtype=torch.long)
        for i, item in enumerate(batch):
            tables[i, :len(item.seq.block_table)] = torch.tensor(item.seq.block_table)
        prefill = [i for i, item in enumerate(batch) if item.num_tokens > 1]
        return AttentionMetadata(
            query_start_loc=starts,
            context_lens=ctx_lens,
            block_tables=tables.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_groups=group_decode_rows(starts, ctx_lens),
            prefill_seqs=prefill,
            rotation=self.pool.rotation,
        )
