"""Reconfiguring the KV pool mid-generation loses no request and changes no greedy output."""
from __future__ import annotations

import pytest

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.ipc.settings import SettingsChange
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.test_engine_tiny import random_prompts


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


def run(llm, prompts, changes_at=None):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    streamed = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished():
        if changes_at and step in changes_at:
            engine.reconfigure(**changes_at[step])
        for d in engine.step().outputs:
            streamed[d.request_id] += d.token_ids
        step += 1
    outs = [engine.pop_output(i) for i in ids]
    for o in outs:
        assert streamed[o.request_id] == o.token_ids  # the stream continued, nothing repeated
    return outs


def test_block_size_and_budget_change_mid_generation(path):
    prompts = random_prompts([7, 30, 12], seed=3)
    base = run(LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64)), prompts)
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64))
    outs = run(llm, prompts, {3: {"block_size": 2, "num_kv_blocks": 200},
                              9: {"block_size": 32, "num_kv_blocks": 12,
                                  "enable_prefix_caching": False, "max_num_seqs": 2}})
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.stats()
    assert (stats.block_size, stats.num_kv_blocks) == (32, 12)
    assert stats.num_free_blocks == 12


def test_kv_dtype_change_keeps_every_request(path):
    prompts = random_prompts([7, 30, 12], seed=4)
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64))
    outs = run(llm, prompts, {4: {"kv_dtype": "bfloat16"}})
    assert all(len(o.token_ids) == 20 for o in outs)
    assert llm.stats().kv_dtype == "bfloat16"


def test_refused_reconfigure_keeps_the_old_pool(path):
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64))
    engine = llm.engine
    rid = engine.add_request(random_prompts([40], seed=1)[0],
                             SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="block_size"):
        engine.reconfigure(block_size=3)
    with pytest.raises(ValueError, match="cannot hold"):
        engine.reconfigure(num_kv_blocks=2)
    with pytest.raises(ValueError, match="model"):
        engine.reconfigure(model="other")
    assert (llm.stats().block_size, llm.stats().num_kv_blocks) == (8, 64)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_output(rid).token_ids) == 5


def test_a_typed_change_applies_and_a_bad_value_is_refused_naming_it(path):
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64,
                           kv_cache_bytes=2**20))
    engine = llm.engine
    pool = engine.pool
    engine.reconfigure(SettingsChange(scheduling_policy="fcfs", num_speculative_tokens=3))
    assert engine.pool is pool  # in place: the pool, its cache and the queues stay
    assert (engine.config.scheduling_policy, engine.scheduler.policy) == ("fcfs", "fcfs")
    for options, words in [({"max_num_seqs": 0}, "SettingsChange.max_num_seqs=0 is invalid"),
                           ({"kv_dtype": "float8"}, "SettingsChange.kv_dtype='float8'"),
                           ({"block_size": "8"}, "SettingsChange.block_size='8'"),
                           ({"device": "cpu"}, "cannot reconfigure ['device']")]:
        with pytest.raises(ValueError) as err:
            engine.reconfigure(**options)
        assert words in str(err.value)
    with pytest.raises(ValueError, match="not both"):
        engine.reconfigure(SettingsChange(block_size=4), block_size=4)
    assert engine.pool is pool and engine.config.max_num_seqs == 64
    engine.reconfigure(SettingsChange(block_size=4, num_kv_blocks=0))  # 0: size from budget
    assert engine.config.num_kv_blocks is None and engine.pool is not pool
    assert llm.stats().num_kv_blocks == 2**20 // (4 * llm.stats().kv_bytes_per_token)
