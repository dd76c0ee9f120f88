"""The native CPU decode attention (kernels/cpu_decode_attention.c) against the torch
reference, for every KV storage dtype, GQA shape and block size, decode rows mixed with
prefill chunks."""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import cpu_attention, native
from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.quant import quantize
from tests.kernels.test_attention_ref import build_batch, reference

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")


def test_the_kernel_builds_here():
    # This machine has a C compiler; a build failure must fail the suite, not skip it.
    assert native.available()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_float32_pool_matches_float64(block_size, heads, kv_heads):
    q_lens, ctx_lens = [1, 5, 1, 7, 1, 1], [9, 5, 1, 20, 33, 64]
    query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, block_size, heads, kv_heads, 64,
                                              num_blocks=300, seed=block_size + heads)
    scale = 1 / math.sqrt(64)
    got = cpu_attention.paged_attention_cpu(query, kc, vc, meta, scale)
    want = reference(query, kc, vc, meta, tables, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8,
                                   torch.float8_e4m3fn])
def test_every_storage_dtype_matches_the_reference(dtype):
    """Same pool contents, read by both: the kernel's in-register dequantization and
    conversion equal the reference's, up to float32 summation order."""
    q_lens, ctx_lens = [1, 1, 3, 1], [17, 40, 3, 5]
    query, kc, vc, meta, _ = build_batch(q_lens, ctx_lens, 4, 8, 2, 64, num_blocks=60,
                                         seed=7)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        (kc, ks), (vc, vs) = quantize(kc, dtype), quantize(vc, dtype)
    else:
        kc, vc, ks, vs = kc.to(dtype), vc.to(dtype), None, None
    query = query.bfloat16() if dtype == torch.bfloat16 else query
    scale = 0.125
    got = cpu_attention.paged_attention_cpu(query, kc, vc, meta, scale, ks, vs)
    want = paged_attention_ref(query, kc, vc, meta, scale, ks, vs)
    assert got.dtype == query.dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_every_fp8_code_reads_back_exactly():
    """A one-token context makes the output that token's V row: with 4 KV heads of 64 a slot
    holds all 256 codes (the two NaN codes, never written, as zero), so the kernel's
    in-register fp8 conversion must give torch's value for each, subnormals, -0 and +-448
    included, times the slot's scale."""
    _, kc, vc, meta, _ = build_batch([1], [1], 4, 4, 4, 64, num_blocks=2, seed=5)
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    k8 = torch.zeros_like(kc, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v8 = codes.view(1, 1, 4, 64).expand(vc.shape).contiguous().view(torch.float8_e4m3fn)
    ks = torch.ones(kc.shape[:3])
    vs = torch.full(vc.shape[:3], 0.75)
    query = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    got = cpu_attention.paged_attention_cpu(query, k8, v8, meta, 0.125, ks, vs)
    want = codes.view(torch.float8_e4m3fn).float().view(1, 4, 64) * 0.75
    assert torch.equal(got, want)


def test_many_decode_rows_of_mixed_lengths():
    q_lens, ctx_lens = [1] * 9, [3, 70, 16, 1, 45, 8, 33, 2, 64]
    query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, 16, 6, 2, 64, num_blocks=100,
                                              seed=3)
    got = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
    want = reference(query, kc, vc, meta, tables, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_engine_keeps_the_torch_kernels(monkeypatch, tmp_path, capfd):
    from kvscope.kernels import ops

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(ops.ENV, raising=False)
    native.library.cache_clear()
    try:
        assert native.library() is None and not native.available()
        assert ops.backend("cpu") == "ref"
        assert "building the CPU kernels failed" in capfd.readouterr().err
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.available()


def test_a_batch_shared_over_threads_matches_one_thread_and_the_reference():
    """Past the kernel's parallel threshold (2048 cached rows in a call) the sequences, the
    long ones cut into spans (here 333 positions: two), are shared out over torch's OpenMP
    threads: the result may not depend on that."""
    q_lens, ctx_lens = [1] * 12, [200, 7, 130, 64, 1, 90, 333, 16, 48, 150, 2, 77]
    query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, 16, 6, 3, 64, num_blocks=120,
                                              seed=5)
    assert sum(ctx_lens) * 3 >= 2048
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shared = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
        torch.set_num_threads(1)
        alone = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    want = reference(query, kc, vc, meta, tables, 0.125)
    torch.testing.assert_close(shared.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(dtype):
    """A long sequence is cut into spans by its own length alone: alone, or beside other
    rows that make the call far longer, its row is bit for bit the same. A speculative
    verify's rows sit beside each other, and must round as the plain decode of the same
    position does (greedy output with drafts equals greedy output without)."""
    from kvscope.kernels.attention_ref import AttentionMetadata

    q_lens, ctx_lens = [1, 1, 1, 1], [700, 1500, 2400, 40]
    query, kc, vc, meta, _ = build_batch(q_lens, ctx_lens, 16, 6, 3, 64, num_blocks=320,
                                         seed=11)
    ks = vs = None
    if dtype == torch.int8:
        (kc, ks), (vc, vs) = quantize(kc, dtype), quantize(vc, dtype)
    batched = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125, ks, vs)
    for i in range(len(ctx_lens)):
        alone_meta = AttentionMetadata([0, 1], [ctx_lens[i]], meta.block_tables[i:i + 1],
                                       meta.slot_mapping, [], [])
        alone = cpu_attention.paged_attention_cpu(query[i:i + 1], kc, vc, alone_meta, 0.125,
                                                  ks, vs)
        assert torch.equal(alone, batched[i:i + 1]), f"row {i} (context {ctx_lens[i]})"


def _rows_of(tables: torch.Tensor, owners: list[int], lens: list[int]):
    """Metadata of one-query rows, row r reading sequence owners[r]'s table up to lens[r]."""
    from kvscope.kernels.attention_ref import AttentionMetadata

    index = torch.tensor(owners, dtype=torch.long)
    return AttentionMetadata(list(range(len(owners) + 1)), lens, tables.index_select(0, index),
                             torch.zeros(0, dtype=torch.long), [], [])


@pytest.mark.parametrize("dtype,io", [(torch.float32, torch.float32),
                                      (torch.float32, torch.bfloat16),
                                      (torch.int8, torch.float32),
                                      (torch.float8_e4m3fn, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 2, 64, 1), (4, 4, 32, 16)])
def test_rows_sharing_their_blocks_keep_the_bits_they_get_alone(dtype, io, heads, kv_heads,
                                                               head_dim, block_size):
    """A verify's rows (one sequence, consecutive positions) and rows of sequences that share
    cached blocks read those blocks' full spans once for all of them (the kernel's shared
    spans, up to 16 query heads at a time: 5 rows of 3, 4 of 4, 4 of 1 here, so 7 rows make
    two sets). Each row must still get exactly the bits of its decode alone."""
    ctx = [1300, 900]
    _, kc, vc, meta, _ = build_batch([1, 1], ctx, block_size, heads, kv_heads, head_dim,
                                     num_blocks=2300 // block_size + 4, seed=3)
    tables = meta.block_tables.clone()
    # sequence 2 shares sequence 0's first 608 positions' blocks (a cached prefix), then
    # goes on in blocks of its own (here 1's)
    shared = 608 // block_size
    tables = torch.cat([tables, tables[:1]])
    tables[2, shared:] = tables[1, :tables.shape[1] - shared]
    # 7 verify-like rows of 0; two of 2, which would cut 0's five shared spans to two and so
    # go on their own; 1; then 0 and 2 at 1000 and 702, whose first two spans are the same
    owners = [0] * 7 + [2] * 2 + [1] + [0, 2]
    lens = [1290 + r for r in range(7)] + [700, 701, 900, 1000, 702]
    rows = _rows_of(tables, owners, lens)
    query = torch.randn(len(owners), heads, head_dim, generator=torch.Generator().manual_seed(4))
    query = query.to(io)
    ks = vs = None
    if dtype != torch.float32:
        (kc, ks), (vc, vs) = quantize(kc, dtype), quantize(vc, dtype)
    together = cpu_attention.paged_attention_cpu(query, kc, vc, rows, 0.125, ks, vs)
    for r in range(len(owners)):
        alone = cpu_attention.paged_attention_cpu(
            query[r:r + 1], kc, vc, _rows_of(tables, [owners[r]], [lens[r]]), 0.125, ks, vs)
        assert torch.equal(alone, together[r:r + 1]), f"row {r} (owner {owners[r]})"
    if dtype == torch.float32:
        want = reference(query.float(), kc, vc, rows, tables.index_select(
            0, torch.tensor(owners)).tolist(), 0.125)
        torch.testing.assert_close(together.double(), want, rtol=2e-2 if io != dtype else 1e-5,
                                   atol=2e-2 if io != dtype else 1e-5)
