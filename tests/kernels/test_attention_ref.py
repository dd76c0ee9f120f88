"""The paged attention reference against a float64 computation done the slow, obvious way."""
from __future__ import annotations

import math

import pytest
import torch

from kvscope.kernels.attention_ref import paged_attention_ref
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.testing.pools import build_batch


def reference(query, k_cache, v_cache, meta, tables, scale):
    bs = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, table in enumerate(tables):
        ctx, start, end = meta.context_lens[i], meta.query_start_loc[i], meta.query_start_loc[i + 1]
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(ctx)]).double()
        vals = torch.stack([v_cache[table[p // bs], p % bs] for p in range(ctx)]).double()
        for row in range(start, end):
            pos = ctx - (end - row)
            for h in range(query.shape[1]):
                kh = h // group
                s = keys[:pos + 1, kh] @ query[row, h].double() * scale
                out[row, h] = torch.softmax(s, 0) @ vals[:pos + 1, kh]
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_mixed_decode_and_prefill_match_float64(block_size, heads, kv_heads):
    q_lens = [1, 5, 1, 7, 1]
    ctx_lens = [9, 5, 1, 20, 33]  # prefill chunks with and without earlier context
    query, kc, vc, meta, tables = build_batch(q_lens, ctx_lens, block_size, heads, kv_heads, 8,
                                              num_blocks=80, seed=block_size * heads + kv_heads)
    scale = 1 / math.sqrt(8)
    got = paged_attention_ref(query, kc, vc, meta, scale)
    want = reference(query, kc, vc, meta, tables, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_kv_write_puts_each_row_in_its_slot():
    kc = torch.full((6, 4, 2, 3), float("nan"))
    vc = torch.full((6, 4, 2, 3), float("nan"))
    key, value = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    slots = torch.tensor([0, 7, 8, 23, 13])
    write_kv_ref(key, value, kc, vc, slots)
    for row, slot in enumerate(slots.tolist()):
        assert torch.equal(kc[slot // 4, slot % 4], key[row])
        assert torch.equal(vc[slot // 4, slot % 4], value[row])
    assert int(torch.isnan(kc).sum()) == (24 - 5) * 6  # nothing else was touched
