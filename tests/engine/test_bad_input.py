"""Bad input gets a clear error naming what was wrong, and the engine keeps serving."""
from __future__ import annotations

import pytest

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=1)
    return LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=32, max_model_len=64))


@pytest.mark.parametrize("field,value,words", [
    ("block_size", 3, "power of two"),
    ("block_size", 512, "power of two"),
    ("kv_dtype", "float8", "kv_dtype"),
    ("max_num_seqs", 0, "max_num_seqs"),
    ("device", "tpu", "device"),
    ("kv_cache_bytes", -1, "kv_cache_bytes"),
])
def test_invalid_config_names_field_and_value(field, value, words):
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("kwargs,field", [({"max_tokens": 0}, "max_tokens"),
                                          ({"max_tokens": -3}, "max_tokens"),
                                          ({"temperature": -1.0}, "temperature"),
                                          ({"top_p": 0.0}, "top_p")])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope"):
        LLM(EngineConfig(model=missing))


def test_bad_requests_fail_alone_while_others_finish(llm):
    engine = llm.engine
    good = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(1, 80)), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 99999], SamplingParams())
    mutated = SamplingParams()
    mutated.max_tokens = 0  # changed after construction: the engine validates again
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], mutated)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(good)
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 32


def test_generate_checks_every_prompt_before_queueing_any(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2, 3], list(range(1, 100))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_prompt_larger_than_the_pool_is_rejected(tmp_path):
    path = save_tiny_model(tmp_path, "llama", seed=1)
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=4))
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([list(range(1, 30))], SamplingParams(max_tokens=2))


def test_a_request_outgrowing_the_whole_pool_ends_with_length(tmp_path):
    path = save_tiny_model(tmp_path, "llama", seed=1)
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=4))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 16 + 1
    assert llm.stats().num_free_blocks == 4
