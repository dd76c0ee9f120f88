"""Steps that mix decodes with prompt chunks on the fused CPU decode (engine/model/fused/rows.py):
the same hidden states and K/V as the model's ordinary forward, on the llama tiny model and on
the families with a window and soft-capping, for a chunk that starts mid-prompt (it reads the
keys of earlier chunks and its own) and on 1-byte pools."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.fused import model_view as fused_model
from kvscope.engine.model.fused import rows as fused_rows
from kvscope.kernels import native
from kvscope.kernels.attention_ref import AttentionMetadata
from kvscope.testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = save_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=3)
        return made[arch]
    return get


def make_llm(path, kv_dtype="float32", weights="dense") -> LLM:
    # budget 12: the 30-token prompt comes in chunks beside the decodes
    return LLM(EngineConfig(model=str(path), device="cpu", weights=weights, block_size=4,
                            num_kv_blocks=128, max_model_len=256, kv_dtype=kv_dtype,
                            max_num_batched_tokens=12, max_prefill_tokens_while_decoding=0))


def mixed_step(llm):
    """(input_ids, positions, meta, pool) of a step with decodes and a prompt chunk that
    starts past position 0."""
    engine, model = llm.engine, llm.engine.model
    for p in ([5, 9, 2, 7, 1], [8, 4]):
        engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    seen = []
    forward = model.forward

    def grab(ids, positions, meta, pool):
        qsl = meta.query_start_loc
        starts = [int(positions[qsl[i]]) for i in meta.prefill_seqs]
        if not seen and any(s > 0 for s in starts) and len(meta.prefill_seqs) < len(qsl) - 1:
            seen.append((ids.clone(), positions.clone(), meta, pool))
        return forward(ids, positions, meta, pool)
    model.forward = grab
    for _ in range(10):
        engine.step()
        if seen:
            break
    model.forward = forward
    assert seen, "no step mixed decodes with a chunk past position 0"
    return seen[0]


def relative(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def written(pool, slots):
    return [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
            for k, v in pool.caches]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_mixed_step_fuses_and_computes_what_the_ordinary_forward_does(checkpoints, arch,
                                                                         kv_dtype):
    llm = make_llm(checkpoints(arch), kv_dtype)
    model = llm.engine.model
    step = mixed_step(llm)
    _, _, meta, pool = step
    assert fused_model.supports_step(meta, pool)
    slots = meta.slot_mapping
    model.fused_decode = False
    plain = model.forward(*step)
    kv_plain = written(pool, slots)
    for k, v in pool.caches:  # the fused step must write these slots itself
        k.view(-1, *k.shape[2:])[slots] = 0
        v.view(-1, *v.shape[2:])[slots] = 0
    model.fused_decode = True
    fused = model.forward(*step)
    # float32 rounding order only; a 1-byte or bfloat16 pool's codes can round the other way
    # where the two orders land on either side of a step, and that carries through the layers
    bound = 1e-5 if kv_dtype == "float32" else 3e-2
    assert relative(fused, plain) < bound
    got = written(pool, slots)
    first = (got[0], kv_plain[0])  # the first layer's K/V: same inputs, same codes
    for a, b in zip(*first, strict=True):
        if kv_dtype in ("int8", "fp8"):  # at most one code step apart, nearly all equal
            diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
            assert float((diff > 0).float().mean()) < 0.02
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(model.compute_logits(fused).argmax(-1),
                       model.compute_logits(plain).argmax(-1))


def test_greedy_tokens_equal_with_mixed_steps_fused_or_not(checkpoints):
    prompts = [[5, 9, 2, 7, 1], list(range(40, 70)), [8, 4], list(range(3, 20))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fused = make_llm(checkpoints("llama"))
    plain = make_llm(checkpoints("llama"))
    plain.engine.model.fused_decode = False
    got = [o.token_ids for o in fused.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]


def test_rows_read_their_own_positions():
    # two sequences: a decode at 9 tokens, a 3-token chunk ending at 7 tokens
    meta = AttentionMetadata([0, 1, 4], [9, 7], torch.tensor([[1, 2, 3], [4, 5, 0]]),
                             torch.arange(4), [], [1])
    rows = fused_rows.as_rows(meta)
    assert rows.query_start_loc == [0, 1, 2, 3, 4] and rows.context_lens == [9, 5, 6, 7]
    assert rows.block_tables.tolist() == [[1, 2, 3], [4, 5, 0], [4, 5, 0], [4, 5, 0]]
    assert rows.prefill_seqs == [] and fused_rows.prompt_rows(meta) == (3, 18)


def test_long_chunks_take_the_ordinary_forward():
    n = fused_rows.MAX_ROWS + 1
    meta = AttentionMetadata([0, n], [n], torch.zeros(1, 64, dtype=torch.long),
                             torch.arange(n), [], [0])
    assert not fused_rows.fits(meta)
    deep = AttentionMetadata([0, 8], [fused_rows.MAX_KEYS], torch.zeros(1, 1, dtype=torch.long),
                             torch.arange(8), [], [0])
    assert not fused_rows.fits(deep)  # a few rows, but each reads a long context


def test_speculative_verifies_fuse_at_any_depth():
    """A decode and its drafts stay on the fused rows however long their context, so they
    round as the plain decodes would; a prompt chunk beside them still counts."""
    k = 5  # one decode token and four drafts
    meta = AttentionMetadata([0, k], [fused_rows.MAX_KEYS], torch.zeros(1, 1, dtype=torch.long),
                             torch.arange(k), [], [0], verify_seqs=frozenset({0}))
    assert fused_rows.prompt_rows(meta) == (0, 0) and fused_rows.fits(meta)
    ctx = fused_rows.MAX_KEYS // 4  # the chunk's 5 rows read 1.25x MAX_KEYS
    many = AttentionMetadata([0, k, 2 * k], [ctx, ctx], torch.zeros(2, 1, dtype=torch.long),
                             torch.arange(2 * k), [], [0, 1], verify_seqs=frozenset({0}))
    assert fused_rows.prompt_rows(many) == (k, k * ctx - k * (k - 1) // 2)
    assert not fused_rows.fits(many)
