"""The step's host fast paths give what the plain versions give: the numpy greedy argmax,
the memoising decoder, the packed model inputs and the scheduler's inline block arithmetic."""
from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.detokenizer import Decoder, decode_delta
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.sampler import greedy_tokens, make_generator, sample, sample_row
from kvscope.engine.scheduling.scheduler import ScheduledSeq, Scheduler
from kvscope.engine.sequence import Sequence
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("host") / "m", seed=1)


# -- sampler -------------------------------------------------------------------------------
def test_greedy_tokens_equal_torch_argmax_with_ties_nan_and_inf():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (40, 50), generator=g).float()  # many ties
    logits[3, 7] = float("nan")
    logits[4] = float("-inf")
    logits[5, [2, 9]] = float("inf")
    logits[6, [1, 30]] = float("nan")
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    half = logits.bfloat16()  # not float32: the torch path
    assert greedy_tokens(half) == half.argmax(dim=-1).tolist()


def test_sample_rows_are_argmax_or_the_seeded_per_row_draw():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    temps = [0.0, 0.8, 0.0, 1.3, 0.0]
    seqs = []
    for i, t in enumerate(temps):
        seq = Sequence(f"r{i}", [1, 2], SamplingParams(temperature=t, top_k=10, seed=i))
        seq.generator = make_generator(100 + i)
        seqs.append(seq)
    tokens = sample(logits, seqs)
    for i, (seq, t) in enumerate(zip(seqs, temps, strict=True)):
        if t == 0:
            assert tokens[i] == int(logits[i].argmax())
        else:
            replay = Sequence("x", [1], seq.params)
            replay.generator = make_generator(100 + i)
            assert tokens[i] == sample_row(logits[i], replay)


# -- detokenizer ---------------------------------------------------------------------------
def test_decoder_memo_returns_what_the_tokenizer_decodes(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    decode = Decoder(tok)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(0, 256) for _ in range(rng.choice([1, 1, 2, 3]))]
        for _ in range(2):  # the second single-token call is served from the memo
            assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_streamed_deltas_add_up_to_the_full_decode(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    decode = Decoder(tok)
    rng = random.Random(1)
    prompt = [rng.randrange(0, 250) for _ in range(9)]
    seq = Sequence("r", prompt, SamplingParams())
    text = ""
    for _ in range(40):
        seq.token_ids.append(rng.randrange(0, 256))
        text += decode_delta(decode, seq)
    # This tokenizer's tokens are whole characters, so nothing is held back at the end.
    assert text == tok.decode(seq.output_token_ids, skip_special_tokens=True)


# -- model inputs --------------------------------------------------------------------------
def reference_inputs(batch: list[ScheduledSeq], bs: int):
    """The step's inputs built the plain way: a tensor per field from nested lists."""
    ids, pos, slots, tables = [], [], [], []
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        for p in range(start, start + item.num_tokens):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        tables.append(seq.block_table)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return [torch.tensor(x, dtype=torch.long) for x in (ids, pos, slots, padded)]


def test_packed_inputs_equal_per_field_tensors_and_follow_table_changes(tiny):
    llm = LLM(EngineConfig(model=str(tiny), device="cpu", block_size=4, num_kv_blocks=64,
                           max_num_batched_tokens=30))
    engine = llm.engine
    rng = random.Random(2)
    for n in (3, 11, 40, 6):
        engine.add_request([rng.randrange(0, 250) for _ in range(n)],
                           SamplingParams(max_tokens=12, ignore_eos=True))
    checked = 0
    original = engine.runner.prepare

    def prepare(batch):
        ids, pos, meta, last_rows = original(batch)
        want = reference_inputs(batch, 4)
        got = [ids, pos, meta.slot_mapping, meta.block_tables]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.long and torch.equal(g, w)
        ends = [i.seq.num_computed_tokens + i.num_tokens for i in batch]
        assert meta.context_lens == ends
        nonlocal checked
        checked += 1
        return ids, pos, meta, last_rows

    engine.runner.prepare = prepare
    while engine.has_unfinished():
        engine.step()
    # Prefill chunks, mixed steps and decodes across block boundaries were all compared.
    assert checked >= 12


# -- scheduler -----------------------------------------------------------------------------
def test_a_decode_registers_its_block_the_step_it_fills():
    bs = 4
    bm = BlockManager(16, bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20))
    sched.add(seq)
    registered = []
    for step in range(10):
        batch = sched.schedule()
        (item,) = batch
        registered.append(len(bm.hash_to_block))
        assert len(seq.block_table) * bs >= seq.num_computed_tokens + item.num_tokens
        seq.num_computed_tokens += item.num_tokens
        seq.token_ids.append(100 + step)
    # Tokens computed after each step: 3, 4, 5, ... ; block k is full once 4(k+1) are.
    assert registered == [(3 + s) // bs for s in range(10)]
    assert len(seq.block_table) == -(-12 // bs)  # the last step wrote position 11


def test_lazy_decode_groups_are_the_reference_grouping():
    from kvscope.engine.model_runner import DecodeGroups
    from kvscope.kernels.attention_ref import group_decode_rows

    rng = random.Random(3)
    q_lens = [rng.choice([1, 1, 1, 5]) for _ in range(30)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    ctx = [rng.randint(n, 400) for n in q_lens]
    want = group_decode_rows(starts, ctx)
    lazy = DecodeGroups(starts, ctx)
    assert len(lazy) == len(want) > 1
    for got_group, want_group in zip(lazy, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got_group, want_group, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(lazy[-1], want[-1], strict=True))
