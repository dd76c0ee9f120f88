"""The int4 LM head with exact rescoring of each row's top candidates, against the dense head."""
from __future__ import annotations

import torch

from kvscope.engine.model.paged_decoder import make_head
from kvscope.engine.model.rescored_head import RESCORE_TOP, RescoredHead
from kvscope.engine.model.weight_formats import DenseLinear, Int8Linear


def table_and_hidden(vocab: int = 4096, hidden: int = 128, rows: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=g) * 0.05,
            torch.randn(rows, hidden, generator=g))


def test_top_candidates_get_the_dense_logits_and_the_same_winner():
    table, x = table_and_hidden()
    dense = x @ table.T
    head = RescoredHead(table)
    got = head(x)
    raw = head.approx(x).float()
    # The test can fail: plain int4 logits pick another winner on some rows.
    assert (raw.argmax(-1) != dense.argmax(-1)).any()
    assert torch.equal(got.argmax(-1), dense.argmax(-1))
    top = raw.topk(RESCORE_TOP, dim=-1).indices
    # float32 dot products of 128 terms, summed in another order than the GEMM's.
    torch.testing.assert_close(got.gather(1, top), dense.gather(1, top), rtol=0, atol=1e-5)
    # Outside the rescored set the int4 logits stay, close to the dense ones.
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], raw[rest])
    assert (got - dense).abs().max() < 0.1 * dense.abs().max()


def test_a_single_row_and_a_bfloat16_table():
    table, x = table_and_hidden(rows=1, seed=1)
    head = RescoredHead(table.bfloat16())
    got = head(x.bfloat16())
    assert got.dtype == torch.float32 and got.shape == (1, 4096)
    ref = (x.bfloat16() @ table.bfloat16().T).float()
    assert int(got.argmax()) == int(ref.argmax())


def test_the_head_adds_only_its_packed_codes():
    table, _ = table_and_hidden()
    head = RescoredHead(table)
    ptrs = {t.data_ptr() for t in head.tensors()}
    assert table.data_ptr() not in ptrs
    assert sum(t.nbytes for t in head.tensors()) < table.nbytes / 4


def test_make_head_rescores_only_a_tied_table_under_int4():
    table, _ = table_and_hidden()
    untied = table.clone()
    assert isinstance(make_head(None, table, "int4"), RescoredHead)
    assert isinstance(make_head(untied, table, "int4"), Int8Linear)
    assert isinstance(make_head(None, table, "dense"), DenseLinear)
    assert isinstance(make_head(None, table, "int8"), Int8Linear)
