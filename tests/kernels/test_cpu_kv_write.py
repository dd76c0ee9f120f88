"""The native 1-byte KV write (kernels/cpu_kv_write.c, int8 and fp8 e4m3) against the torch
path it replaces (kernels.kv_write_ref after the rotation and the K shift/balance)."""
from __future__ import annotations

import pytest
import torch

from kvscope.kernels import cpu_kv_write, native
from kvscope.kernels.k_balance import KBalanceLayer, balance_k
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.rotation import rotate, rotation_matrix

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")


FP8 = torch.float8_e4m3fn


def pools(num_blocks, block_size, heads, d, dtype=torch.int8):
    """Poisoned pools: codes 0x80 (int8 -128, never written; fp8 -0.0), scales NaN."""
    def one():
        codes = torch.full((num_blocks, block_size, heads, d), -128, dtype=torch.int8)
        return (codes.view(dtype), torch.full((num_blocks, block_size, heads), float("nan")))
    return one(), one()


def codes(cache):
    """Integer codes to compare: int8 as they are; fp8 as the order of their values (sign
    and magnitude bits), so one step apart is one code apart."""
    if cache.dtype == torch.int8:
        return cache.int()
    b = cache.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


@pytest.mark.parametrize("d,transform", [(64, "calibrated"), (64, "hadamard"), (64, "none"),
                                         (24, "calibrated"), (128, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool", [torch.int8, FP8])
def test_native_write_matches_the_torch_path(d, transform, dtype, pool):
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
    (kc, ks), (vc, vs) = pools(4, 8, heads, d, pool)
    (kc2, ks2), (vc2, vs2) = pools(4, 8, heads, d, pool)
    cpu_kv_write.write_quantized(key, value, kc, vc, slots, ks, vs, r, kb)
    write_kv_ref(rotate(balance_k(key, kb), r), rotate(value, r), kc2, vc2, slots, ks2, vs2)
    for got, want, gs, ws in ((kc, kc2, ks, ks2), (vc, vc2, vs, vs2)):
        written = ~torch.isnan(ws)
        assert torch.equal(written, ~torch.isnan(gs))  # the same slots, nothing else
        torch.testing.assert_close(gs[written], ws[written], rtol=1e-6, atol=0)
        # Float32 summation order in the rotation may move a code across a rounding boundary.
        diff = (codes(got) - codes(want)).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
        assert torch.equal(got[~written].view(torch.int8), want[~written].view(torch.int8))
    if r is None:  # no sums: bit-identical
        assert torch.equal(kc.view(torch.int8), kc2.view(torch.int8))
        assert torch.equal(vc.view(torch.int8), vc2.view(torch.int8))


def test_fp8_codes_round_as_torch_over_every_value():
    """Every fp8 rounding case the quantizer meets: values around each of the 127 magnitudes
    (ties and just off them, subnormals and the 448 clamp), as torch's conversion rounds."""
    mags = torch.arange(128, dtype=torch.uint8).view(FP8).float()[:127]  # 127: NaN
    mids = (mags[1:] + mags[:-1]) / 2
    vals = torch.cat([mags, mids, torch.nextafter(mids, mags[1:]),
                      torch.nextafter(mids, mags[:-1])])
    vals = torch.cat([vals, -vals])
    rows = torch.zeros(len(vals), 1, 64)
    rows[:, 0, 0] = 448.0  # the row's absmax: scale exactly 1, so the codes are the values
    rows[:, 0, 1] = vals
    (kc, ks), (vc, vs) = pools(len(vals), 1, 1, 64, FP8)
    slots = torch.arange(len(vals))
    cpu_kv_write.write_quantized(rows, rows, kc, vc, slots, ks, vs)
    assert torch.equal(ks.flatten(), torch.ones(len(vals)))
    want = vals.to(FP8)
    assert torch.equal(kc[:, 0, 0, 1].view(torch.uint8), want.view(torch.uint8))


def test_negative_slots_are_skipped():
    key = torch.randn(2, 1, 16)
    (kc, ks), (vc, vs) = pools(1, 4, 1, 16)
    cpu_kv_write.write_quantized(key, key, kc, vc, torch.tensor([-1, 2]), ks, vs)
    assert torch.isnan(ks[0, [0, 1, 3]]).all() and not torch.isnan(ks[0, 2])


@pytest.mark.parametrize("pool", [torch.int8, FP8])
def test_the_engine_takes_it_for_1_byte_pools(monkeypatch, pool):
    """kernels.ops routes an int8 or fp8 pool's write here on the CPU, and not under
    KVSCOPE_KERNELS=ref."""
    from kvscope.kernels import ops

    calls = []
    monkeypatch.setattr(cpu_kv_write, "write_quantized", lambda *a, **k: calls.append(a))
    (kc, ks), (vc, vs) = pools(1, 4, 1, 16, pool)
    x = torch.randn(1, 1, 16)
    ops.write_kv(x, x, kc, vc, torch.tensor([0]), ks, vs)
    assert len(calls) == 1
    monkeypatch.setenv(ops.ENV, "ref")
    ops.write_kv(x, x, kc, vc, torch.tensor([1]), ks, vs)
    assert len(calls) == 1 and not torch.isnan(ks[0, 1])
