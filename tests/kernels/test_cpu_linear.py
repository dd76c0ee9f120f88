"""kernels/cpu_linear.py (native y = x W^T + b for decode-sized calls) against float64 and
torch's F.linear, across its tile edges: 6 input rows and 4 weight rows per tile."""
import pytest
import torch
import torch.nn.functional as F

from kvscope.kernels import cpu_linear, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def case(rows, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 31])
@pytest.mark.parametrize("n", [4, 37, 96])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_float32_matches_float64(rows, n, bias, parallel):
    x, w, b = case(rows, n, 64, torch.float32, bias)
    assert cpu_linear.supports(w)
    got = cpu_linear.native_linear(x, w, None if b is None else b.float(), parallel=parallel)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_bfloat16_rounds_as_torch_does(rows, bias, parallel):
    """Both accumulate in float32 and round once to bfloat16; only the order of the float32
    sums differs, so results agree to one bfloat16 step (2^-8 relative)."""
    x, w, b = case(rows, 52, 576, torch.bfloat16, bias, seed=1)
    got = cpu_linear.native_linear(x, w, None if b is None else b.float(), parallel=parallel)
    want = F.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=2 ** -7)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("impl", ["native", "native-serial", "torch"])
def test_leading_dims_whichever_implementation_runs(impl, monkeypatch):
    monkeypatch.setattr(cpu_linear, "implementation", lambda x, w: impl)
    x, w, b = case(2 * 3, 20, 32, torch.float32, True)
    got = cpu_linear.linear(x.view(2, 3, 32), w, b, b)
    assert got.shape == (2, 3, 20)
    torch.testing.assert_close(got.view(6, 20), F.linear(x, w, b), rtol=1e-5, atol=1e-6)


def test_rows_in_another_dtype_than_the_weight_stay_with_torch():
    assert cpu_linear.implementation(torch.randn(2, 32).bfloat16(), torch.randn(8, 32)) == "torch"


def test_weights_the_kernel_cannot_take_stay_with_torch():
    assert not cpu_linear.supports(torch.randn(8, 40))          # K not a multiple of 16
    assert not cpu_linear.supports(torch.randn(32, 8).t())      # not contiguous
    assert not cpu_linear.supports(torch.randn(8, 32).half())   # no float16 path


def test_a_dense_model_linear_uses_it_unless_the_torch_kernels_are_forced(monkeypatch):
    from kvscope.engine.model.weight_formats import DenseLinear

    w = torch.randn(8, 32)
    assert DenseLinear(w).native
    monkeypatch.setenv("KVSCOPE_KERNELS", "ref")
    assert not DenseLinear(w).native


def test_float32_rows_round_alike_in_any_batch():
    """The native variants give a row the same bits alone and among up to 80 rows, and the
    same as each other; so float32 below TOP_BUCKET rows chooses between them only, and
    bfloat16 (torch's bf16 dot products) and long chunks keep torch as a candidate."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(80, 64, generator=g)
    alone = torch.cat([cpu_linear.native_linear(x[i:i + 1], w) for i in range(len(x))])
    for parallel in (True, False):
        for m in (2, 5, 16, 80):
            assert torch.equal(cpu_linear.native_linear(x[:m], w, parallel=parallel), alone[:m])
    assert "torch" not in cpu_linear.candidates(x[:16], w)
    assert "torch" in cpu_linear.candidates(torch.randn(300, 64), w)
    assert "torch" in cpu_linear.candidates(x[:16].bfloat16(), w.bfloat16())


def amx_ready() -> bool:
    return bool(native.require_library().kvscope_amx_ready())


@pytest.mark.skipif(not native.available() or not amx_ready(),
                    reason="no AMX tiles on this CPU (or not granted)")
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("n", [16, 48, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_on_amx_tiles_matches_float64_and_torch(rows, n, bias):
    """N a multiple of 16 and K of 32 take the AMX tiles (kernels/cpu_amx_gemm.c): across its
    edges (one or two 16-row weight tiles a pass, one or two 16-row input blocks, a partial
    block), sums in float32 rounded once to bfloat16, as torch's."""
    x, w, b = case(rows, n, 96, torch.bfloat16, bias, seed=2)
    bias_f32 = None if b is None else b.float()
    got = cpu_linear.native_linear(x, w, bias_f32)
    assert torch.equal(cpu_linear.native_linear(x, w, bias_f32, parallel=False), got)
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=2 ** -7)
    want = F.linear(x, w, b)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.skipif(not native.available() or not amx_ready(),
                    reason="no AMX tiles on this CPU (or not granted)")
def test_bfloat16_rows_on_amx_tiles_round_alike_in_any_batch():
    """A row's tile sums never meet another row's: the same bits alone and among 70 rows."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(70, 128, generator=g).bfloat16()
    alone = torch.cat([cpu_linear.native_linear(x[i:i + 1], w) for i in range(len(x))])
    for m in (2, 16, 17, 70):
        assert torch.equal(cpu_linear.native_linear(x[:m], w), alone[:m])


@pytest.mark.skipif(not native.available() or not amx_ready(),
                    reason="no AMX tiles on this CPU (or not granted)")
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_bfloat16_without_the_tiles_is_a_measured_candidate(rows):
    """Where the tiles would run, the kernel without them (AVX-512 BF16 dot products, else
    widened) is measured beside them, on torch's threads and serial, with the same bits as
    each other and float64's result to one bfloat16 step."""
    x, w, _ = case(rows, 96, 576, torch.bfloat16, False, seed=5)
    names = cpu_linear.candidates(x, w)
    assert {cpu_linear.NATIVE, cpu_linear.VEC} <= set(names)
    vec = cpu_linear.native_linear(x, w, None, True, cpu_linear.paths(cpu_linear.VEC, 96, 576))
    assert torch.equal(vec, cpu_linear.native_linear(x, w, None, False, cpu_linear.DOT))
    assert torch.equal(vec[:1], cpu_linear.native_linear(x[:1], w, None, True, cpu_linear.DOT))
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(vec.double(), exact, rtol=2 ** -7, atol=2 ** -7)
    assert cpu_linear.VEC not in cpu_linear.candidates(x.float(), w.float())


def test_best_native_reads_the_decisions_times(tmp_path, monkeypatch):
    """What a one-region step runs in place of a torch choice: the fastest native variant
    timed in that same decision; None where none was timed."""
    from kvscope.kernels import kernel_cache, kernel_choice

    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    kernel_choice.reset()
    try:
        name = cpu_linear.decision_name(torch.bfloat16, 96, 64, 40)
        assert name == cpu_linear.decision_name(torch.bfloat16, 96, 64, 33)  # one bucket
        assert cpu_linear.best_native(torch.bfloat16, 96, 64, 40) is None
        kernel_choice.default().decisions[name] = kernel_choice.Decision(
            name, "torch", {"native": 2.0, "native-vec-serial": 1.5, "torch": 0.5})
        assert cpu_linear.best_native(torch.bfloat16, 96, 64, 40) == "native-vec-serial"
    finally:
        kernel_choice.reset()


def test_the_vec_candidates_are_one_hardware_path_down():
    """Below AMX tiles the dot products, below the dot products float32 widening: what the VEC
    candidates run depends on the best path this CPU has for the weight's shape."""
    lib = native.require_library()
    w_amx = torch.randn(96, 64).bfloat16()   # N % 16 == 0, K % 32 == 0
    w_dot = torch.randn(24, 64).bfloat16()   # N % 16 != 0: no tiles, dot products if built
    vec = cpu_linear.paths(cpu_linear.VEC, *w_amx.shape)
    assert vec == (cpu_linear.DOT if lib.kvscope_amx_fits(96, 64) else 0)
    assert cpu_linear.paths(cpu_linear.VEC_SERIAL, *w_dot.shape) == 0
    assert cpu_linear.paths(cpu_linear.NATIVE, *w_dot.shape) == cpu_linear.AMX | cpu_linear.DOT
    assert cpu_linear.has_vec(w_dot) == bool(lib.kvscope_dpbf16_fits(64))
    assert not cpu_linear.has_vec(w_dot.float())
    x = torch.randn(5, 64).bfloat16()
    exact = x.double() @ w_dot.double().t()
    for mask in (0, cpu_linear.DOT):  # widened and dot products: both to one bfloat16 step
        got = cpu_linear.native_linear(x, w_dot, None, True, mask)
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=2 ** -7)
