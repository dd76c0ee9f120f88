"""kernels/cpu_int4.py (the native int4 matmul on torch's packed tensors) against torch's
`_weight_int4pack_mm_for_cpu`, bit for bit, across its tiles (up to 6 rows a tile, 4 and 2
output tiles of 16, 64-output blocks), and against float64 of the dequantized weights."""
from types import SimpleNamespace

import pytest
import torch

from kvscope.engine.model.weight_formats import dequantize_int4, int4_mm, quantize_int4
from kvscope.kernels import cpu_int4, native
from tests.kernels.isa_builds import build, levels

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes, scale_zero = quantize_int4(torch.randn(n, k, generator=g) / k ** 0.5)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return codes, scale_zero, packed, scale_zero.to(torch.bfloat16)


def rows(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 12, 13, 33])
@pytest.mark.parametrize("n,k", [(64, 32), (192, 96), (576, 64)])
@pytest.mark.parametrize("parallel", [True, False])
def test_native_gives_torchs_bits(m, n, k, parallel):
    _, _, packed, sz = weight(n, k)
    x = rows(m, k)
    assert torch.equal(cpu_int4.native_int4(x, packed, sz, parallel),
                       cpu_int4.torch_int4(x, packed, sz))


def test_it_computes_the_dequantized_product():
    codes, scale_zero, packed, sz = weight(128, 96)
    x = rows(5, 96)
    bf16_sz = scale_zero.to(torch.bfloat16).float()
    want = x.double() @ dequantize_int4(codes, bf16_sz).double().T
    got = cpu_int4.native_int4(x, packed, sz).double()
    # float32 sums of 96 products, then the output's bfloat16 rounding (2^-8 relative)
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_float32_rows_are_rounded_to_bfloat16_first():
    _, _, packed, sz = weight(64, 64)
    x = torch.randn(3, 64)
    assert torch.equal(cpu_int4.native_int4(x, packed, sz),
                       cpu_int4.native_int4(x.bfloat16(), packed, sz))


def test_a_rows_result_does_not_depend_on_the_rest_of_the_call():
    _, _, packed, sz = weight(192, 64)
    x = rows(20, 64)
    batch = cpu_int4.native_int4(x, packed, sz)
    for i in (0, 4, 5, 6, 13, 19):
        assert torch.equal(cpu_int4.native_int4(x[i:i + 1], packed, sz)[0], batch[i])


def test_the_probe_reads_torchs_packing_on_this_machine():
    # torch packs by its dispatched vector width (64 under AVX-512, 32 under AVX2); the native
    # kernel read every layout as 64 and computed another weight's product on an AVX2 EPYC
    block = cpu_int4.torch_block()
    if block is None:  # not x86: then the native kernels are not offered (supports is False)
        assert not cpu_int4.supports(128, 64)
        pytest.skip("torch packs int4 in a layout the native kernels do not read here")
    assert block in cpu_int4.TORCH_BLOCKS
    codes = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(packed.flatten(), cpu_int4.pack_reference(codes, block))
    other = next(b for b in cpu_int4.TORCH_BLOCKS if b != block)
    assert not torch.equal(packed.flatten(), cpu_int4.pack_reference(codes, other))


@pytest.mark.parametrize("block", cpu_int4.TORCH_BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 13])
@pytest.mark.parametrize("parallel", [True, False])
def test_both_packings_give_the_same_bits(block, m, parallel):
    # whatever width torch packs by here, the kernel reads both (16-wide tiles for 64 with
    # AVX-512, 8-wide ones otherwise): the same chain per output, so the same bits as torch's
    codes, scale_zero, packed, sz = weight(192, 96)
    x = rows(m, 96)
    mine = cpu_int4.pack_reference(codes, block)
    assert torch.equal(cpu_int4.native_int4(x, mine, sz, parallel, block=block),
                       cpu_int4.torch_int4(x, packed, sz))


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("block", cpu_int4.TORCH_BLOCKS)
@pytest.mark.parametrize("n", [2048, 2112])
def test_one_row_over_many_blocks_gives_torchs_bits(level, block, n):
    # a decode's single row runs 8 chains at once from 32 blocks up (two blocks a unit of
    # work, 2112 = 33 blocks of 64 ending in a unit of one), on every instruction set here
    codes, _, packed, sz = weight(n, 64)
    x = rows(1, 64)
    want = cpu_int4.torch_int4(x, packed, sz)
    mine = cpu_int4.pack_reference(codes, block)
    lib = build(level)
    for parallel in (True, False):
        got = cpu_int4.native_int4(x, mine, sz, parallel, block=block, lib=lib)
        if level == "x86-64-v2":  # no FMA instruction: each product rounds before its sum
            assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.abs().max()
        else:
            assert torch.equal(got, want)


def test_a_packing_the_kernel_cannot_read_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_int4, "torch_block", lambda: None)
    _, _, packed, sz = weight(64, 32)
    with pytest.raises(ValueError, match="layout the native kernel does not read"):
        cpu_int4.native_int4(rows(1, 32), packed, sz)
    assert not cpu_int4.supports(128, 64)


def test_only_whole_64_output_blocks_are_taken():
    assert cpu_int4.supports(128, 64)
    assert not cpu_int4.supports(80, 64)
    assert not cpu_int4.supports(128, 48)


@pytest.mark.parametrize("impl", ["native", "native-serial", "torch"])
def test_int4_mm_runs_whichever_was_chosen(impl, monkeypatch):
    monkeypatch.setattr(cpu_int4, "implementation", lambda m, n, k: impl)
    _, _, packed, sz = weight(128, 64)
    x = rows(3, 64)
    assert torch.equal(cpu_int4.int4_mm(x, packed, sz), cpu_int4.torch_int4(x, packed, sz))


def test_the_int4_linear_gives_the_same_bits_through_the_chooser():
    _, _, packed, sz = weight(128, 64)
    x = torch.randn(5, 64)
    want = cpu_int4.torch_int4(x.bfloat16(), packed, sz).float()
    in_torchs_layout = SimpleNamespace(packed=packed, tiles=None, scale_zero=sz)
    assert torch.equal(int4_mm(x, in_torchs_layout), want)
