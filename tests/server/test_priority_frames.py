"""What the state frames tell the window about priority scheduling (issue 26), from a real
tiny engine: per request priority, queue time and wait reason in the blocks frame; every
preemption since the previous frame (steps are more frequent than frames) with the blocks
it freed; the counts by reason in the stats frame."""
from __future__ import annotations

import msgspec
import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server import snapshots
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.testing.frames import server_counters
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)


def wire(frame, kind):
    return msgspec.msgpack.decode(codec.encode(frame), type=kind)


def step(engine, log: snapshots.StepLog) -> list:
    """One step as the server runs it: the step log records it, then the scheduler's own
    list of this step's preemptions is kept for the check."""
    result = engine.step()
    if result.ran:
        log.record(engine, result.scheduled, {}, 0.01)
    return list(engine.scheduler.last_preemptions)


def test_frames_carry_waits_preemptions_and_counts(model):
    # 12 blocks of 4 tokens: two 16-token prompts growing by 16 tokens each cannot both stay.
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", block_size=4,
                                    num_kv_blocks=12, max_model_len=64,
                                    enable_prefix_caching=False, scheduling_policy="priority",
                                    max_num_batched_tokens=16))
    log = snapshots.StepLog()
    engine.add_request(list(range(10, 26)), SamplingParams(max_tokens=16, ignore_eos=True,
                                                           priority=3), "low")
    engine.add_request(list(range(40, 56)), SamplingParams(max_tokens=16, ignore_eos=True,
                                                           priority=-1), "chat")
    frame = wire(snapshots.blocks_frame(engine, 1), m.BlocksFrame)
    assert dict(zip(frame.request_ids, frame.request_priorities, strict=True)) == \
        {"low": 3, "chat": -1}
    assert frame.request_queue_s == [None, None]  # never scheduled yet
    seen, expected = [], []
    steps = 0
    while engine.has_unfinished() and steps < 200:
        expected += step(engine, log)
        steps += 1
        if steps % 5 == 0:  # a blocks frame every few steps takes what happened since
            frame = wire(snapshots.blocks_frame(engine, steps, None,
                                                log.take_preemptions()), m.BlocksFrame)
            seen += frame.preemptions
            for i, rid in enumerate(frame.request_ids):
                seq = engine.requests[rid]
                assert frame.request_priorities[i] == seq.params.priority
                assert frame.request_wait_reasons[i] == seq.wait_reason
                queue = frame.request_queue_s[i]
                assert (queue is None) == (seq.first_scheduled_time is None)
                if queue is not None:
                    assert queue == pytest.approx(seq.first_scheduled_time - seq.arrival_time)
                    assert queue >= 0
    seen += log.take_preemptions()
    assert not engine.has_unfinished()
    assert expected, "the pool was meant to run dry: no preemption happened"
    assert [(p.request_id, p.reason, p.block_ids, p.priority) for p in seen] == \
        [(p.request_id, p.reason, list(p.block_ids), p.priority) for p in expected]
    assert all(b >= 0 for p in seen for b in p.block_ids) and all(p.step > 0 for p in seen)
    stats = wire(snapshots.Metrics().frame(engine, 1, server_counters()), m.StatsFrame)
    by_reason = engine.scheduler.preemptions_by_reason
    assert stats.preemptions_by_reason == by_reason
    assert sum(by_reason.values()) == len(expected)
    assert stats.recomputed_tokens == engine.scheduler.recomputed_tokens > 0
    engine.interrupt.num_interrupted = 4  # as if 4 steps had been cut short
    stats = wire(snapshots.Metrics().frame(engine, 2, server_counters()), m.StatsFrame)
    assert stats.interrupted_steps == 4


def test_a_snapshot_reply_leaves_the_preemptions_to_the_next_frame():
    log = snapshots.StepLog()
    log.preemptions.append(m.PreemptionEvent("a", "memory", [1, 2], 0, 3))
    assert [p.request_id for p in log.take_preemptions(consume=False)] == ["a"]
    assert [p.request_id for p in log.take_preemptions()] == ["a"]
    assert log.take_preemptions() == []
