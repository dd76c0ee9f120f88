"""Turns a scheduled step into one flattened varlen batch, runs the model, returns logits.

A step's metadata is built once, here, into preallocated buffers (engine.cuda_graphs.
step_buffers: pinned and non-blocking on CUDA), and every layer reads the same tensors. A
decode-only step with captured graphs (engine.cuda_graphs) replays its bucket's graph
instead; `last_path` says which path the latest step took and why.
"""
from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from kvscope.engine.cuda_graphs.backend import CudaGraphBackend, GraphBackend
from kvscope.engine.cuda_graphs.dispatch import StepPath, choose_path
from kvscope.engine.cuda_graphs.graph_runner import DecodeGraphs
from kvscope.engine.cuda_graphs.self_check import self_check
from kvscope.engine.cuda_graphs.step_buffers import StepBuffers
from kvscope.engine.kv_cache.pool import KVPool
from kvscope.engine.model.paged_decoder import PagedLlama
from kvscope.engine.scheduling.scheduler import ScheduledSeq
from kvscope.engine.spec_decode.decoder import logit_rows
from kvscope.kernels import native
from kvscope.kernels.attention_ref import AttentionMetadata, DecodeGroup, group_decode_rows

log = logging.getLogger("kvscope.engine.cuda_graphs")


@dataclass
class GraphStats:
    status: str  # "on (cuda)", "on (recorded)", "off"
    reason: str  # why off
    sizes: list[int]
    capture_s: float
    graph_bytes: int
    steps_by_path: dict[str, int]


class ModelRunner:
    def __init__(self, model: PagedLlama, pool: KVPool, graphs: DecodeGraphs | None = None,
                 graphs_off: str | None = "enforce_eager") -> None:
        """`graphs`: the pool's captured decode graphs; None with `graphs_off` saying why."""
        self.model = model
        self.pool = pool
        self.device = model.device
        self.on_host = torch.device(self.device).type == "cpu"
        self.buffers = StepBuffers(self.device)
        self.graphs = graphs
        self.graphs_off = None if graphs is not None else (graphs_off or "unavailable")
        self.last_path = StepPath(0, "no step yet")
        self.path_counts: Counter[str] = Counter()  # StepPath.label -> steps

    def graph_stats(self) -> GraphStats:
        """On or off and why, the buckets, the capture's time and memory, and the steps run
        on each path (EngineStats' cuda_graph* fields)."""
        report = self.graphs.report if self.graphs is not None else None
        if report is None:
            return GraphStats("off", self.graphs_off or "", [], 0.0, 0, dict(self.path_counts))
        return GraphStats(f"on ({report.backend})", "", report.sizes, report.capture_s,
                          report.graph_bytes, dict(self.path_counts))

    def choose_path(self, batch: list[ScheduledSeq], drafted: bool) -> StepPath:
        sizes = self.graphs.sizes if self.graphs is not None else []
        return choose_path([item.num_tokens for item in batch], drafted, sizes, self.graphs_off)

    def run(self, batch: list[ScheduledSeq], drafted: bool = False) -> torch.Tensor:
        """Logits [S, vocab] for the sequences whose chunk reaches their last known token;
        `drafted`: and at every drafted position (engine.spec_decode.decoder.logit_rows)."""
        path = self.last_path = self.choose_path(batch, drafted)
        self.path_counts[path.label] += 1
        if path.bucket:
            return self.run_graphed(batch, path.bucket)
        input_ids, positions, meta, last_rows = self.prepare(batch)
        if drafted:
            last_rows = logit_rows(batch, meta.query_start_loc)
        hidden = self.forward(input_ids, positions, meta)
        if not last_rows:
            return hidden.new_empty((0, self.model.shape.vocab_size))
        if len(last_rows) == hidden.shape[0]:  # all decode rows: no gather needed
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])

    def run_graphed(self, batch: list[ScheduledSeq], size: int) -> torch.Tensor:
        """A step of one token per sequence, replayed in the graph of bucket `size`."""
        if self.graphs is None:
            raise RuntimeError("run_graphed without captured graphs")
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []
        for row, item in enumerate(batch):
            seq = item.seq
            start = seq.num_computed_tokens
            table = seq.block_table
            ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            ctx_lens.append(start + 1)
            tables.append(table)
            if start + 1 == len(seq.token_ids):  # a one-token prefill chunk short of the end
                last_rows.append(row)
        hidden = self.graphs.run(ids, positions, slots, ctx_lens, tables, size)
        if len(last_rows) == len(batch):
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a prepared step; once it has run, the anchor entries it claimed
        hold their rows (engine.kv_cache.anchors)."""
        hidden = self.model.forward(input_ids, positions, meta, self.pool)
        if self.pool.anchor_table is not None:
            self.pool.anchor_table.commit()
        return hidden

    def prepare(self, batch: list[ScheduledSeq]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Plain lists first, then every integer field packed into one buffer that becomes one
        tensor (one host-to-device copy) split into views: building a tensor per field, or
        from nested lists, cost more than all the list work at 64 sequences."""
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        starts = [0]
        ctx_lens: list[int] = []
        last_rows: list[int] = []
        prefill: list[int] = []
        verify: list[int] = []
        row = 0
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
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
                if item.num_draft_tokens and n - item.num_draft_tokens == 1:
                    verify.append(i)
            tables.append(table)
            row += n
            starts.append(row)
            ctx_lens.append(end)
            if end == len(seq.token_ids):
                last_rows.append(row - 1)
        packed, width = pack_fields(ids, positions, slots, tables)
        packed = self.buffers.load(packed)
        num_rows = len(ids)
        meta = AttentionMetadata(
            query_start_loc=starts,
            context_lens=ctx_lens,
            block_tables=packed[3 * num_rows:].view(len(tables), width),
            slot_mapping=packed[2 * num_rows:3 * num_rows],
            decode_groups=self.decode_groups(starts, ctx_lens),
            prefill_seqs=prefill,
            rotation=self.pool.rotation,
            verify_seqs=frozenset(verify),
        )
        if self.pool.anchor_table is not None:
            self.plan_anchors(batch, starts, meta)
        return packed[:num_rows], packed[num_rows:2 * num_rows], meta, last_rows

    def plan_anchors(self, batch: list[ScheduledSeq], starts: list[int],
                     meta: AttentionMetadata) -> None:
        """Each sequence's anchor entry, and the rows that fill new ones
        (engine.kv_cache.anchors)."""
        table = self.pool.anchor_table
        if table is None:
            return
        n = table.num_tokens
        openings: list[tuple[tuple[int, ...] | None, int, int, int]] = []
        for item, row in zip(batch, starts, strict=False):  # starts has one more: the end
            seq = item.seq
            key = tuple(seq.token_ids[:n]) if len(seq.token_ids) >= n else None
            start = seq.num_computed_tokens
            openings.append((key, start, start + item.num_tokens, row))
        plan = table.plan_step(openings)
        meta.anchor_index = torch.tensor(plan.index, dtype=torch.long)
        if plan.fill_rows:
            meta.anchor_fill = (torch.tensor(plan.fill_rows, device=self.device),
                                torch.tensor(plan.fill_slots, device=self.device))

    def decode_groups(self, starts: list[int], ctx_lens: list[int]) -> Sequence[DecodeGroup]:
        """The torch reference attention's decode groups. Built now when that reference is
        what runs (the CPU without its native kernels), so the profile counts them as host
        work; otherwise on first use, which the Triton kernels and the native CPU decode
        attention never make (see DecodeGroups)."""
        if self.on_host and not native.available():
            return group_decode_rows(starts, ctx_lens)
        return DecodeGroups(starts, ctx_lens)


class DecodeGroups(Sequence[DecodeGroup]):
    """kernels.attention_ref.group_decode_rows of a step, built on first use.

    Only the torch reference attention reads the decode groups; the Triton kernels and the
    native CPU decode attention never do, and building them (a sort and three small tensors
    per group) is a tenth of a GPU step's host time at 64 sequences, 0.1-0.25 ms of a CPU one.
    Prefill chunks on the CPU still take the reference, which then builds them.
    """

    def __init__(self, starts: list[int], ctx_lens: list[int]) -> None:
        self._args: tuple[list[int], list[int]] | None = (starts, ctx_lens)
        self._groups: list[DecodeGroup] = []

    def _built(self) -> list[DecodeGroup]:
        if self._args is not None:
            self._groups, self._args = group_decode_rows(*self._args), None
        return self._groups

    @overload
    def __getitem__(self, i: int) -> DecodeGroup: ...

    @overload
    def __getitem__(self, i: slice) -> list[DecodeGroup]: ...

    def __getitem__(self, i: int | slice) -> DecodeGroup | list[DecodeGroup]:
        return self._built()[i]

    def __len__(self) -> int:
        return len(self._built())

    def __iter__(self) -> Iterator[DecodeGroup]:
        return iter(self._built())


def pack_fields(ids: list[int], positions: list[int], slots: list[int],
                tables: list[list[int]]) -> tuple[torch.Tensor, int]:
    """ids + positions + slots + the block tables zero-padded to one width, as one int64
    CPU tensor (and that width). A table's -1 entries (blocks freed behind a sliding window,
    BlockManager.free_behind_window) stay -1: the kernels never read them, and no slot of
    the step lies in one (they end before the first query's window).

    One flat list, one array('q') and torch.frombuffer was the cheapest way from Python ints
    to a tensor measured: torch.tensor on the same list costs ~4x more, extending an array
    table by table ~1.5x."""
    width = max(map(len, tables))
    zeros = [0] * width
    flat = ids + positions + slots
    for table in tables:
        flat += table + zeros[len(table):]
    return torch.frombuffer(array("q", flat), dtype=torch.long), width


def default_graph_backend(device: str) -> GraphBackend | None:
    """CUDA graphs on a CUDA device; None elsewhere (the CPU runs eagerly: a step's host work
    is small beside its matmuls there, and the stand-in backend is for tests)."""
    return CudaGraphBackend() if torch.device(device).type == "cuda" else None


def runner_for(model: PagedLlama, pool: KVPool, backend: GraphBackend | None,
               max_num_seqs: int, max_model_len: int, enforce_eager: bool) -> ModelRunner:
    """The pool's runner, with decode graphs captured and self-checked when they can be; on
    any failure the runner runs eagerly and the log, its stats and /metrics say why."""
    reason = graphs_unavailable(pool, backend, enforce_eager)
    if reason is not None:
        return ModelRunner(model, pool, None, reason)
    assert backend is not None  # graphs_unavailable said so
    graphs = DecodeGraphs(model, pool, backend, max_num_seqs, max_model_len)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
        graphs.release()
        reason = f"capture failed: {type(exc).__name__}: {exc}"
        log.warning("decode graphs off, running eagerly: %s", reason)
        return ModelRunner(model, pool, None, reason)
    runner = ModelRunner(model, pool, graphs)
    try:
        problem = self_check(runner, max_model_len)
    except Exception as exc:  # noqa: BLE001 - a self-check that cannot run is a failed one
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        graphs.release()
        reason = f"self-check failed: {problem}"
        log.warning("decode graphs off, running eagerly: %s", reason)
        return ModelRunner(model, pool, None, reason)
    return runner


def graphs_unavailable(pool: KVPool, backend: GraphBackend | None,
                       enforce_eager: bool) -> str | None:
    """Why decode graphs are not even tried; None when they are."""
    if enforce_eager:
        return "enforce_eager"
    if backend is None:
        return "no graph backend on this device (CUDA only)"
    if pool.anchor_table is not None:
        # Anchor entries are claimed and filled per step on the host (engine.kv_cache.anchors).
        return "anchor tokens (--kv-anchor-tokens 0 allows graphs on a 1-byte KV pool)"
    return None
