"""kernels/cpu_int8.py (the native int8 matmul) against float64 and torch of the dequantized
weight, on every instruction set the machine has (tests/kernels/isa_builds.py): its one-row
(4 blocks a tile), two-row (2 blocks) and 1-4 row tiles, odd block counts, bfloat16 rows, and
the bits a row keeps whatever else is in the call or however the threads split it."""
import pytest
import torch
import torch.nn.functional as F

from kvscope.engine.model.weight_formats import Int8Linear, make_linear
from kvscope.kernels import cpu_int8, native
from tests.kernels.isa_builds import build, levels

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def packed(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    codes, scales = cpu_int8.quantize(w)
    return w, codes, scales, *cpu_int8.pack(codes, scales)


def rows(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 13])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 64), (1040, 96)])
def test_it_computes_the_dequantized_product(level, m, n, k):
    # 1040 outputs: 65 blocks, so a row's tiles of 4 blocks end in a block of its own
    _, codes, scales, blocked, blocked_scales = packed(n, k)
    x = rows(m, k)
    lib = build(level)
    want = x.double() @ (codes.double() * scales.double().repeat_interleave(32, 1)).T
    for parallel in (True, False):
        got = cpu_int8.native_int8(x, blocked, blocked_scales, parallel, lib=lib).double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    torch_ref = F.linear(x, cpu_int8.dequantize(blocked, blocked_scales))
    assert torch.allclose(cpu_int8.native_int8(x, blocked, blocked_scales, lib=lib), torch_ref,
                          rtol=1e-4, atol=1e-5 * float(torch_ref.abs().max()))


@pytest.mark.parametrize("level", levels())
def test_a_rows_bits_do_not_depend_on_the_call_or_the_threads(level):
    lib = build(level)
    _, _, _, blocked, blocked_scales = packed(1040, 64)
    x = rows(9, 64)
    batch = cpu_int8.native_int8(x, blocked, blocked_scales, lib=lib)
    assert torch.equal(cpu_int8.native_int8(x, blocked, blocked_scales, False, lib=lib), batch)
    for i, j in ((0, 1), (3, 5), (0, 4), (2, 9)):  # 1, 2 and 4-row calls, and a 7-row one
        assert torch.equal(cpu_int8.native_int8(x[i:j], blocked, blocked_scales, lib=lib),
                           batch[i:j])


@pytest.mark.parametrize("level", levels())
def test_bfloat16_rows_are_widened_and_the_output_rounded(level):
    lib = build(level)
    _, _, _, blocked, blocked_scales = packed(96, 64)
    x = rows(3, 64).bfloat16()
    got = cpu_int8.native_int8(x, blocked, blocked_scales, lib=lib)
    assert got.dtype == torch.bfloat16
    want = cpu_int8.native_int8(x.float(), blocked, blocked_scales, lib=lib).bfloat16()
    assert torch.equal(got, want)


def test_the_instruction_sets_agree_closely():
    # the same chain per output; the builds differ only in what the compiler contracts
    _, _, _, blocked, blocked_scales = packed(1040, 96)
    x = rows(5, 96)
    outs = [cpu_int8.native_int8(x, blocked, blocked_scales, lib=build(lv)) for lv in levels()]
    for got in outs[1:]:
        assert (got - outs[0]).abs().max() <= 1e-5 * outs[0].abs().max()


def test_quantize_pack_and_dequantize_give_the_weight_back():
    w, codes, scales, blocked, blocked_scales = packed(48, 96)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    back = cpu_int8.dequantize(blocked, blocked_scales)
    assert torch.equal(back, codes.float() * scales.repeat_interleave(32, 1))
    # half a step of each group's scale at most
    assert bool(((back - w).abs() <= scales.repeat_interleave(32, 1) / 2 + 1e-7).all())


def test_the_int8_linear_runs_the_chosen_split_and_adds_its_bias():
    w, b = rows(80, 64, seed=3), rows(1, 80, seed=4)[0]
    lin = make_linear(w, b, "int8")
    assert isinstance(lin, Int8Linear) and lin.native
    x = rows(6, 64)
    got = lin(x.view(2, 3, 64))
    assert got.shape == (2, 3, 80)
    assert cpu_int8.implementation(6, 80, 64) in (cpu_int8.NATIVE, cpu_int8.SERIAL)
    want = F.linear(x, cpu_int8.dequantize(lin.codes, lin.scales), b)
    assert torch.allclose(got.view(6, 80), want, rtol=1e-4, atol=1e-5)
    # and it is the int8 weight: within a half step of the float one
    assert (got.view(6, 80) - F.linear(x, w, b)).abs().max() < 0.05 * want.abs().max()


def test_without_the_native_kernels_it_multiplies_the_dequantized_weight(monkeypatch):
    w = rows(32, 64, seed=5)
    lin = Int8Linear(w)
    x = rows(2, 64)
    native_y = lin(x)
    lin.native = False
    assert torch.allclose(lin(x), native_y, rtol=1e-4, atol=1e-5)


def test_torch_is_a_candidate_for_prefill_chunks_only(monkeypatch):
    # a decode bucket's rows must round alike at every batch size: native splits only there
    _, _, _, blocked, blocked_scales = packed(32, 64)
    assert set(cpu_int8.candidates(rows(8, 64), blocked, blocked_scales)) <= {
        cpu_int8.NATIVE, cpu_int8.SERIAL}
    x = rows(300, 64)
    assert cpu_int8.TORCH in cpu_int8.candidates(x, blocked, blocked_scales)
    monkeypatch.setattr(cpu_int8, "implementation", lambda rows, n, k: cpu_int8.TORCH)
    got = cpu_int8.int8_mm(x, blocked, blocked_scales)
    want = cpu_int8.native_int8(x, blocked, blocked_scales)
    # the rows and the dequantized weight rounded to bfloat16 (2^-9 each), float32 sums, a
    # bfloat16 output (2^-9)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    weight = cpu_int8.dequantize(blocked, blocked_scales)
    exact = F.linear(x.bfloat16().double(), weight.bfloat16().double())
    assert bool(((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all())
    got16 = cpu_int8.int8_mm(x.bfloat16(), blocked, blocked_scales)
    assert got16.dtype == torch.bfloat16
    assert (got16.float() - want).abs().max() <= 2e-2 * want.abs().max()
