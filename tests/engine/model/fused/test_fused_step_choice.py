"""engine/model/fused/step_choice.py: a step whose matmul choices include torch's runs as one region
(native kernels in torch's place) or kernel by kernel, as measured for the whole step, with a
scripted chooser standing in for the timings."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine.model.fused import decode as fused_decode
from kvscope.engine.model.fused import one_region as fused_one_region
from kvscope.engine.model.fused import step_choice as fused_step_choice
from kvscope.kernels import cpu_linear, decode_split, native
from tests.engine.model.fused.test_fused_decode import capture_decode_step
from tests.engine.model.fused.test_fused_one_region import PROMPTS, make_llm, pool_tensors
from tests.engine.model.test_weight_formats import tiny  # noqa: F401  (a 4-bit tiny model fixture)
from tests.support.scripted_chooser import ScriptedChooser

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")


@pytest.fixture
def step(tiny, monkeypatch):  # noqa: F811
    """A captured float32 dense decode step, a way to run it from the same pool state, and
    the gate_up shape that torch is made to win. The kernel-by-kernel step's attention
    calls keep the kernel's own thread split (kernels/decode_split.py asks the same chooser:
    not the decision under test)."""
    monkeypatch.setattr(decode_split, "parallel", lambda call, dtype, rows: -1)
    llm = make_llm(tiny, "dense")
    model = llm.engine.model
    ids, positions, meta, pool = capture_decode_step(llm, PROMPTS)
    before = [t.clone() for t in pool_tensors(pool)]
    torch_shape = tuple(model.layers[0].gate_up.shape)

    def run():
        for t, b in zip(pool_tensors(pool), before, strict=True):
            t.copy_(b)
        h = fused_decode.run_layers(model, ids, positions, meta, pool).clone()
        return h, [t.clone() for t in pool_tensors(pool)]
    return run, torch_shape


def choose(monkeypatch, torch_shape):
    """torch chosen for the gate_up weight, the native kernel for the rest."""
    def pick(n, k):
        return cpu_linear.TORCH if (n, k) == torch_shape else cpu_linear.NATIVE
    monkeypatch.setattr(cpu_linear, "chosen", lambda dtype, n, k, rows: pick(n, k))
    monkeypatch.setattr(cpu_linear, "implementation", lambda x, w: pick(*w.shape))
    monkeypatch.setattr(cpu_linear, "best_native", lambda *a: cpu_linear.NATIVE)


def same(a, b) -> bool:
    pairs = zip(a[1], b[1], strict=True)
    return torch.equal(a[0], b[0]) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


def references(step, monkeypatch, torch_shape):
    """(one region, every matmul native; kernel by kernel, torch for gate_up)."""
    monkeypatch.setattr(cpu_linear, "chosen", lambda *a: cpu_linear.NATIVE)
    monkeypatch.setenv(fused_one_region.ENV, "on")
    native_one = step()
    choose(monkeypatch, torch_shape)
    monkeypatch.setenv(fused_one_region.ENV, "off")
    torch_kbk = step()
    monkeypatch.setenv(fused_one_region.ENV, "on")
    assert not same(native_one, torch_kbk)  # the two ways are told apart by their bits
    return native_one, torch_kbk


@pytest.mark.parametrize("winner", [fused_step_choice.ONE_REGION, fused_step_choice.BY_KERNEL])
def test_the_measured_way_runs_and_is_kept(step, winner, monkeypatch):
    run, torch_shape = step
    native_one, torch_kbk = references(run, monkeypatch, torch_shape)
    chooser = ScriptedChooser(winner)
    monkeypatch.setattr(fused_step_choice.kernel_choice, "default", lambda: chooser)
    got = run()
    assert sorted(chooser.ran) == sorted([fused_step_choice.ONE_REGION,
                                          fused_step_choice.BY_KERNEL])
    (name, info), = chooser.asked
    assert name.startswith("step float32 ") and info["op"] == "step"
    assert same(got, native_one if winner == fused_step_choice.ONE_REGION else torch_kbk)
    again = run()  # decided once: the next step of the bucket just runs it
    assert len(chooser.asked) == 1 and same(again, got)


def test_no_step_choice_without_a_torch_choice(step, monkeypatch):
    run, _ = step
    monkeypatch.setattr(cpu_linear, "chosen", lambda *a: cpu_linear.NATIVE)
    chooser = ScriptedChooser(fused_step_choice.BY_KERNEL)
    monkeypatch.setattr(fused_step_choice.kernel_choice, "default", lambda: chooser)
    run()
    assert chooser.asked == []


def test_paths_instead_of_torch_needs_every_choice_made(tiny, monkeypatch):  # noqa: F811
    model = make_llm(tiny, "dense").engine.model
    matmuls = [model.layers[0].qkv, model.layers[0].gate_up]
    torch_shape = tuple(matmuls[1].shape)
    monkeypatch.setattr(cpu_linear, "best_native", lambda *a: cpu_linear.VEC_SERIAL)
    monkeypatch.setattr(cpu_linear, "chosen", lambda d, n, k, r: None if (n, k) == torch_shape
                        else cpu_linear.NATIVE)
    assert fused_one_region.paths_instead_of_torch(matmuls, 4, torch.float32) is None
    monkeypatch.setattr(cpu_linear, "chosen", lambda d, n, k, r: cpu_linear.TORCH
                        if (n, k) == torch_shape else cpu_linear.NATIVE)
    got = fused_one_region.paths_instead_of_torch(matmuls, 4, torch.float32)
    assert got == {tuple(matmuls[0].shape): cpu_linear.paths(cpu_linear.NATIVE, 1, 1),
                   torch_shape: cpu_linear.paths(cpu_linear.VEC_SERIAL, *torch_shape)}


def test_a_4bit_torch_choice_is_replaced_by_the_native_kernel(tiny, monkeypatch):  # noqa: F811
    """4-bit weights have one native kernel: a torch choice is stood in for by it (no paths:
    those are for dense bfloat16 weights), and without the step choice it keeps the step off
    the one region."""
    from kvscope.kernels import cpu_int4

    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.FMA)  # torch's layout, torch a choice
    model = make_llm(tiny, "int4").engine.model
    matmuls = [model.layers[0].qkv, model.layers[0].gate_up]
    torch_shape = tuple(matmuls[1].shape)
    monkeypatch.setattr(cpu_int4, "implementation", lambda r, n, k: cpu_linear.TORCH
                        if (n, k) == torch_shape else cpu_int4.NATIVE)
    assert fused_one_region.chosen_paths(matmuls, 4, torch.bfloat16) is None
    assert fused_one_region.paths_instead_of_torch(matmuls, 4, torch.bfloat16) == {}
    monkeypatch.setattr(cpu_int4, "implementation", lambda r, n, k: cpu_int4.NATIVE)
    assert fused_one_region.chosen_paths(matmuls, 4, torch.bfloat16) == {}
    assert fused_one_region.paths_instead_of_torch(matmuls, 4, torch.bfloat16) is None


def test_4bit_weights_on_the_tiles_need_no_choice(tiny, monkeypatch):  # noqa: F811
    """The tiles' layout has one kernel: the step runs as one region with nothing chosen for
    its 4-bit matmuls, and a per-bucket int4 choice is never asked for."""
    from kvscope.kernels import cpu_int4

    if not (native.available() and cpu_int4.tiles_ready()):
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.TILES)
    model = make_llm(tiny, "int4").engine.model
    matmuls = [model.layers[0].qkv, model.layers[0].gate_up]
    assert all(m.tiles is not None and m.packed is None for m in matmuls)
    monkeypatch.setattr(cpu_int4, "implementation", lambda r, n, k: None)  # nothing chosen
    assert fused_one_region.chosen_paths(matmuls, 4, torch.bfloat16) == {}
    assert fused_one_region.paths_instead_of_torch(matmuls, 4, torch.bfloat16) is None
