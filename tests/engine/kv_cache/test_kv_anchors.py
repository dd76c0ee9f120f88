"""Anchor tokens (engine/kv_cache/anchors.py, kernels/anchors.py): the table's bookkeeping, the
torch reference and the native CPU kernel against float64, and the engine keeping the first
positions of each opening exact beside an int8 pool."""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.kv_cache.anchors import AnchorTable
from kvscope.kernels import cpu_attention, native
from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.quant import dequantize, quantize
from tests.kernels.test_attention_ref import build_batch, reference

A, B, C = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)


# -- the table ------------------------------------------------------------------------------
def test_a_new_opening_claims_an_entry_and_is_filled_by_its_first_rows():
    t = AnchorTable(4, num_entries=2)
    plan = t.plan_step([(A, 0, 10, 0), (B, 0, 6, 10)])
    assert plan.index == [0, 1]
    assert plan.fill_rows == [0, 1, 2, 3, 10, 11, 12, 13]
    assert plan.fill_slots == [0, 1, 2, 3, 4, 5, 6, 7]
    t.commit()
    # Later steps (decode, or another request with the same opening) find it, fill nothing.
    plan = t.plan_step([(A, 10, 11, 0), (A, 0, 9, 1)])
    assert plan.index == [0, 0] and plan.fill_rows == []


def test_without_a_computed_opening_there_is_no_entry():
    t = AnchorTable(4, num_entries=2)
    # Too short to have an opening; a chunk that stops short of it; a prefix-cache hit on an
    # opening the table does not hold: all attend to the quantized rows.
    plan = t.plan_step([(None, 0, 3, 0), (A, 0, 3, 3), (B, 16, 20, 6)])
    assert plan.index == [-1, -1, -1] and plan.fill_rows == [] and not t.entries


def test_the_least_recently_used_entry_is_evicted_but_never_one_in_use_this_step():
    t = AnchorTable(4, num_entries=2)
    t.plan_step([(A, 0, 5, 0), (B, 0, 5, 5)])
    t.commit()
    t.plan_step([(A, 5, 6, 0)])  # A used: B is now the least recent
    t.commit()
    plan = t.plan_step([(C, 0, 5, 0)])
    assert plan.index == [1] and set(t.entries) == {A, C}
    t.commit()
    # Both entries used in this step: a third opening goes without rather than evict one.
    plan = t.plan_step([(A, 6, 7, 0), (C, 5, 6, 1), (B, 0, 5, 2)])
    assert plan.index == [0, 1, -1] and plan.fill_rows == []


def test_an_entry_whose_step_never_ran_is_dropped():
    t = AnchorTable(4, num_entries=1)
    t.plan_step([(A, 0, 5, 0)])
    # No commit: the forward failed, the rows were never written.
    plan = t.plan_step([(A, 5, 6, 0)])
    assert plan.index == [-1] and not t.entries
    plan = t.plan_step([(B, 0, 5, 0)])
    assert plan.index == [0]


def test_a_table_needs_tokens_and_entries():
    with pytest.raises(ValueError, match="anchor table"):
        AnchorTable(0)


# -- the kernels ----------------------------------------------------------------------------
def anchored_batch(block_size, n, dtype=torch.int8, seed=0):
    """A quantized pool, anchor rows for two entries, sequences with and without an entry,
    and the float64 oracle's pool: the dequantized one with the anchored positions exact."""
    q_lens, ctx_lens = [1, 1, 5, 1, 1, 3], [9, 40, 12, 2, 17, 3]
    query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, block_size, 6, 2, 64,
                                              num_blocks=200, seed=seed)
    (kq, ks), (vq, vs) = quantize(kc, dtype), quantize(vc, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    ak, av = (torch.randn(2, n, 2, 64, generator=g) * 3 for _ in range(2))
    index = torch.tensor([0, 1, 1, 0, -1, 1])
    meta.anchor_index = index
    k_oracle, v_oracle = dequantize(kq, ks), dequantize(vq, vs)
    for i, table in enumerate(tables):
        if index[i] < 0:
            continue
        for p in range(min(n, ctx_lens[i])):
            k_oracle[table[p // block_size], p % block_size] = ak[index[i], p]
            v_oracle[table[p // block_size], p % block_size] = av[index[i], p]
    return query, (kq, vq, ks, vs), (ak, av), meta, tables, (k_oracle, v_oracle)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("n", [1, 4])
def test_reference_reads_the_anchor_rows_for_the_first_positions(block_size, n):
    query, (kq, vq, ks, vs), anchors, meta, tables, (ko, vo) = anchored_batch(block_size, n)
    scale = 1 / math.sqrt(64)
    got = paged_attention_ref(query, kq, vq, meta, scale, ks, vs, anchors)
    want = reference(query, ko, vo, meta, tables, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # And the anchors matter: without them the answer is the plain quantized one.
    plain = paged_attention_ref(query, kq, vq, meta, scale, ks, vs)
    assert not torch.allclose(plain.double(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_cpu_kernel_reads_the_anchor_rows_for_the_first_positions(block_size, dtype):
    query, (kq, vq, ks, vs), anchors, meta, tables, (ko, vo) = anchored_batch(
        block_size, 4, dtype, seed=block_size)
    got = cpu_attention.paged_attention_cpu(query, kq, vq, meta, 0.125, ks, vs, anchors)
    want = reference(query, ko, vo, meta, tables, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")
def test_cpu_kernel_other_head_dims_and_bfloat16_rows():
    """The generic (not head_dim 64) loop, and bfloat16 query/output rows."""
    q_lens, ctx_lens = [1, 1, 1], [7, 30, 2]
    query, kc, vc, meta, _ = build_batch(q_lens, ctx_lens, 4, 4, 2, 24, num_blocks=40,
                                              seed=5)
    (kq, ks), (vq, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
    gen = torch.Generator().manual_seed(5)  # not the global RNG: the order tests run in
    anchors = (torch.randn(1, 4, 2, 24, generator=gen) * 3,
               torch.randn(1, 4, 2, 24, generator=gen) * 3)
    meta.anchor_index = torch.tensor([0, -1, 0])
    want = paged_attention_ref(query, kq, vq, meta, 0.2, ks, vs, anchors)
    got = cpu_attention.paged_attention_cpu(query, kq, vq, meta, 0.2, ks, vs, anchors)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bfloat16 rows: against the reference over the same rounded query, so what is left is the
    # kernel's own rounding of its output to bfloat16 (2^-8 relative).
    q16 = query.bfloat16()
    want16 = paged_attention_ref(q16.float(), kq, vq, meta, 0.2, ks, vs, anchors)
    got16 = cpu_attention.paged_attention_cpu(q16, kq, vq, meta, 0.2, ks, vs, anchors)
    torch.testing.assert_close(got16.float(), want16, rtol=8e-3, atol=8e-3)


# -- the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    """The embedded model with int8 KV, with and without anchors, and float32 KV rotated and
    balanced the same way (the exact rows the anchors should hold)."""
    from kvscope.engine.loading.loader import load_model

    loaded = load_model("default", torch.float32)

    def make(**kw):
        return LLM(EngineConfig(weights="dense", **kw), loaded=loaded)

    return {"anchored": make(kv_dtype="int8"),
            "plain": make(kv_dtype="int8", kv_anchor_tokens=0),
            "exact": make(kv_dtype="float32", kv_rotation="calibrated")}


PROMPTS = ["Explain in two sentences why the sky is blue.",
           "Give three tips for writing clear code.",
           "What is the difference between a list and a tuple in Python?"]


def chat(llm, q):
    return llm.apply_chat_template([{"role": "user", "content": q}])


def finish(eng) -> None:
    while eng.has_unfinished():
        eng.step()


def test_anchor_rows_are_the_exact_rotated_and_balanced_rows(engines):
    anchored, exact = engines["anchored"].engine, engines["exact"].engine
    prompt = chat(engines["anchored"], PROMPTS[0])
    first_block = {}
    # The anchored prefill fills anchor rows, so it takes the ordinary forward; the float32
    # one's short prompt would fuse (engine.model.fused.rows), another float32 rounding order.
    fused, exact.model.fused_decode = exact.model.fused_decode, False
    try:
        for name, eng in (("anchored", anchored), ("exact", exact)):
            seq = eng.requests[eng.add_request(prompt, SamplingParams(max_tokens=2))]
            eng.step()
            first_block[name] = seq.block_table[0]
            finish(eng)
    finally:
        exact.model.fused_decode = fused
    n = anchored.pool.anchor_table.num_tokens
    entry = anchored.pool.anchor_table.entries[tuple(prompt[:n])]
    for layer in (0, 15, 29):
        ak, av = anchored.pool.anchors[layer]
        kc, vc = exact.pool.caches[layer]
        torch.testing.assert_close(ak[entry], kc[first_block["exact"], :n], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(av[entry], vc[first_block["exact"], :n], rtol=1e-5,
                                   atol=1e-5)


def test_anchors_bring_int8_closer_to_float32(engines):
    """Teacher-forced next-token distributions along float32 KV's greedy replies: int8 with
    anchors is nearer (mean KL) than int8 without, on every prompt."""
    from kvscope.engine.scoring import mean_kl, token_log_probs

    ref_llm = engines["exact"]
    for q in PROMPTS:
        prompt = chat(ref_llm, q)
        reply = ref_llm.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids
        seq = prompt + reply
        want = token_log_probs(ref_llm.engine, seq)[len(prompt) - 1:]
        kl = {name: mean_kl(want, token_log_probs(engines[name].engine, seq)[len(prompt) - 1:])
              for name in ("anchored", "plain")}
        assert kl["anchored"] < kl["plain"], (q, kl)


def test_anchors_change_no_bytes_per_token_and_report_their_table(engines):
    a, p = engines["anchored"].engine.stats(), engines["plain"].engine.stats()
    assert a.kv_bytes_per_token == p.kv_bytes_per_token
    assert a.num_kv_blocks == p.num_kv_blocks
    assert a.kv_anchor_tokens == 4 and p.kv_anchor_tokens == 0
    # 32 entries x 4 positions x (K + V) x 30 layers x 3 KV heads x 64 float32
    assert a.kv_anchor_bytes == 32 * 4 * 2 * 30 * 3 * 64 * 4 and p.kv_anchor_bytes == 0
    assert engines["exact"].engine.stats().kv_anchor_tokens == 0  # float pools keep none


def test_invalid_anchor_count_names_it():
    with pytest.raises(ValueError, match="kv_anchor_tokens"):
        EngineConfig(kv_anchor_tokens=-1)
    with pytest.raises(ValueError, match="kv_anchor_tokens"):
        EngineConfig(kv_anchor_tokens=1.5)
