"""The captured decode graphs of one KV pool: capture per bucket, fill, replay, release.

Built with the pool (engine.llm_engine._build_pool) and dropped with it, so a reconfigure
(block size, KV dtype, pool size) recaptures against the new pool and the old graphs and
their memory go with the old pool. Buckets are captured largest first into the backend's one
shared pool, as nano-vllm and vLLM do: the smaller graphs reuse the largest one's blocks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from kvscope.engine.cuda_graphs.backend import CapturedGraph, GraphBackend
from kvscope.engine.cuda_graphs.decode_step import decode_step
from kvscope.engine.cuda_graphs.dispatch import capture_sizes
from kvscope.engine.cuda_graphs.static_inputs import BucketInputs, StaticInputs
from kvscope.engine.kv_cache.pool import KVPool
from kvscope.engine.model.paged_decoder import PagedLlama

log = logging.getLogger("kvscope.engine.cuda_graphs")

StepBody = Callable[[PagedLlama, KVPool, BucketInputs], torch.Tensor]


@dataclass
class CaptureReport:
    sizes: list[int]
    capture_s: float
    graph_bytes: int
    backend: str


class DecodeGraphs:
    def __init__(self, model: PagedLlama, pool: KVPool, backend: GraphBackend,
                 max_num_seqs: int, max_model_len: int, step: StepBody = decode_step) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self.step = step
        self.sizes = capture_sizes(max_num_seqs)
        width = -(-max_model_len // pool.block_size)
        self.inputs = StaticInputs(self.sizes[-1], width, model.device, max_model_len)
        self.graphs: dict[int, CapturedGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.report: CaptureReport | None = None

    def capture(self) -> CaptureReport:
        """Every bucket, largest first. Raises what the capture raised (the caller runs
        eagerly then, and says why)."""
        started, before = time.perf_counter(), self.backend.memory_bytes()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                inputs = self.inputs.bucket(size)
                graph, out = self.backend.capture(partial(self.step, self.model, self.pool,
                                                          inputs))
                self.graphs[size], self.outputs[size] = graph, out
        self.report = CaptureReport(list(self.sizes), time.perf_counter() - started,
                                    max(0, self.backend.memory_bytes() - before),
                                    self.backend.name)
        log.info("captured %d decode graphs (batch sizes %s) in %.2f s, %.1f MiB (%s)",
                 len(self.sizes), self.sizes, self.report.capture_s,
                 self.report.graph_bytes / 2**20, self.backend.name)
        return self.report

    def run(self, ids: list[int], positions: list[int], slots: list[int], ctx_lens: list[int],
            tables: list[list[int]], size: int) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of a decode step replayed in bucket `size`."""
        self.inputs.fill(ids, positions, slots, ctx_lens, tables, size)
        with torch.inference_mode():
            self.graphs[size].replay()
        return self.outputs[size][:len(ids)]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.backend.release()
