"""The graph backend the capture/replay code is written against: CUDA graphs, or the CPU
stand-in that records a step once and replays the recording.

`capture(fn)` records `fn` (a zero-argument step over the static buffers) and returns the
graph and its output tensor, which every replay rewrites in place. A CUDA graph binds the
addresses of the buffers it read at capture; the stand-in does the same by recording with
make_fx: the static buffers, the weights and the KV pool enter the recording as constants
(the very tensor objects), and every Python-side decision the step made (a branch, a size,
a tensor built from a list) is frozen into it, as it would be into a CUDA graph. Replaying
the recording, never the Python, is what lets a CPU test catch a per-step input that is not
copied into the static buffers, or a decision taken at capture that should vary per step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

StepFn = Callable[[], torch.Tensor]


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    name: str

    def capture(self, fn: StepFn) -> tuple[CapturedGraph, torch.Tensor]: ...

    def memory_bytes(self) -> int:
        """Device bytes the backend holds now (the graphs' pool: measured before and after
        capture)."""
        ...

    def release(self) -> None:
        """Drop the shared pool, so a recapture starts from nothing."""
        ...


class _CudaGraph:
    def __init__(self, graph: Any) -> None:  # torch.cuda.CUDAGraph
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, every bucket in one shared memory pool (captured largest first,
    so the smaller ones reuse its blocks)."""
    name = "cuda"

    def __init__(self) -> None:
        self.pool: Any = None  # torch.cuda graph pool handle, shared by every capture

    def capture(self, fn: StepFn) -> tuple[CapturedGraph, torch.Tensor]:
        # One eager run first, on a side stream as capture needs: Triton compiles its
        # kernels and cuBLAS picks its algorithms outside the graph.
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's own stub
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return _CudaGraph(graph), out

    def memory_bytes(self) -> int:
        return int(torch.cuda.memory_reserved())

    def release(self) -> None:
        self.pool = None
        torch.cuda.empty_cache()


class _Recorded:
    def __init__(self, module: torch.fx.GraphModule, out: torch.Tensor) -> None:
        self.module, self.out = module, out

    def replay(self) -> None:
        self.out.copy_(self.module())


class RecordedGraphBackend:
    """The CPU stand-in: make_fx records the step's torch ops once (running them for real,
    as a CUDA graph's warm-up does), and a replay runs the recorded ops on the same tensors.
    A step that reads a tensor's value into Python (`.item()`, `.tolist()`, a branch on a
    tensor) fails at capture here, as it would break a CUDA graph capture."""
    name = "recorded"

    def __init__(self) -> None:
        self.graphs: list[_Recorded] = []

    def capture(self, fn: StepFn) -> tuple[CapturedGraph, torch.Tensor]:
        from torch.fx.experimental.proxy_tensor import make_fx

        module = make_fx(fn)()
        recorded = _Recorded(module, module())
        self.graphs.append(recorded)
        return recorded, recorded.out

    def memory_bytes(self) -> int:
        return sum(g.out.numel() * g.out.element_size() for g in self.graphs)

    def release(self) -> None:
        self.graphs.clear()


class RerunBackend:
    """Not a graph: runs the Python step again at every replay. Only for tests, to show
    what the recording adds: a planted capture-time bug passes unnoticed here."""
    name = "rerun"

    def __init__(self) -> None:
        self.bytes = 0

    def capture(self, fn: StepFn) -> tuple[CapturedGraph, torch.Tensor]:
        out = fn()

        class _Rerun:
            def replay(self) -> None:
                out.copy_(fn())

        return _Rerun(), out

    def memory_bytes(self) -> int:
        return self.bytes

    def release(self) -> None:
        pass
