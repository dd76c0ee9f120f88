"""Traces record each step's drafts and acceptances, and `trace replay` A/Bs speculation:
the same arrivals replayed with it off give the same greedy outputs."""
from __future__ import annotations

import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.traces.recorder import start_trace
from kvscope.engine.traces.replay import replay_file
from kvscope.ipc.trace_format import Step, read_trace
from kvscope.testing.tiny_models import save_tiny_model


def test_trace_records_drafts_and_replays_with_speculation_off(tmp_path):
    path = str(save_tiny_model(tmp_path / "m", "llama", seed=3))
    base = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    config = EngineConfig(model=path, block_size=4, num_kv_blocks=256,
                          speculative_method="ngram", prompt_lookup_min=1)
    llm = LLM(config)
    start_trace(llm.engine, tmp_path / "a.jsonl")
    llm.generate([base * 3, base[:5] * 4], SamplingParams(max_tokens=60, ignore_eos=True))
    llm.engine.stop_trace()
    steps = read_trace(tmp_path / "a.jsonl").of_type(Step)
    verifies = [v for s in steps for v in s.spec]
    assert verifies and all(0 <= accepted <= drafted for _, drafted, accepted in verifies)
    assert sum(d for _, d, _ in verifies) == llm.engine.spec.counters.num_draft_tokens
    off = EngineConfig(model=path, block_size=4, num_kv_blocks=256)
    result = replay_file(tmp_path / "a.jsonl", tmp_path / "b.jsonl", off, None)
    assert result.outputs.identical is True
    assert not any(s.spec for s in read_trace(tmp_path / "b.jsonl").of_type(Step))
