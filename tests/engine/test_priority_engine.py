"""Priority through the engine on a tiny model: an urgent request overtakes a saturated batch,
and the policy reconfigures in place.
"""
from __future__ import annotations

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import SamplingParams

# -- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvscope.testing.tiny_models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5))


def finish_order_of(engine, background: int, urgent_priority: int):
    """Saturate max_num_seqs with priority-0 requests, then send one more at
    urgent_priority; the request ids in the order they finished, and every reply."""
    from tests.engine.test_engine_tiny import random_prompts

    prompts = random_prompts([9, 14, 11, 7, 12][:background] + [10], seed=8)
    slow = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, slow, request_id=f"bg{i}")
           for i, p in enumerate(prompts[:-1])]
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == engine.config.max_num_seqs
    ids.append(engine.add_request(prompts[-1], SamplingParams(
        max_tokens=4, ignore_eos=True, priority=urgent_priority), request_id="urgent"))
    order = []
    while engine.has_unfinished():
        order += [d.request_id for d in engine.step().outputs if d.finished]
    return order, {i: engine.pop_output(i).token_ids for i in ids}


def test_engine_urgent_request_overtakes_a_saturated_batch(tiny):
    import torch

    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.loading.loader import load_model

    loaded = load_model(tiny, torch.float32)
    cfg = EngineConfig(model=tiny, block_size=8, num_kv_blocks=64, max_num_seqs=2)
    engine = LLMEngine(cfg, loaded=loaded)
    order, replies = finish_order_of(engine, 4, urgent_priority=-1)
    assert order[0] == "urgent"
    assert engine.scheduler.preemptions_by_reason == {"memory": 0, "priority": 1}
    assert engine.scheduler.recomputed_tokens > 0  # bg1's prompt and first tokens, again
    # under fcfs the same request waits for the whole batch; every reply is the same
    fcfs = LLMEngine(EngineConfig(model=tiny, block_size=8, num_kv_blocks=64, max_num_seqs=2,
                                  scheduling_policy="fcfs"), loaded=loaded)
    fcfs_order, fcfs_replies = finish_order_of(fcfs, 4, urgent_priority=-1)
    assert fcfs_order[-1] == "urgent" and fcfs.scheduler.num_preemptions == 0
    assert replies == fcfs_replies


def test_engine_reconfigures_the_policy_in_place(tiny):
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.ipc.settings import IN_PLACE_SETTINGS as RECONFIGURABLE_IN_PLACE

    assert {"scheduling_policy", "priority_aging_s",
            "max_prefill_tokens_while_decoding"} <= RECONFIGURABLE_IN_PLACE
    engine = LLMEngine(EngineConfig(model=tiny, block_size=8, num_kv_blocks=64,
                                    max_num_seqs=1, scheduling_policy="fcfs"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.add_request([5, 6, 7, 8, 9], params)
    late = engine.add_request([9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True,
                                                        priority=-1))
    engine.step()
    pool, sched, seq = engine.pool, engine.scheduler, engine.requests[first]
    table = list(seq.block_table)
    engine.reconfigure(scheduling_policy="priority", priority_aging_s=0)
    assert engine.pool is pool and engine.scheduler is sched and seq.block_table == table
    assert engine.config.scheduling_policy == "priority"
    assert engine.config.settings().scheduling_policy == "priority"
    engine.step()  # the urgent one displaces the one that was running
    assert [s.request_id for s in sched.running] == [late]
    assert sched.preemptions_by_reason["priority"] == 1
    # a pool change rebuilds, and the counters carry over
    engine.reconfigure(block_size=4, scheduling_policy="fcfs")
    assert engine.scheduler is not sched and engine.scheduler.policy == "fcfs"
    assert engine.scheduler.preemptions_by_reason["priority"] == 1
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        engine.reconfigure(scheduling_policy="lifo")
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_output(first).token_ids) == len(engine.pop_output(late).token_ids) == 6
