"""The static input buffers a captured decode step reads, and the per-step copy into them.

A graph replays on fixed addresses, so every per-step input lives in one buffer allocated at
capture and rewritten each step: input ids, positions, slots, context lengths and block
tables, laid out [ids | positions | slots | context lengths | tables] for the largest bucket.
A step packs its rows (and the padding up to its bucket) into a same-layout host buffer
(pinned on CUDA) and sends it in one non-blocking copy. Padded rows are neutralised: slot -1
(the KV write skips it), context length 0, token 0 at position 0, a table of zeros.

The Triton kernels' per-step device tensors (kernels.triton_attention._step_tensors, cached
on the step's metadata) are seeded here from the same buffers, with the maximum context set to
max_model_len: the kernel's launch grid and KV split count are then fixed per bucket, never
taken from the step being captured.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kvscope.kernels.attention_ref import AttentionMetadata

FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens")
PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 0}
# Every query tile size (block_q) the Triton attention may pick for decode rows: one query
# a sequence gives the same tiles for each, so all are seeded.
_BLOCK_QS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class BucketInputs:
    """Views of the static buffers for one bucket of `size` rows."""
    size: int
    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slot_mapping: torch.Tensor  # [size] int64, -1 on padded rows
    context_lens: torch.Tensor  # [size] int64, 0 on padded rows
    context_lens32: torch.Tensor  # [size] int32 (the Triton kernel's), copied inside the step
    block_tables: torch.Tensor  # [size, width] int64
    meta: AttentionMetadata  # for kernels.ops, its Triton tensors seeded from the buffers


class StaticInputs:
    def __init__(self, max_rows: int, width: int, device: str, max_model_len: int) -> None:
        self.max_rows, self.width = max_rows, width
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        n = max_rows * (len(FIELDS) + width)
        self.buffer = torch.zeros(n, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        self.staging = torch.zeros(n, dtype=torch.long, pin_memory=pinned)
        self.ctx32 = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self.qsl = torch.arange(max_rows + 1, dtype=torch.int32, device=self.device)
        self.tile_seq = torch.arange(max_rows, dtype=torch.int32, device=self.device)
        self.tile_q = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self._buckets: dict[int, BucketInputs] = {}

    def _field(self, t: torch.Tensor, name: str, size: int) -> torch.Tensor:
        i = FIELDS.index(name)
        return t[i * self.max_rows:i * self.max_rows + size]

    def bucket(self, size: int) -> BucketInputs:
        """The views for `size` rows (made once per bucket: the graph holds their addresses)."""
        hit = self._buckets.get(size)
        if hit is not None:
            return hit
        if not 1 <= size <= self.max_rows:
            raise ValueError(f"bucket {size} is outside 1..{self.max_rows}")
        base = len(FIELDS) * self.max_rows
        tables = self.buffer[base:base + size * self.width].view(size, self.width)
        views = {name: self._field(self.buffer, name, size) for name in FIELDS}
        meta = AttentionMetadata(
            query_start_loc=list(range(size + 1)), context_lens=[self.max_model_len] * size,
            block_tables=tables, slot_mapping=views["slot_mapping"], decode_groups=[],
            prefill_seqs=[])
        seeded = {
            "qsl": self.qsl[:size + 1], "ctx": self.ctx32[:size],
            "tile_seq": self.tile_seq[:size], "tile_q": self.tile_q[:size],
            "num_tiles": size, "block_tables": tables, "max_ctx": self.max_model_len,
            "anchor_index": None,
        }
        dev = str(tables.device)
        meta.__dict__["_triton_step_tensors"] = {(dev, q): seeded for q in _BLOCK_QS}
        hit = BucketInputs(size, context_lens32=self.ctx32[:size], block_tables=tables,
                           meta=meta, **views)
        self._buckets[size] = hit
        return hit

    # -- the per-step copy -------------------------------------------------------------------
    def stage(self, name: str, values: list[int], size: int) -> None:
        """One field's rows, padded to `size`, into the host staging buffer."""
        rows = values + [PAD[name]] * (size - len(values))
        self._field(self.staging, name, size).copy_(
            torch.frombuffer(array("q", rows), dtype=torch.long))

    def stage_tables(self, tables: list[list[int]], size: int) -> None:
        base = len(FIELDS) * self.max_rows
        flat: list[int] = []
        w = self.width
        for table in tables:
            if len(table) > w:
                raise ValueError(f"a block table of {len(table)} blocks is wider than the "
                                 f"static tables ({w}: max_model_len / block_size)")
            flat += table + [0] * (w - len(table))
        flat += [0] * ((size - len(tables)) * w)
        self.staging[base:base + size * w].copy_(
            torch.frombuffer(array("q", flat), dtype=torch.long))

    def fill(self, ids: list[int], positions: list[int], slots: list[int],
             ctx_lens: list[int], tables: list[list[int]], size: int) -> None:
        """Every per-step input of a decode step of len(ids) rows, padded to `size`, staged
        and sent to the static buffers in one copy (non-blocking from pinned memory)."""
        for name, values in zip(FIELDS, (ids, positions, slots, ctx_lens), strict=True):
            self.stage(name, values, size)
        self.stage_tables(tables, size)
        end = len(FIELDS) * self.max_rows + size * self.width
        self.buffer[:end].copy_(self.staging[:end], non_blocking=True)
