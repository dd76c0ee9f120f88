"""Engine vs Hugging Face generate on tiny random Llama and Qwen2 checkpoints (fast)."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Reference runs as ignore_eos: no EOS handling at all (min_new_tokens would instead
    # mask EOS out of the logits and change the greedy choice).
    hf.generation_config.eos_token_id = None
    return path, hf


def random_prompts(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_greedy_matches_hf_for_a_mixed_batch(tiny, block_size):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=block_size, num_kv_blocks=2048 // block_size,
                           max_num_batched_tokens=48))
    prompts = random_prompts([5, 37, 90, 1, 16], seed=block_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 24)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
    assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(tiny):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=24,
                           max_num_batched_tokens=64))
    prompts = random_prompts([20, 30, 25, 18], seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 30)


def test_chunked_prefill_spreads_a_long_prompt_over_steps(tiny):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64,
                           max_num_batched_tokens=16))
    prompt = random_prompts([100], seed=11)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 5)
    # 100 prompt tokens at 16 per step need 7 steps before the first token, then 4 decodes.
    assert llm.stats().num_steps == 7 + 4


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny):
    path, _ = tiny
    shared = random_prompts([64], seed=5)[0]
    prompts = [shared + [1, 2, 3], shared + [9, 8]]
    peaks = {}
    outputs = {}
    for caching in (False, True):
        llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=128,
                               enable_prefix_caching=caching))
        engine = llm.engine
        ids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
               for p in prompts]
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.block_manager.num_used_blocks)
        peaks[caching] = peak
        outputs[caching] = [engine.pop_output(i).token_ids for i in ids]
    assert outputs[True] == outputs[False]
    assert peaks[True] <= peaks[False] - 64 // 8 + 1


def test_prefix_cache_hit_on_a_later_request(tiny):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=128))
    prompt = random_prompts([40], seed=2)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 36  # all full blocks but the one with the last token
    assert second.token_ids == first.token_ids == hf_greedy(hf, prompt, 6)


def test_seeded_sampling_is_reproducible_and_varies_with_seed(tiny):
    path, _ = tiny
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=64))
    prompt = random_prompts([10], seed=1)[0]

    def run(seed):
        p = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=seed,
                           ignore_eos=True)
        return llm.generate([prompt, prompt], [p, p])

    a, b = run(123), run(123)
    assert a[0].token_ids == b[0].token_ids == a[1].token_ids
    assert run(124)[0].token_ids != a[0].token_ids


def test_stop_token_ids_and_eos_end_the_reply(tiny):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=64))
    prompt = random_prompts([12], seed=4)[0]
    ref = hf_greedy(hf, prompt, 12)
    stop_at = ref[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:ref.index(stop_at) + 1]


def test_abort_frees_blocks_and_others_continue(tiny):
    path, hf = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64))
    engine = llm.engine
    prompts = random_prompts([10, 12], seed=9)
    a = engine.add_request(prompts[0], SamplingParams(max_tokens=20, ignore_eos=True))
    b = engine.add_request(prompts[1], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort_request(a)
    assert not engine.abort_request("no-such-request")
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(a).finish_reason == "abort"
    assert engine.pop_output(b).token_ids == hf_greedy(hf, prompts[1], 20)
    assert engine.block_manager.num_free_blocks == 64


def test_step_returns_what_it_scheduled_and_what_came_out(tiny):
    path, _ = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64,
                           max_num_batched_tokens=16))
    engine = llm.engine
    idle = engine.step()
    assert (idle.scheduled, idle.outputs, idle.ran) == ([], [], False)
    long_id = engine.add_request(random_prompts([20], seed=2)[0],
                                 SamplingParams(max_tokens=2, ignore_eos=True))
    first = engine.step()  # 16 of the 20 prompt tokens: a prefill chunk, nothing sampled
    assert [(s.seq.request_id, s.num_tokens) for s in first.scheduled] == [(long_id, 16)]
    assert first.ran and first.outputs == []
    short_id = engine.add_request([5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    second = engine.step()  # the rest of the long prompt and all of the short one
    assert [(s.seq.request_id, s.num_tokens) for s in second.scheduled] == \
        [(long_id, 4), (short_id, 2)]
    assert sorted(d.request_id for d in second.outputs) == sorted([long_id, short_id])
    assert all(len(d.token_ids) == 1 for d in second.outputs)
    third = engine.step()  # both decode one token and finish
    assert [s.num_tokens for s in third.scheduled] == [1, 1]
    assert all(d.finished and d.finish_reason == "length" for d in third.outputs)
    assert engine.num_steps == 3


def test_the_engine_has_every_attribute_from_init_on(tiny, request):
    """No attribute appears later (after a step or a pool rebuild): readers never probe."""
    path, _ = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64))
    engine = llm.engine
    at_init = set(vars(engine))
    assert engine._k_balance_layers is None  # not calibrated until a pool wants it
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    # Calibrated on the tiny Llama only: the tiny Qwen2's tokenizer turns the calibration
    # text into no tokens at all (and engine.kv_cache.calibration then fails inside torch).
    rotation = "calibrated" if request.node.callspec.params["tiny"] == "llama" else "hadamard"
    engine.reconfigure(block_size=8, kv_dtype="int8", kv_rotation=rotation)
    assert (engine._k_balance_layers is not None) == (rotation == "calibrated")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert set(vars(engine)) == at_init
    assert engine.scheduler is not None and engine.pool is not None
