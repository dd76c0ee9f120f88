"""The CPU prefill attention (kernels/cpu_prefill_attention.py: two flash passes merged by
their log-sum-exp) against a float64 loop reference and the torch reference, for GQA shapes,
chunks with and without earlier context, every KV storage dtype, anchors and windows."""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels import cpu_attention, cpu_prefill_attention
from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.quant import quantize
from tests.kernels.test_attention_ref import build_batch, reference
from tests.support.scripted_chooser import ScriptedChooser

pytestmark = pytest.mark.skipif(cpu_prefill_attention.FLASH is None,
                                reason="this torch has no fused CPU flash attention op")
# Prefill chunks (q_len > 1) with no earlier context, with some, and one not block-aligned.
Q_LENS, CTX_LENS = [5, 7, 16, 3], [5, 20, 53, 40]


def _rows(meta):
    return torch.cat([torch.arange(meta.query_start_loc[i], meta.query_start_loc[i + 1])
                      for i in meta.prefill_seqs])


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_float64_equals_the_loop_reference(block_size, heads, kv_heads):
    """In float64 the only difference from one softmax over all the keys is the merge of two
    (exp and log rounding): 1e-12 leaves that and nothing else."""
    query, kc, vc, meta, tables = build_batch(Q_LENS, CTX_LENS, block_size, heads, kv_heads, 64,
                                              num_blocks=300, seed=block_size + heads)
    query, kc, vc = query.double(), kc.double(), vc.double()
    got = cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125)
    want = reference(query, kc, vc, meta, tables, 0.125)
    rows = _rows(meta)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-12, atol=1e-12)


def test_float32_matches_float64_and_the_torch_reference():
    query, kc, vc, meta, tables = build_batch(Q_LENS, CTX_LENS, 4, 9, 3, 64, num_blocks=300,
                                              seed=1)
    got = cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 1 / math.sqrt(64))
    rows = _rows(meta)
    want = reference(query, kc, vc, meta, tables, 1 / math.sqrt(64))
    # float32 summation order (the reference's own float32 result is as far off).
    torch.testing.assert_close(got[rows].double(), want[rows], rtol=1e-5, atol=1e-5)
    ref = paged_attention_ref(query, kc, vc, meta, 1 / math.sqrt(64))
    torch.testing.assert_close(got[rows], ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8,
                                   torch.float8_e4m3fn])
def test_every_storage_dtype_matches_the_torch_reference(dtype):
    """Same pool contents, read through the same gather and dequantization: float32 summation
    order apart, the same result; bfloat16 queries round the output to bfloat16 (1e-2)."""
    query, kc, vc, meta, _ = build_batch(Q_LENS, CTX_LENS, 4, 8, 2, 64, num_blocks=80, seed=7)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        (kc, ks), (vc, vs) = quantize(kc, dtype), quantize(vc, dtype)
    else:
        kc, vc, ks, vs = kc.to(dtype), vc.to(dtype), None, None
    query = query.bfloat16() if dtype == torch.bfloat16 else query
    got = cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125, ks, vs)
    want = paged_attention_ref(query, kc, vc, meta, 0.125, ks, vs)
    rows = _rows(meta)
    assert got.dtype == query.dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[rows].float(), want[rows].float(), rtol=tol, atol=tol)


def test_anchor_rows_replace_the_first_positions_as_in_the_reference():
    query, kc, vc, meta, _ = build_batch(Q_LENS, CTX_LENS, 4, 4, 2, 64, num_blocks=80, seed=2)
    (kq, ks), (vq, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
    g = torch.Generator().manual_seed(5)
    anchors = (torch.randn(3, 4, 2, 64, generator=g), torch.randn(3, 4, 2, 64, generator=g))
    meta.anchor_index = torch.tensor([0, -1, 2, 1])  # one sequence without an entry
    got = cpu_prefill_attention.prefill_attention_cpu(query, kq, vq, meta, 0.125, ks, vs,
                                                      anchors)
    want = paged_attention_ref(query, kq, vq, meta, 0.125, ks, vs, anchors)
    plain = paged_attention_ref(query, kq, vq, meta, 0.125, ks, vs)
    rows = _rows(meta)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[rows], plain[rows])  # the anchors did change something


@pytest.mark.parametrize("window", [8, 64])
def test_windows_take_the_reference_where_they_bite(window, monkeypatch):
    query, kc, vc, meta, _ = build_batch(Q_LENS, CTX_LENS, 4, 4, 2, 64, num_blocks=80, seed=3)
    calls = []
    flash = cpu_prefill_attention.FLASH
    monkeypatch.setattr(cpu_prefill_attention, "FLASH",
                        lambda *a, **k: calls.append(1) or flash(*a, **k))
    got = cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125,
                                                      window=window)
    want = paged_attention_ref(query, kc, vc, meta, 0.125, window=window)
    rows = _rows(meta)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    # 64 is longer than every context: no window bites, every chunk takes the flash passes
    # (one for a chunk with no earlier keys, two otherwise); 8 bites all but the first.
    assert len(calls) == (7 if window == 64 else 1)


def test_the_cpu_attention_sends_prefill_chunks_here(monkeypatch):
    """paged_attention_cpu (decode rows mixed with prefill chunks, and prefill alone) fills
    the prefill rows from this module, and still matches float64."""
    seen = []
    fast = cpu_prefill_attention.prefill_attention_cpu
    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu",
                        lambda *a, **k: seen.append(1) or fast(*a, **k))
    for q_lens, ctx_lens in (([1, 5, 1, 7], [9, 5, 1, 20]), ([5, 7], [5, 20])):
        query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, 4, 9, 3, 64,
                                                  num_blocks=80, seed=4)
        got = cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
        want = reference(query, kc, vc, meta, tables, 0.125)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert len(seen) == 2


@pytest.mark.parametrize("winner", ["float32", "bfloat16"])
def test_float32_queries_over_a_bfloat16_pool_run_as_measured(winner, monkeypatch):
    """The chooser decides, once, whether the passes run in bfloat16; either way the result
    is the float32 reference's over the same pool, to float32 summation order (1e-5) or to
    bfloat16 queries and probabilities (1e-2)."""
    chooser = ScriptedChooser(winner)
    monkeypatch.setattr(cpu_prefill_attention.kernel_choice, "default", lambda: chooser)
    query, kc, vc, meta, _ = build_batch(Q_LENS, CTX_LENS, 4, 9, 3, 64, num_blocks=80, seed=3)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    got = cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125)
    want = paged_attention_ref(query, kc, vc, meta, 0.125)
    rows = _rows(meta)
    assert got.dtype == torch.float32
    tol = 1e-2 if winner == "bfloat16" else 1e-5
    torch.testing.assert_close(got[rows], want[rows], rtol=tol, atol=tol)
    if winner == "bfloat16":  # it really ran in bfloat16: not float32-exact
        assert not torch.allclose(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125)
    assert len(chooser.names) == 1 and "bfloat16-pool 9x3x64" in chooser.names[0]


def test_float32_pools_are_not_a_decision(monkeypatch):
    chooser = ScriptedChooser("bfloat16")
    monkeypatch.setattr(cpu_prefill_attention.kernel_choice, "default", lambda: chooser)
    query, kc, vc, meta, _ = build_batch(Q_LENS, CTX_LENS, 4, 9, 3, 64, num_blocks=80, seed=3)
    cpu_prefill_attention.prefill_attention_cpu(query, kc, vc, meta, 0.125)
    assert chooser.asked == []
