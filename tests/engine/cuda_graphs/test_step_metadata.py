"""A step's metadata is built once, in the model runner, into its preallocated buffers, and
every layer of the decoder reads those same tensors (issue 54, item 2)."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.cuda_graphs.step_buffers import StepBuffers
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.model import paged_decoder
from kvscope.engine.model_runner import ModelRunner
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture
def engine(tmp_path, monkeypatch):
    # The generic layer loop (the fused CPU decode step has no per-layer calls to watch).
    monkeypatch.setenv("KVSCOPE_KERNELS", "ref")
    path = save_tiny_model(tmp_path, "llama", seed=1)
    return LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64,
                                  max_model_len=64, enforce_eager=True))


def test_metadata_is_built_once_per_step_and_shared_by_every_layer(engine, monkeypatch):
    builds: list[int] = []
    seen: list[tuple[int, object, torch.Tensor]] = []
    prepare, write_kv = ModelRunner.prepare, paged_decoder.write_kv

    def counted_prepare(self, batch):
        builds.append(engine.num_steps)
        return prepare(self, batch)

    def watched_write_kv(k, v, kc, vc, slot_mapping, *args):
        seen.append((engine.num_steps, args[2], slot_mapping))  # (step, rotation, slots)
        return write_kv(k, v, kc, vc, slot_mapping, *args)

    metas: list[tuple[int, object]] = []
    attention = paged_decoder.paged_attention

    def watched_attention(q, kc, vc, meta, *args, **kw):
        metas.append((engine.num_steps, meta))
        return attention(q, kc, vc, meta, *args, **kw)

    monkeypatch.setattr(ModelRunner, "prepare", counted_prepare)
    monkeypatch.setattr(paged_decoder, "write_kv", watched_write_kv)
    monkeypatch.setattr(paged_decoder, "paged_attention", watched_attention)
    for prompt in ([5, 6, 7, 8, 9], [3, 4]):
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps = engine.num_steps
    assert builds == list(range(steps))  # once per step
    layers = engine.model.shape.num_layers
    buffer = engine.runner.buffers.buffer
    for step in range(steps):
        slots = [s for n, _, s in seen if n == step]
        step_metas = [m for n, m in metas if n == step]
        assert len(slots) == len(step_metas) == layers
        assert all(s is slots[0] for s in slots)  # the same tensor in every layer
        assert all(m is step_metas[0] for m in step_metas)
        assert slots[0].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_step_buffers_reuse_their_memory_and_grow_when_needed():
    buffers = StepBuffers("cpu", capacity=8)
    first = buffers.load(torch.arange(5))
    ptr = buffers.buffer.data_ptr()
    second = buffers.load(torch.arange(7, 0, -1))
    assert buffers.buffer.data_ptr() == ptr  # no allocation per step
    assert second.tolist() == [7, 6, 5, 4, 3, 2, 1]
    assert first.data_ptr() == second.data_ptr()
    big = buffers.load(torch.arange(20))
    assert big.tolist() == list(range(20)) and buffers.capacity >= 20
