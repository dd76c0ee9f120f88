"""Sliding-window memory: an all-windowed model (Mistral v0.1 style) frees each sequence's
blocks behind its window every step, and still matches Hugging Face generate."""
from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.kv_cache.block_manager import FREED, BlockManager
from kvscope.engine.model.family import layer_windows
from kvscope.engine.sampling_params import SamplingParams as Params
from kvscope.engine.sequence import Sequence
from kvscope.engine.server.snapshots import blocks_frame
from kvscope.ipc import messages as m
from kvscope.kvmath.kv_size import sequence_blocks, shape_from_config
from kvscope.testing import hf_reference
from kvscope.testing.tiny_models import save_tiny_model

WINDOW, BS = 8, 4


def save_tiny_mistral(path, window: int | None = WINDOW, seed: int = 3):
    return save_tiny_model(path, arch="mistral", seed=seed, sliding_window=window)


@pytest.fixture(params=["ref", "auto"])
def kernels(request, monkeypatch):
    """The torch reference kernels, and the ones the device picks (the native CPU decode
    here): both must skip the -1 entries."""
    monkeypatch.setenv("KVSCOPE_KERNELS", request.param)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny_mistral(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def hf_mistral(mistral):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]


HF_OUTPUTS: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def hf_greedy(hf, prompt, n):
    """Hugging Face's greedy continuation, computed once per model, prompt and length."""
    key = (id(hf), tuple(prompt), n)
    if key not in HF_OUTPUTS:
        HF_OUTPUTS[key] = hf_reference.hf_greedy(hf, prompt, n)
    return HF_OUTPUTS[key]


def json_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def held(seq: Sequence) -> int:
    return sum(1 for b in seq.block_table if b != FREED)


def make_llm(path, **kw) -> LLM:
    cfg = {"model": str(path), "block_size": BS, "num_kv_blocks": 64, "dtype": "float32",
           "kv_dtype": "float32", "max_num_batched_tokens": 32, **kw}
    return LLM(EngineConfig(**cfg))


def engine(path, **kw):
    return make_llm(path, **kw).engine


def run_tracking_peak(eng, request_ids):
    """Step to the end; the most blocks any of the requests held at once (after a step)."""
    seqs = [eng.requests[r] for r in request_ids]
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max([peak] + [held(s) for s in seqs if not s.is_finished])
    return peak


# -- the block manager alone -----------------------------------------------------------------
def seq_with(bm: BlockManager, num_tokens: int, computed: int) -> Sequence:
    seq = Sequence("r", list(range(num_tokens)), Params())
    bm.allocate(seq, [], num_tokens)
    seq.num_computed_tokens = computed
    return seq


def test_frees_exactly_the_blocks_behind_the_window():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    seq = seq_with(bm, 21, 21)  # 6 blocks; the next query is position 21
    table = list(seq.block_table)
    # Keys 21 - 8 + 1 = 14 onwards stay: blocks 0..2 (tokens 0..11) are dead, block 3 (12..15)
    # still holds 14 and 15.
    freed = bm.free_behind_window(seq, WINDOW)
    assert sorted(freed) == sorted(table[:3])
    assert seq.block_table == [FREED] * 3 + table[3:]
    assert bm.num_free_blocks == 16 - 3
    assert bm.free_behind_window(seq, WINDOW) == []  # idempotent
    seq.num_computed_tokens = 22  # position 22: key 15 is the oldest needed, block 3 stays
    assert bm.free_behind_window(seq, WINDOW) == []
    seq.num_computed_tokens = 24  # key 17 is the oldest: block 3 (12..15) goes
    assert bm.free_behind_window(seq, WINDOW) == [table[3]]
    bm.free(seq)
    assert bm.num_free_blocks == 16 and seq.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_window_zero_or_short_sequence_frees_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = seq_with(bm, 10, 8)
    assert bm.free_behind_window(seq, 0) == []
    assert bm.free_behind_window(seq, WINDOW) == []  # keys 1.. still needed
    assert held(seq) == 3


def test_shared_prefix_blocks_are_decrefd_and_stay_cached():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    tokens = list(range(17))
    a = Sequence("a", tokens, Params())
    bm.allocate(a, [], 17)
    bm.commit_full_blocks(a, 0, 17)
    a.num_computed_tokens = 17
    b = Sequence("b", tokens + [99], Params())
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:4]
    bm.allocate(b, hits, 2)
    freed = bm.free_behind_window(a, WINDOW)  # keys 10.. stay: blocks 0 and 1 go from a
    assert sorted(freed) == sorted(hits[:2])
    assert [bm.blocks[x].ref_count for x in hits[:2]] == [1, 1]  # b still holds them
    bm.free(b)
    # Now nobody holds them: back to the prefix cache, still findable by a new request.
    assert all(x in bm.cached_free for x in hits[:2])
    assert bm.match_prefix(Sequence("c", tokens, Params()))[:2] == hits[:2]
    bm.free(a)
    assert bm.num_free_blocks == 16


# -- the engine ------------------------------------------------------------------------------
@pytest.mark.usefixtures("kernels")
def test_all_windowed_model_frees_its_blocks_behind_the_window(mistral):
    eng = engine(mistral)
    assert eng.reclaim_window == WINDOW
    rid = eng.add_request(prompts([10])[0], SamplingParams(max_tokens=60, ignore_eos=True))
    peak = run_tracking_peak(eng, [rid])
    # Keys p-7..p of a query at p touch at most 3 blocks of 4, whatever the length (70
    # tokens would be 18 blocks): what the calculator and kv-calc count per sequence.
    assert peak == 3 == sequence_blocks(shape_from_config(json_config(mistral)), 70, BS)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_global_model_keeps_every_block(tmp_path):
    path = save_tiny_mistral(tmp_path / "global", window=None)
    eng = engine(path)
    assert eng.reclaim_window == 0
    rid = eng.add_request(prompts([10])[0], SamplingParams(max_tokens=60, ignore_eos=True))
    # Before its last step the request has 68 positions computed: 17 blocks, all kept.
    assert run_tracking_peak(eng, [rid]) == -(-68 // BS)


@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])
def test_a_mixed_model_keeps_one_full_table(tmp_path, arch):
    """Windowed and global layers share one block table: nothing is freed."""
    path = save_tiny_model(tmp_path / arch, arch=arch, seed=3)
    eng = engine(path, max_model_len=256)
    windows = layer_windows(eng.loaded.hf_config)
    assert 0 in windows and WINDOW in windows
    assert eng.reclaim_window == 0
    rid = eng.add_request(prompts([10])[0], SamplingParams(max_tokens=30, ignore_eos=True))
    assert run_tracking_peak(eng, [rid]) == -(-38 // BS)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("caching", [False, True])
def test_output_equals_hf_generate(mistral, hf_mistral, caching):
    shared = prompts([13], seed=2)[0]
    batch = [shared + [5, 6, 7], shared + [9], prompts([3], seed=4)[0], prompts([30], seed=5)[0]]
    llm = make_llm(mistral, enable_prefix_caching=caching, max_num_batched_tokens=16)
    outs = llm.generate(batch, SamplingParams(max_tokens=40, ignore_eos=True))
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_mistral, prompt, 40)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if caching:
        assert outs[1].num_cached_tokens > 0


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("caching", [False, True])
def test_no_block_leaks_after_abort_and_preemption(mistral, hf_mistral, caching):
    # A pool this small preempts: 4 requests whose windows need 3 blocks each, 10 blocks.
    eng = engine(mistral, num_kv_blocks=10, enable_prefix_caching=caching,
                 max_num_batched_tokens=64)
    batch = prompts([9, 14, 11, 6], seed=9)
    ids = [eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in batch]
    for _ in range(12):
        eng.step()
    assert eng.abort_request(ids[2])
    outputs = {}
    while eng.has_unfinished():
        eng.step()
    for i in (0, 1, 3):
        outputs[i] = eng.pop_output(ids[i]).token_ids
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert eng.scheduler.num_preemptions > 0
    for i, out in outputs.items():
        assert out == hf_greedy(hf_mistral, batch[i], 30)


@pytest.mark.usefixtures("kernels")
def test_snapshot_frames_show_the_freed_blocks_as_free(mistral):
    eng = engine(mistral, enable_prefix_caching=False)
    rid = eng.add_request(prompts([6])[0], SamplingParams(max_tokens=40, ignore_eos=True))
    seq = eng.requests[rid]
    before = None
    while FREED not in seq.block_table or before is None:
        frame = blocks_frame(eng, 0)
        before = set(seq.block_table)
        eng.step()
    gone = before - set(seq.block_table) - {FREED}
    assert gone
    frame = blocks_frame(eng, 1)
    flags = frame.array("flags") & m.BLOCK_STATE_MASK
    owner, refs = frame.array("owner"), frame.array("ref_count")
    for b in gone:
        assert flags[b] == m.BLOCK_FREE and owner[b] == -1 and refs[b] == 0
    live = [b for b in seq.block_table if b != FREED]
    assert all(flags[b] == m.BLOCK_USED and owner[b] == 0 for b in live)
    assert frame.used == len(live) and frame.free == eng.block_manager.num_blocks - len(live)
    # The table keeps its logical layout: -1 where a block left.
    assert frame.block_table(rid) == seq.block_table
    assert frame.tokens_stored == sum(frame.array("filled"))
