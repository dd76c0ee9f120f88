"""Sliding-window attention and logit soft-capping (issue 24) in every attention path: the
torch reference against a float64 oracle built from plain per-sequence tensors, then the
native CPU decode kernel and the Triton kernels against the reference.

In every batch the blocks wholly before the window of a sequence's first query hold NaN
(poison codes and NaN scales for int8/fp8 pools) and their block-table entries are -1, as
the block manager leaves them once it frees them: a kernel that reads them, or lets them
into a masked position, returns NaN.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import cpu_attention, cpu_prefill_attention, native, ops
from kvscope.kernels.attention_ref import (
    AttentionMetadata,
    group_decode_rows,
    paged_attention_ref,
)
from kvscope.kernels.quant import quantize

FP8 = torch.float8_e4m3fn
# Decode rows of several lengths, a prefill chunk starting mid-sequence (positions 24..29),
# a whole prompt (q_len == ctx) and a one-token sequence.
Q_LENS = [1, 1, 6, 1, 4, 1]
CTX_LENS = [1, 23, 30, 40, 4, 17]


@pytest.fixture(autouse=True)
def float32_prefill_passes(monkeypatch):
    """The prefill chunks' flash passes in float32 whatever this machine's chooser picked for a
    bfloat16 pool (kernels/cpu_prefill_attention.py): the paths compared here at 2e-5 are the
    decode rows' and the window/softcap reference's."""
    monkeypatch.setattr(cpu_prefill_attention, "compute_dtype", lambda flash, q, k: q.dtype)


def first_window_pos(position: int, window: int) -> int:
    return max(0, position - window + 1) if window else 0


class Batch:
    """Plain tensors (the oracle's view) and the paged pool built from them."""

    def __init__(self, q_lens, ctx_lens, block_size, heads, kv_heads, head_dim, window, seed,
                 q_gain=3.0):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens, self.window = list(q_lens), list(ctx_lens), window
        self.keys = [torch.randn(n, kv_heads, head_dim, generator=g) for n in ctx_lens]
        self.values = [torch.randn(n, kv_heads, head_dim, generator=g) for n in ctx_lens]
        # Large enough scores that a soft cap of a few units changes them.
        self.query = torch.randn(sum(q_lens), heads, head_dim, generator=g) * q_gain
        blocks = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(blocks) + 1  # block 0 stays zero: the tables' padding
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        table = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.long)
        self.freed: list[int] = []
        for i, (n, q) in enumerate(zip(ctx_lens, q_lens, strict=True)):
            first = first_window_pos(n - q, window) // block_size
            for b in range(blocks[i]):
                blk = perm.pop()
                rows = slice(b * block_size, min(n, (b + 1) * block_size))
                width = rows.stop - rows.start
                self.k_cache[blk, :width] = self.keys[i][rows]
                self.v_cache[blk, :width] = self.values[i][rows]
                table[i, b] = blk
                if b < first:  # wholly before every query's window: freed
                    self.freed.append(blk)
                    table[i, b] = -1
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            query_start_loc=starts, context_lens=list(ctx_lens), block_tables=table,
            slot_mapping=torch.zeros(0, dtype=torch.long),
            decode_groups=group_decode_rows(starts, list(ctx_lens), max_group=2),
            prefill_seqs=[i for i, q in enumerate(q_lens) if q > 1])

    def pool(self, dtype=torch.float32):
        """(k_cache, v_cache, k_scale, v_scale) in `dtype`, the freed blocks poisoned."""
        if dtype in (torch.int8, FP8):
            (kc, ks), (vc, vs) = quantize(self.k_cache, dtype), quantize(self.v_cache, dtype)
        else:
            kc, vc, ks, vs = self.k_cache.to(dtype), self.v_cache.to(dtype), None, None
        freed = torch.tensor(self.freed, dtype=torch.long)
        for t in (kc, vc):
            if dtype == torch.int8:
                t[freed] = -128
            elif dtype == FP8:
                t.view(torch.uint8)[freed] = 0x7F  # the fp8 NaN byte
            else:
                t[freed] = float("nan")
        for s in (ks, vs):
            if s is not None:
                s[freed] = float("nan")
        return kc, vc, ks, vs

    def oracle(self, scale, softcap, keys=None, values=None):
        """float64 softmax over each query's window, the obvious way."""
        keys, values = keys or self.keys, values or self.values
        heads, kv_heads = self.query.shape[1], keys[0].shape[1]
        group = heads // kv_heads
        out = torch.empty(self.query.shape, dtype=torch.float64)
        row = 0
        for i, (n, q_len) in enumerate(zip(self.ctx_lens, self.q_lens, strict=True)):
            for r in range(q_len):
                p = n - q_len + r
                lo = first_window_pos(p, self.window)
                k, v = keys[i][lo:p + 1].double(), values[i][lo:p + 1].double()
                for h in range(heads):
                    s = k[:, h // group] @ self.query[row, h].double() * scale
                    if softcap:
                        s = softcap * torch.tanh(s / softcap)
                    out[row, h] = torch.softmax(s, 0) @ v[:, h // group]
                row += 1
        return out


# -- the reference against float64 ----------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5, 17, 1000])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_reference_matches_a_float64_windowed_softcapped_softmax(block_size, window, softcap):
    b = Batch(Q_LENS, CTX_LENS, block_size, 4, 2, 8, window, seed=block_size + window)
    if window in (5, 17):
        assert b.freed  # the poisoned, -1 blocks are really there
    scale = 1 / math.sqrt(8)
    kc, vc, _, _ = b.pool()
    got = paged_attention_ref(b.query, kc, vc, b.meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got.double(), b.oracle(scale, softcap), rtol=1e-5, atol=1e-5)


def test_window_and_softcap_change_the_answer():
    """So the tests above would fail if either were ignored."""
    b = Batch(Q_LENS, CTX_LENS, 4, 4, 2, 8, 5, seed=1)
    kc, vc, _, _ = b.pool()
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    windowed = paged_attention_ref(b.query, kc, vc, b.meta, 0.35, window=5)
    capped = paged_attention_ref(b.query, kc, vc, b.meta, 0.35, window=5, softcap=2.0)
    assert (windowed - capped).abs().max() > 0.1
    b.window = 0
    plain = b.oracle(0.35, 0.0)
    assert (windowed.double() - plain).abs().max() > 0.1


def test_bfloat16_prefill_and_decode_rows():
    b = Batch(Q_LENS, CTX_LENS, 4, 4, 2, 8, 6, seed=2)
    kc, vc, _, _ = b.pool(torch.bfloat16)
    keys = [k.bfloat16().float() for k in b.keys]
    values = [v.bfloat16().float() for v in b.values]
    b.query = b.query.bfloat16()
    got = paged_attention_ref(b.query, kc, vc, b.meta, 0.3, window=6, softcap=3.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), b.oracle(0.3, 3.0, keys, values),
                               rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("block_size", [1, 4])
def test_reference_anchor_rows_respect_the_window(block_size):
    """Positions 0..3 of sequences with an entry come from the anchor rows, but only those
    inside a query's window count."""
    q_lens, ctx_lens = [1, 1, 3, 1, 2], [6, 5, 7, 3, 40]
    b = Batch(q_lens, ctx_lens, block_size, 4, 2, 8, 3, seed=block_size)
    g = torch.Generator().manual_seed(9)
    ak, av = (torch.randn(2, 4, 2, 8, generator=g) * 3 for _ in range(2))
    index = torch.tensor([0, 1, 1, -1, 0])
    b.meta.anchor_index = index
    keys, values = [k.clone() for k in b.keys], [v.clone() for v in b.values]
    for i, e in enumerate(index.tolist()):
        if e >= 0:
            n = min(4, ctx_lens[i])
            keys[i][:n], values[i][:n] = ak[e, :n], av[e, :n]
    kc, vc, _, _ = b.pool()
    got = paged_attention_ref(b.query, kc, vc, b.meta, 0.35, anchors=(ak, av), window=3,
                              softcap=2.0)
    torch.testing.assert_close(got.double(), b.oracle(0.35, 2.0, keys, values),
                               rtol=1e-5, atol=1e-5)


def test_bad_window_or_softcap_is_refused():
    b = Batch([1], [3], 4, 2, 2, 8, 0, seed=0)
    with pytest.raises(ValueError, match="window"):
        paged_attention_ref(b.query, b.k_cache, b.v_cache, b.meta, 1.0, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        ops.paged_attention(b.query, b.k_cache, b.v_cache, b.meta, 1.0, softcap=float("nan"))


# -- the native CPU decode kernel against the reference -------------------------------------
native_only = pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")
# Windows shorter than some contexts (blocks freed), and one longer than all of them; a cap
# of 0.3 saturates tanh (scores of a few units), 2.5 bends them.
CASES = [(0, 2.5), (5, 0.0), (17, 2.5), (1000, 2.5), (5, 0.3)]


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   FP8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window,softcap", CASES)
def test_native_decode_matches_the_reference(dtype, block_size, window, softcap):
    """head_dim 64 (the vectorised loop), decode rows mixed with prefill chunks (which the
    wrapper sends to the reference), every KV storage kind, freed blocks poisoned."""
    assert native.available()
    b = Batch(Q_LENS, CTX_LENS, block_size, 6, 2, 64, window, seed=block_size + window)
    pool = b.pool(dtype)
    query = b.query * 0.4  # scale 0.125 at head_dim 64: scores of a few units
    got = cpu_attention.paged_attention_cpu(query, pool[0], pool[1], b.meta, 0.125, *pool[2:],
                                            window=window, softcap=softcap)
    want = paged_attention_ref(query, pool[0], pool[1], b.meta, 0.125, *pool[2:],
                               window=window, softcap=softcap)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    if dtype == torch.float32:
        b.query = query
        torch.testing.assert_close(got.double(), b.oracle(0.125, softcap), rtol=1e-5,
                                   atol=1e-5)


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, FP8])
@pytest.mark.parametrize("window,softcap", CASES)
def test_native_generic_head_dim_and_bfloat16_rows(dtype, window, softcap):
    """head_dim 24 takes the generic loop; decode-only bfloat16 rows go in and out as they
    are."""
    q_lens, ctx_lens = [1] * 6, [1, 9, 23, 40, 4, 17]
    b = Batch(q_lens, ctx_lens, 4, 6, 3, 24, window, seed=3 + window)
    pool = b.pool(dtype)
    want = paged_attention_ref(b.query, pool[0], pool[1], b.meta, 0.2, *pool[2:],
                               window=window, softcap=softcap)
    got = cpu_attention.paged_attention_cpu(b.query, pool[0], pool[1], b.meta, 0.2, *pool[2:],
                                            window=window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    q16 = b.query.bfloat16()
    got16 = cpu_attention.paged_attention_cpu(q16, pool[0], pool[1], b.meta, 0.2, *pool[2:],
                                              window=window, softcap=softcap)
    want16 = paged_attention_ref(q16, pool[0], pool[1], b.meta, 0.2, *pool[2:],
                                 window=window, softcap=softcap)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want16.float(), rtol=2e-2, atol=2e-2)


@native_only
@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("block_size", [1, 4])
def test_native_anchor_rows_respect_the_window(dtype, head_dim, block_size):
    """Anchored positions 0..3 outside a row's window are left out, inside it they count."""
    q_lens, ctx_lens = [1, 1, 1, 1, 3, 1], [6, 5, 3, 4, 7, 40]
    b = Batch(q_lens, ctx_lens, block_size, 4, 2, head_dim, 3, seed=block_size + head_dim)
    g = torch.Generator().manual_seed(4)
    anchors = tuple(torch.randn(2, 4, 2, head_dim, generator=g) * 3 for _ in range(2))
    b.meta.anchor_index = torch.tensor([0, 1, 1, -1, 0, 1])
    pool = b.pool(dtype)
    args = (b.query * 0.5, pool[0], pool[1], b.meta, 0.3, *pool[2:], anchors)
    want = paged_attention_ref(*args, window=3, softcap=2.0)
    got = cpu_attention.paged_attention_cpu(*args, window=3, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # The anchors matter here: without them rows 0-2 differ.
    plain = paged_attention_ref(*args[:-1], window=3, softcap=2.0)
    assert (plain[:3] - want[:3]).abs().max() > 1e-2


@native_only
def test_native_windowed_batch_shared_over_threads():
    """Past the kernel's parallel threshold the answer may not depend on the threads."""
    q_lens, ctx_lens = [1] * 10, [200, 7, 130, 64, 1, 90, 333, 16, 150, 77]
    b = Batch(q_lens, ctx_lens, 16, 6, 3, 64, 48, seed=5)
    pool = b.pool()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shared = cpu_attention.paged_attention_cpu(b.query * 0.4, *pool[:2], b.meta, 0.125,
                                                   window=48, softcap=2.0)
        torch.set_num_threads(1)
        alone = cpu_attention.paged_attention_cpu(b.query * 0.4, *pool[:2], b.meta, 0.125,
                                                  window=48, softcap=2.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    b.query = b.query * 0.4
    torch.testing.assert_close(shared.double(), b.oracle(0.125, 2.0), rtol=1e-5, atol=1e-5)


@native_only
def test_ops_dispatch_passes_window_and_softcap_to_the_native_kernel(monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)
    b = Batch([1, 1], [30, 9], 4, 4, 2, 64, 6, seed=8)
    pool = b.pool(torch.int8)
    assert ops.backend("cpu") == "cpu"
    got = ops.paged_attention(b.query, pool[0], pool[1], b.meta, 0.2, *pool[2:], window=6,
                              softcap=2.0)
    want = paged_attention_ref(b.query, pool[0], pool[1], b.meta, 0.2, *pool[2:], window=6,
                               softcap=2.0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# -- Triton (under TRITON_INTERPRET=1, tests/conftest.py) against the reference -------------
@pytest.mark.parametrize("block_size,block_n,num_splits", [(1, None, 1), (16, 16, 2),
                                                           (16, None, 1)])
@pytest.mark.parametrize("window,softcap", [(5, 2.5), (17, 0.0), (0, 2.5), (5, 0.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_triton_matches_the_reference(block_size, block_n, num_splits, window, softcap,
                                      dtype):
    """Decode rows and prefill chunks in one launch; a KV tile inside one block (block_n 16)
    and spanning several, with the context split in two."""
    from kvscope.kernels.triton_attention import paged_attention_triton

    b = Batch(Q_LENS, CTX_LENS, block_size, 4, 2, 16, window, seed=block_size + window)
    pool = b.pool(dtype)
    query = b.query * 0.6
    out = torch.full_like(query, float("nan"))
    got = paged_attention_triton(query, *pool[:2], b.meta, 0.25, *pool[2:], out=out,
                                 num_splits=num_splits, block_n=block_n, window=window,
                                 softcap=softcap)
    want = paged_attention_ref(query, *pool[:2], b.meta, 0.25, *pool[2:], window=window,
                               softcap=softcap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_triton_fp8_bfloat16_and_anchors_in_a_window():
    from kvscope.kernels.triton_attention import paged_attention_triton

    q_lens, ctx_lens = [1, 1, 3, 1, 2], [6, 5, 7, 3, 40]
    b = Batch(q_lens, ctx_lens, 4, 4, 2, 16, 3, seed=11)
    g = torch.Generator().manual_seed(12)
    anchors = tuple(torch.randn(2, 4, 2, 16, generator=g) for _ in range(2))
    b.meta.anchor_index = torch.tensor([0, 1, 1, -1, 0])
    pool = b.pool(FP8)
    query = b.query * 0.5
    got = paged_attention_triton(query, *pool[:2], b.meta, 0.3, *pool[2:], anchors=anchors,
                                 window=3, softcap=2.0)
    want = paged_attention_ref(query, *pool[:2], b.meta, 0.3, *pool[2:], anchors,
                               window=3, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    q16 = query.bfloat16()
    got16 = paged_attention_triton(q16, *pool[:2], b.meta, 0.3, *pool[2:], anchors=anchors,
                                   window=3, softcap=2.0)
    torch.testing.assert_close(got16.float(), want, rtol=2e-2, atol=2e-2)
