"""Decode graphs on the CPU stand-in backend (a make_fx recording replayed on the static
buffers): greedy output identical to the eager engine at every bucket and with padded rows,
and planted bugs (a per-step input left out of the copy, a Python decision frozen at capture)
caught by the same comparison and by the start-up self-check."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.cuda_graphs.backend import RecordedGraphBackend, RerunBackend
from kvscope.engine.cuda_graphs.decode_step import decode_step
from kvscope.engine.cuda_graphs.graph_runner import DecodeGraphs
from kvscope.engine.cuda_graphs.self_check import self_check
from kvscope.engine.cuda_graphs.static_inputs import StaticInputs
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.model_runner import ModelRunner
from kvscope.testing.tiny_models import save_tiny_model

MAX_LEN = 96
MAX_SEQS = 8  # buckets 1, 2, 4, 8


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """The recording sees torch ops only: the native CPU kernels (ctypes on raw pointers)
    are as opaque to it as host code is to a CUDA graph, so the stand-in runs the torch
    references (a capture with them fails the self-check: test_native_kernels_...)."""
    monkeypatch.setenv("KVSCOPE_KERNELS", "ref")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=5)


def config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), block_size=4, num_kv_blocks=192,
                        max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN, **kw)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 20, (n,), generator=g)]


def generate(engine: LLMEngine, batch: list[list[int]], tokens: int) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True))
           for p in batch]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(i).token_ids for i in ids]


@pytest.fixture(scope="module")
def eager_engine(tiny):
    return LLMEngine(config(tiny, enforce_eager=True))


@pytest.fixture(scope="module")
def graph_engine(tiny):
    import os

    os.environ["KVSCOPE_KERNELS"] = "ref"  # before the model builds its linears
    try:
        return LLMEngine(config(tiny), graph_backend=RecordedGraphBackend())
    finally:
        del os.environ["KVSCOPE_KERNELS"]


def test_graphs_are_captured_and_self_checked(graph_engine):
    stats = graph_engine.stats()
    assert stats.cuda_graphs == "on (recorded)", stats.cuda_graphs_reason
    assert stats.cuda_graph_sizes == [1, 2, 4, 8]
    assert stats.cuda_graph_capture_s > 0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_greedy_output_matches_eager_at_every_bucket(graph_engine, eager_engine, n):
    """n = 3 and 5 pad to buckets 4 and 8; the batch shrinks as requests of different
    lengths finish, so later steps replay smaller buckets with their own padding."""
    batch = prompts(n, seed=n)
    lengths = [6 + 3 * i for i in range(n)]
    before = dict(graph_engine.runner.path_counts)
    ids = [graph_engine.add_request(p, SamplingParams(max_tokens=k, ignore_eos=True))
           for p, k in zip(batch, lengths, strict=True)]
    while graph_engine.has_unfinished():
        graph_engine.step()
    graphed = [graph_engine.pop_output(i).token_ids for i in ids]
    ids = [eager_engine.add_request(p, SamplingParams(max_tokens=k, ignore_eos=True))
           for p, k in zip(batch, lengths, strict=True)]
    while eager_engine.has_unfinished():
        eager_engine.step()
    assert graphed == [eager_engine.pop_output(i).token_ids for i in ids]
    counts = graph_engine.runner.path_counts
    replayed = {k for k in counts if k.startswith("graph:") and counts[k] > before.get(k, 0)}
    expected = {f"graph:{b}" for b in (1, 2, 4, 8) if b >= 1 and any(
        b == min(s for s in (1, 2, 4, 8) if s >= m) for m in range(1, n + 1))}
    assert replayed == expected
    assert counts["eager:prefill"] > before.get("eager:prefill", 0)


def test_a_batch_above_the_largest_bucket_runs_eagerly(graph_engine):
    runner = graph_engine.runner
    from kvscope.engine.scheduling.scheduler import ScheduledSeq
    from kvscope.engine.sequence import Sequence

    batch = [ScheduledSeq(Sequence(str(i), [1, 2], SamplingParams()), 1)
             for i in range(MAX_SEQS + 1)]
    assert runner.choose_path(batch, False).label == f"eager:above largest bucket {MAX_SEQS}"
    assert runner.choose_path(batch[:3], False).label == "graph:4"
    assert runner.choose_path(batch[:3], True).label == "eager:speculative verify"


# -- planted bugs -----------------------------------------------------------------------------
class StalePositions(StaticInputs):
    """Forgets to copy the positions: the graph reads whatever the capture left there."""

    def stage(self, name: str, values: list[int], size: int) -> None:
        if name != "positions":
            super().stage(name, values, size)


class HostLengths(StaticInputs):
    """Keeps the step's context lengths as a Python list, as the eager path's metadata does."""
    last_ctx: list[int] = []

    def fill(self, ids, positions, slots, ctx_lens, tables, size):
        self.last_ctx = list(ctx_lens)
        super().fill(ids, positions, slots, ctx_lens, tables, size)


def frozen_length_step(model, pool, inputs):
    """Attends only as far as the longest context in the host-side list: a Python decision
    (like a kernel grid chosen from the step's lengths) that a recording takes once, at
    capture, where the list is empty."""
    longest = max(HOST.last_ctx, default=1)
    inputs.context_lens.clamp_(max=longest)
    return decode_step(model, pool, inputs)


HOST = HostLengths(1, 1, "cpu", MAX_LEN)  # the planted runner's inputs, set below


def planted_runner(engine: LLMEngine, backend, *, stale_positions=False, step=decode_step):
    global HOST
    graphs = DecodeGraphs(engine.model, engine.pool, backend, MAX_SEQS, MAX_LEN, step=step)
    old = graphs.inputs
    kind = StalePositions if stale_positions else HostLengths
    graphs.inputs = HOST = kind(old.max_rows, old.width, "cpu", old.max_model_len)
    graphs.capture()
    return ModelRunner(engine.model, engine.pool, graphs)


@pytest.fixture
def scratch_engine(tiny, monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "ref")
    return LLMEngine(config(tiny, enforce_eager=True))


@pytest.mark.parametrize("bug", ["stale_positions", "frozen_decision"])
def test_a_planted_bug_is_caught(scratch_engine, eager_engine, bug):
    kw = {"stale_positions": True} if bug == "stale_positions" else {"step": frozen_length_step}
    runner = planted_runner(scratch_engine, RecordedGraphBackend(), **kw)
    assert self_check(runner, MAX_LEN) is not None  # the engine would run eagerly
    scratch_engine.runner = runner  # past the self-check: the greedy comparison catches it
    batch = prompts(3, seed=11)
    assert generate(scratch_engine, batch, 8) != generate(eager_engine, batch, 8)


def test_the_frozen_decision_passes_a_backend_that_reruns_the_python(scratch_engine):
    """Why the stand-in replays a recording: re-running the Python step hides the frozen
    decision (it is taken again every step), which a CUDA graph would not do."""
    runner = planted_runner(scratch_engine, RerunBackend(), step=frozen_length_step)
    assert self_check(runner, MAX_LEN) is None


def test_native_kernels_fail_the_self_check_and_the_engine_runs_eagerly(tiny, monkeypatch,
                                                                         caplog):
    monkeypatch.delenv("KVSCOPE_KERNELS")
    from kvscope.kernels import native

    if not native.available():
        pytest.skip("no native CPU kernels built here")
    engine = LLMEngine(config(tiny), graph_backend=RecordedGraphBackend())
    stats = engine.stats()
    assert stats.cuda_graphs == "off"
    assert stats.cuda_graphs_reason.startswith("self-check failed")
    assert "decode graphs off" in caplog.text
    assert generate(engine, prompts(2), 4)  # and it still serves, eagerly


def test_enforce_eager_and_the_cpu_default_capture_nothing(tiny):
    assert LLMEngine(config(tiny, enforce_eager=True),
                     graph_backend=RecordedGraphBackend()).stats().cuda_graphs_reason \
        == "enforce_eager"
    assert "CUDA only" in LLMEngine(config(tiny)).stats().cuda_graphs_reason


def test_reconfigure_recaptures_against_the_new_pool(graph_engine, eager_engine):
    old_graphs = graph_engine.runner.graphs
    graph_engine.reconfigure(block_size=8)
    new = graph_engine.runner
    assert new.graphs is not None and new.graphs is not old_graphs
    assert old_graphs.graphs == {}  # released
    assert new.graphs.inputs.width == MAX_LEN // 8
    eager_engine.reconfigure(block_size=8)
    batch = prompts(3, seed=4)
    assert generate(graph_engine, batch, 10) == generate(eager_engine, batch, 10)
