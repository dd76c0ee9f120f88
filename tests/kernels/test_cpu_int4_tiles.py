"""kernels/cpu_int4_tiles.c (4-bit weights on the AMX tiles) against float64 of the dequantized
weights and against the FMA kernel, a row's independence from the rest of its call, and the
choice of one kernel family per process (kernels/cpu_int4.family)."""
import pytest
import torch

from kvscope.engine.model.weight_formats import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    int4_layout,
    quantize_int4,
)
from kvscope.kernels import cpu_int4, native

needs_tiles = pytest.mark.skipif(not (native.available() and cpu_int4.tiles_ready()),
                                 reason="no AMX tiles on this CPU (or no C compiler)")


def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes, scale_zero = quantize_int4(torch.randn(n, k, generator=g) / k ** 0.5)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = scale_zero.to(torch.bfloat16)
    return codes, sz, packed, cpu_int4.pack_tiles(packed, sz)


def rows(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_tiles
@pytest.mark.parametrize("m", [1, 2, 5, 15, 16, 17, 33, 40])
@pytest.mark.parametrize("n,k", [(64, 32), (192, 96), (576, 64), (128, 1536)])
def test_tiles_compute_the_dequantized_product(m, n, k):
    codes, sz, _, tiles = weight(n, k, seed=m)
    x = rows(m, k)
    want = x.double() @ dequantize_int4(codes, sz.float()).double().T
    got = cpu_int4.tiles_mm(x, tiles, n).double()
    # float32 sums, then the output's bfloat16 rounding (2^-8 relative)
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()


@needs_tiles
def test_tiles_and_the_fma_kernel_differ_only_in_the_last_bits():
    _, sz, packed, tiles = weight(576, 1536)
    x = rows(16, 1536)
    fma = cpu_int4.native_int4(x, packed, sz).float()
    got = cpu_int4.tiles_mm(x, tiles, 576).float()
    assert (got - fma).abs().max() <= 2 ** -7 * fma.abs().max()
    assert (got != fma).float().mean() < 0.02  # most outputs round to the same bfloat16


@needs_tiles
def test_a_rows_result_does_not_depend_on_the_rest_of_the_call():
    """Row blocks of 16, the tiles configured for fewer rows, the thread split: none of them
    may change a row's bits (a verify's rows round as plain decodes of the same positions)."""
    _, _, _, tiles = weight(192, 96)
    x = rows(40, 96)
    batch = cpu_int4.tiles_mm(x, tiles, 192)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for i in (0, 5, 15, 16, 17, 39):
                assert torch.equal(cpu_int4.tiles_mm(x[i:i + 1], tiles, 192)[0], batch[i])
            assert torch.equal(cpu_int4.tiles_mm(x[3:20], tiles, 192), batch[3:20])
    finally:
        torch.set_num_threads(threads)


@needs_tiles
def test_float32_rows_are_rounded_to_bfloat16_first():
    _, _, _, tiles = weight(64, 64)
    x = torch.randn(3, 64)
    assert torch.equal(cpu_int4.tiles_mm(x, tiles, 64), cpu_int4.tiles_mm(x.bfloat16(), tiles, 64))


@needs_tiles
def test_the_tiles_layout_is_the_same_bytes_reordered():
    _, sz, packed, tiles = weight(128, 64)
    assert tiles.numel() == packed.numel() + sz.numel() * 2
    assert sorted(tiles[:1024].tolist()) == sorted(
        packed.reshape(-1)[:32 * 32].tolist())  # block 0, group 0: 32 inputs x 32 bytes


@needs_tiles
def test_linears_hold_one_layout_and_compute_through_it(monkeypatch):
    """In the tiles family an Int4Linear keeps only the tiles' layout and still computes its
    weight; an Int8Linear is the int8 kernel's in either family (kernels/cpu_int8.py)."""
    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.TILES)
    w = torch.randn(128, 96, generator=torch.Generator().manual_seed(3)) / 10
    x = torch.randn(5, 96)
    want = x.double() @ w.double().T
    on_tiles = Int4Linear(w)
    assert on_tiles.packed is None and on_tiles.tiles is not None
    int8 = Int8Linear(w)
    assert not hasattr(int8, "tiles")
    for linear, tol in ((on_tiles, 0.15), (int8, 0.02)):
        got = linear(x).double()
        assert (got - want).norm() / want.norm() < tol, type(linear).__name__
    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.FMA)
    fma = Int4Linear(w)
    assert fma.tiles is None and fma.packed is not None
    assert (fma(x) - on_tiles(x)).abs().max() <= 2 ** -7 * fma(x).abs().max()


def test_a_layout_the_kernels_cannot_tile_stays_torchs(monkeypatch):
    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.TILES)
    codes, scale_zero = quantize_int4(torch.randn(80, 64))  # 80 outputs: not whole blocks of 64
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    kept, tiles = int4_layout(packed, scale_zero.to(torch.bfloat16))
    assert kept is packed and tiles is None


@pytest.mark.parametrize("times,want", [
    ({1: {"fma": 1.00, "tiles": 1.02}, 5: {"fma": 2.0, "tiles": 1.5}}, True),
    ({1: {"fma": 1.00, "tiles": 1.05}, 5: {"fma": 2.0, "tiles": 1.0}}, False),  # one row slower
    ({1: {"fma": 1.00, "tiles": 0.90}, 5: {"fma": 1.0, "tiles": 1.1}}, False),  # verify slower
    ({1: {"fma": 1.00}, 5: {"fma": 1.0, "tiles": 0.5}}, False),  # not measured: keep the FMA
])
def test_the_tiles_are_taken_only_where_one_row_costs_no_more(times, want):
    assert cpu_int4.tiles_pay(times) is want


def test_the_family_can_be_forced_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_int4.FAMILY_ENV, "fma")
    assert cpu_int4._decide_family() == cpu_int4.FMA
    monkeypatch.setenv(cpu_int4.FAMILY_ENV, "amx")
    with pytest.raises(ValueError, match="KVSCOPE_INT4_KERNELS='amx'"):
        cpu_int4._decide_family()
    monkeypatch.setenv(cpu_int4.FAMILY_ENV, "tiles")
    monkeypatch.setattr(cpu_int4, "tiles_ready", lambda: False)
    with pytest.raises(ValueError, match="no AMX tiles"):
        cpu_int4._decide_family()
    monkeypatch.delenv(cpu_int4.FAMILY_ENV)
    assert cpu_int4._decide_family() == cpu_int4.FMA  # no tiles here: nothing to measure
