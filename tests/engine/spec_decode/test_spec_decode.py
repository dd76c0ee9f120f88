"""Speculative decoding: greedy output with drafts equals greedy output without, token for
token, whatever the drafts; blocks and the prefix cache stay exact (tiny random models)."""
from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.spec_decode import decoder as spec_decode
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.spec_decode.spec_oracle import Oracle

VOCAB = 256


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny per-sequence attention calls: one torch thread beats two fighting over a loaded
    machine's cores many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


def run(path, prompts, params, **config):
    llm = LLM(EngineConfig(model=path, **config))
    outs = llm.generate(prompts, params)
    return llm, outs


def references(path, prompts, params, **config):
    _, outs = run(path, prompts, params, **config)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}, outs


def assert_no_block_held(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def assert_same(outs, ref_outs):
    for o, r in zip(outs, ref_outs, strict=True):
        assert o.token_ids == r.token_ids
        assert o.text == r.text
        assert o.finish_reason == r.finish_reason


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_with_drafts_equals_greedy_without(tiny, block_size, monkeypatch):
    prompts = prompts_of([5, 37, 90, 1, 16], seed=block_size)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = dict(block_size=block_size, num_kv_blocks=4096 // block_size,
                  max_num_batched_tokens=48)
    refs, ref_outs = references(tiny, prompts, params, **config)
    oracle = Oracle(refs, VOCAB)
    monkeypatch.setattr(spec_decode, "propose_matched", oracle.matched)
    llm, outs = run(tiny, prompts, params, speculative_method="ngram",
                    num_speculative_tokens=5, **config)
    assert_same(outs, ref_outs)
    c = llm.engine.spec.counters
    # Every path ran: accepted runs, rejections, and whole drafts accepted.
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert c.accepted_per_pos[4] > 0
    assert llm.engine.num_steps < sum(len(o.token_ids) for o in outs) // 2 + 10
    assert_no_block_held(llm)
    # The back-off's prior for new requests: one first verify per request that drafted.
    first = list(llm.engine.spec.backoff._first_verifies)
    assert len(first) == len(prompts) and all(1 <= t <= 6 for t in first)


def test_real_ngram_drafts_keep_greedy_exact(tiny):
    """The n-gram proposer itself (no oracle) on prompts that repeat."""
    base = prompts_of([12], seed=5)[0]
    prompts = [base * 3, base[:5] * 4 + [7]]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    _, ref_outs = run(tiny, prompts, params, block_size=4, num_kv_blocks=256)
    llm, outs = run(tiny, prompts, params, block_size=4, num_kv_blocks=256,
                    speculative_method="ngram", prompt_lookup_min=1)
    assert_same(outs, ref_outs)
    assert llm.engine.spec.counters.num_drafts > 0
    assert_no_block_held(llm)


def test_preemption_with_drafts_keeps_outputs_exact(tiny, monkeypatch):
    prompts = prompts_of([20, 30, 25, 18], seed=7)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    config = dict(block_size=4, num_kv_blocks=26, max_num_batched_tokens=64)
    refs, ref_outs = references(tiny, prompts, params, **config)
    monkeypatch.setattr(spec_decode, "propose_matched", Oracle(refs, VOCAB, error_rate=0.2).matched)
    llm, outs = run(tiny, prompts, params, speculative_method="ngram", **config)
    assert llm.stats().num_preemptions > 0
    assert_same(outs, ref_outs)
    assert llm.engine.spec.counters.num_accepted_tokens > 0
    assert_no_block_held(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 7, 11])
def test_max_tokens_inside_an_accepted_run(tiny, max_tokens, monkeypatch):
    prompts = prompts_of([9, 14], seed=2)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    refs, ref_outs = references(tiny, prompts, params, block_size=4, num_kv_blocks=64)
    long_refs, _ = references(tiny, prompts, SamplingParams(max_tokens=30, ignore_eos=True),
                              block_size=4, num_kv_blocks=64)
    # Perfect drafts, longer than what is left: a run always crosses max_tokens.
    monkeypatch.setattr(spec_decode, "propose_matched",
                        Oracle(long_refs, VOCAB, error_rate=0.0).matched)
    llm, outs = run(tiny, prompts, params, block_size=4, num_kv_blocks=64,
                    speculative_method="ngram", num_speculative_tokens=8)
    assert_same(outs, ref_outs)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    assert_no_block_held(llm)


def test_stop_token_and_stop_string_inside_an_accepted_run(tiny, monkeypatch):
    prompts = prompts_of([11], seed=4)
    long_refs, long_outs = references(tiny, prompts, SamplingParams(max_tokens=30,
                                                                    ignore_eos=True))
    ids = long_outs[0].token_ids
    monkeypatch.setattr(spec_decode, "propose_matched",
                        Oracle(long_refs, VOCAB, error_rate=0.0).matched)
    text = long_outs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text[-2:]
    for params in (SamplingParams(max_tokens=30, stop_token_ids=[ids[9]]),
                   SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])):
        _, ref_outs = run(tiny, prompts, params)
        llm, outs = run(tiny, prompts, params, speculative_method="ngram",
                        num_speculative_tokens=8)
        assert_same(outs, ref_outs)
        assert outs[0].finish_reason == "stop"
        assert_no_block_held(llm)


def test_prefix_cache_registers_only_accepted_tokens(tiny, monkeypatch):
    """A request reusing another's generated blocks gets the same output: a block hashed
    with a rejected draft in it would hand it wrong K/V."""
    first = prompts_of([21], seed=9)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = dict(block_size=4, num_kv_blocks=256)
    refs, ref_first = references(tiny, [first], params, **config)
    second = first + ref_first[0].token_ids[:30]
    refs2, ref_second = references(tiny, [second], params, **config)
    monkeypatch.setattr(spec_decode, "propose_matched", Oracle({**refs, **refs2}, VOCAB).matched)
    llm = LLM(EngineConfig(model=tiny, speculative_method="ngram", **config))
    out1 = llm.generate([first], params)
    out2 = llm.generate([second], params)
    assert_same(out1 + out2, ref_first + ref_second)
    assert out2[0].num_cached_tokens >= 48  # the generated blocks were shared
    bm = llm.engine.block_manager
    hashed = [b for b in bm.blocks if b.hash is not None]
    tokens = second + out2[0].token_ids
    for b in hashed:  # every registered block holds tokens of the real sequences
        n = len(b.token_ids)
        assert any(tuple(tokens[i:i + n]) == b.token_ids for i in range(0, len(tokens), n))
    assert_no_block_held(llm)


def test_abort_storm_with_drafts_leaks_no_block(tiny, monkeypatch):
    prompts = prompts_of([7, 19, 33, 4, 25, 12, 40, 9], seed=1)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    refs, _ = references(tiny, prompts, params, block_size=4, num_kv_blocks=512)
    monkeypatch.setattr(spec_decode, "propose_matched", Oracle(refs, VOCAB).matched)
    llm = LLM(EngineConfig(model=tiny, block_size=4, num_kv_blocks=120,
                           speculative_method="ngram", num_speculative_tokens=6))
    engine, rng = llm.engine, random.Random(0)
    ids = []
    for _round in range(6):
        ids += [engine.add_request(p, params) for p in prompts]
        for _ in range(8):
            engine.step()
            live = [i for i in ids if not engine.requests[i].is_finished]
            for i in rng.sample(live, k=min(len(live), 2)):
                engine.abort_request(i)
    while engine.has_unfinished():
        engine.step()
    assert engine.spec.counters.num_drafts > 0
    assert_no_block_held(llm)


def test_a_request_may_turn_speculation_off(tiny):
    base = prompts_of([12], seed=5)[0]
    llm, _ = run(tiny, [base * 3], SamplingParams(max_tokens=40, ignore_eos=True,
                                                  speculative=False),
                 speculative_method="ngram", prompt_lookup_min=1)
    assert llm.engine.spec.counters.num_drafts == 0


def test_reconfigure_turns_speculation_on_in_place(tiny):
    llm = LLM(EngineConfig(model=tiny, block_size=4, num_kv_blocks=64))
    pool = llm.engine.pool
    llm.engine.reconfigure(speculative_method="ngram", num_speculative_tokens=3)
    assert llm.engine.pool is pool  # no rebuild for a speculation setting
    assert llm.engine.spec.enabled and llm.engine.spec.k == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        llm.engine.reconfigure(num_speculative_tokens=0)
    assert llm.engine.spec.k == 3


def test_a_step_that_carries_a_prompt_chunk_drafts_nothing(tiny, monkeypatch):
    """The back-off measures drafts in pure decode steps; beside a prompt chunk the step
    takes another path, so no one drafts there, and drafting resumes once the chunk is in."""
    first, second = prompts_of([9, 100], seed=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    # room for drafts beside each chunk: 64 a step, prompt chunks of 32 while decodes run
    config = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64,
                  max_prefill_tokens_while_decoding=32)
    refs, ref_outs = references(tiny, [first, second], params, **config)
    monkeypatch.setattr(spec_decode, "propose_matched", Oracle(refs, VOCAB).matched)
    llm = LLM(EngineConfig(model=tiny, speculative_method="ngram", **config))
    engine = llm.engine
    a = engine.add_request(first, params)
    engine.step()  # its prompt
    engine.step()
    assert [v.request_id for v in engine.spec.last_step] == [a]  # a decode step drafts
    b = engine.add_request(second, params)
    chunk_steps = 0
    while engine.requests[b].num_computed_tokens < len(second):
        engine.step()
        chunk_steps += 1
        assert engine.spec.last_step == []
    assert chunk_steps >= 3  # 100 prompt tokens at most 32 a step
    while engine.has_unfinished():
        engine.step()
    assert engine.spec.counters.num_drafts > 2
    assert [engine.pop_output(r).token_ids for r in (a, b)] == [o.token_ids for o in ref_outs]
    assert_no_block_held(llm)


def test_the_back_off_is_told_the_match_and_whether_it_is_the_longest(tiny, monkeypatch):
    """A 2-gram turns up in any reply; only a match of prompt_lookup_max tokens speaks for a
    request whose own drafts did not pay (engine/spec_decode/backoff.py)."""
    from kvscope.engine.spec_decode.backoff import BackOff

    lengths = iter([2, 3, 4] * 100)
    monkeypatch.setattr(spec_decode, "propose_matched",
                        lambda t, lo, hi, k: ([int(t[-1])] * k, next(lengths)))
    told: list[int] = []
    pays = BackOff.pays

    def spy(self, batch_size, acceptance, most=None, match=0, longest=False):
        told.append((match, longest))
        return pays(self, batch_size, acceptance, most, match, longest)

    monkeypatch.setattr(BackOff, "pays", spy)
    run(tiny, prompts_of([6]), SamplingParams(max_tokens=12, ignore_eos=True),
        speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    assert set(told) == {(2, False), (3, False), (4, True)}
