"""The native int8 KV write (kernels/cpu_kv_write.c) against the torch path it replaces
(kernels.kv_write_ref after the rotation and the K shift/balance)."""
from __future__ import annotations

import pytest
import torch

from kvscope.kernels import cpu_kv_write, native
from kvscope.kernels.k_balance import KBalanceLayer, balance_k
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.rotation import rotate, rotation_matrix

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")


def pools(num_blocks, block_size, heads, d):
    def one():
        return (torch.full((num_blocks, block_size, heads, d), -128, dtype=torch.int8),
                torch.full((num_blocks, block_size, heads), float("nan")))
    return one(), one()


@pytest.mark.parametrize("d,transform", [(64, "calibrated"), (64, "hadamard"), (64, "none"),
                                         (24, "calibrated"), (128, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_matches_the_torch_path(d, transform, dtype):
    g = torch.Generator().manual_seed(d)
    heads, rows = 3, 11
    key = (torch.randn(rows, heads, d, generator=g) * 3 + torch.randn(d, generator=g)).to(dtype)
    value = torch.randn(rows, heads, d, generator=g).to(dtype)
    key[2, 1] = 0.0  # an all-zero row: the minimum scale, codes 0
    slots = torch.tensor([5, 0, 17, 3, 9, 30, 31, 12, 7, 20, 1])
    r = None if transform == "none" else rotation_matrix("hadamard", d)
    kb = None
    if transform == "calibrated":
        kb = KBalanceLayer.of(torch.randn(heads, d, generator=g),
                              torch.rand(heads, d, generator=g) * 3 + 0.3)
    (kc, ks), (vc, vs) = pools(4, 8, heads, d)
    (kc2, ks2), (vc2, vs2) = pools(4, 8, heads, d)
    cpu_kv_write.write_int8(key, value, kc, vc, slots, ks, vs, r, kb)
    write_kv_ref(rotate(balance_k(key, kb), r), rotate(value, r), kc2, vc2, slots, ks2, vs2)
    for got, want, gs, ws in ((kc, kc2, ks, ks2), (vc, vc2, vs, vs2)):
        written = ~torch.isnan(ws)
        assert torch.equal(written, ~torch.isnan(gs))  # the same slots, nothing else
        torch.testing.assert_close(gs[written], ws[written], rtol=1e-6, atol=0)
        # Float32 summation order in the rotation may move a code across a rounding boundary.
        diff = (got.int() - want.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
        assert torch.equal(got[~written], want[~written])  # untouched slots keep the poison
    if r is None:
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # no sums: bit-identical


def test_negative_slots_are_skipped():
    key = torch.randn(2, 1, 16)
    (kc, ks), (vc, vs) = pools(1, 4, 1, 16)
    cpu_kv_write.write_int8(key, key, kc, vc, torch.tensor([-1, 2]), ks, vs)
    assert torch.isnan(ks[0, [0, 1, 3]]).all() and not torch.isnan(ks[0, 2])


def test_the_engine_takes_it_for_int8_pools(monkeypatch):
    """kernels.ops routes an int8 pool's write here on the CPU, and not under
    KVSCOPE_KERNELS=ref."""
    from kvscope.kernels import ops

    calls = []
    monkeypatch.setattr(cpu_kv_write, "write_int8", lambda *a, **k: calls.append(a))
    (kc, ks), (vc, vs) = pools(1, 4, 1, 16)
    x = torch.randn(1, 1, 16)
    ops.write_kv(x, x, kc, vc, torch.tensor([0]), ks, vs)
    assert len(calls) == 1
    monkeypatch.setenv(ops.ENV, "ref")
    ops.write_kv(x, x, kc, vc, torch.tensor([1]), ks, vs)
    assert len(calls) == 1 and not torch.isnan(ks[0, 1])
