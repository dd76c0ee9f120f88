"""The one-region decode step (engine/model/fused/one_region.py, kernels/cpu_decode_step.c) against
the kernel-by-kernel fused step it replaces: the same kernels in the same order, so the
residual stream and every K/V row (codes and scales) it writes are equal bit for bit, on
every model family, weight format, KV dtype and pool transform the fused step takes, on
contexts cut into spans and rows that share prefix blocks."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.fused import decode as fused_decode
from kvscope.engine.model.fused import model_view as fused_model
from kvscope.engine.model.fused import one_region as fused_one_region
from kvscope.kernels import cpu_int4, cpu_linear, native
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.model.fused.test_fused_decode import capture_decode_step
from tests.engine.model.test_weight_formats import tiny  # noqa: F401  (a 4-bit tiny model fixture)

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")

PROMPTS = [[5, 9, 2, 7, 1], [3] * 11, [8, 4], list(range(40, 70))]


def make_llm(path, weights="int4", dtype="float32", kv_dtype="float32", rotation="auto",
             anchors=4, max_len=256, blocks=128) -> LLM:
    return LLM(EngineConfig(model=str(path), device="cpu", weights=weights, block_size=4,
                            num_kv_blocks=blocks, max_model_len=max_len, kv_dtype=kv_dtype,
                            kv_rotation=rotation, kv_anchor_tokens=anchors, dtype=dtype))


def pool_tensors(pool):
    got = [t for pair in pool.caches for t in pair]
    if pool.scales is not None:
        got += [t for pair in pool.scales for t in pair]
    return got


def both_ways(llm, prompts, monkeypatch):
    """(kernel by kernel, one region): each the residual stream after the last layer and the
    pool's tensors after the step, from the same pool state."""
    model = llm.engine.model
    ids, positions, meta, pool = capture_decode_step(llm, prompts)
    assert fused_model.supports_step(meta, pool)
    before = [t.clone() for t in pool_tensors(pool)]
    taken = []
    run = fused_one_region.run

    def spy(*args):
        taken.append(run(*args))
        return taken[-1]
    monkeypatch.setattr(fused_one_region, "run", spy)
    # the native int4 kernel in both: on the tiny test shapes torch's kernel can win the
    # timing (it did on an AVX2 EPYC), and then the one region runs only where it measures
    # faster than the kernel-by-kernel step, which is not what this compares
    monkeypatch.setattr(cpu_int4, "implementation", lambda rows, n, k: cpu_int4.NATIVE)
    monkeypatch.setenv(fused_one_region.ENV, "off")
    by_kernel = fused_decode.run_layers(model, ids, positions, meta, pool).clone()
    after_kernel = [t.clone() for t in pool_tensors(pool)]
    for t, b in zip(pool_tensors(pool), before, strict=True):
        t.copy_(b)
    monkeypatch.setenv(fused_one_region.ENV, "on")
    one = fused_decode.run_layers(model, ids, positions, meta, pool).clone()
    assert taken == [False, True]  # the second step really went through the one region
    return (by_kernel, after_kernel), (one, pool_tensors(pool)), meta


def assert_same(a, b):
    (h_a, pool_a), (h_b, pool_b) = a, b
    assert not bool(h_a.isnan().any())
    assert torch.equal(h_a, h_b)
    for x, y in zip(pool_a, pool_b, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("weights", ["int4", "dense", "int8"])
def test_one_region_equals_the_kernel_by_kernel_step(tiny, kv_dtype, weights, monkeypatch):  # noqa: F811
    by_kernel, one, _ = both_ways(make_llm(tiny, weights, kv_dtype=kv_dtype), PROMPTS,
                                  monkeypatch)
    assert_same(by_kernel, one)


def test_one_region_takes_int8_weights_in_a_bfloat16_model(tiny, monkeypatch):  # noqa: F811
    # the int8 kernel widens the bfloat16 rows and rounds its output, in both ways alike
    by_kernel, one, _ = both_ways(make_llm(tiny, "int8", "bfloat16"), PROMPTS, monkeypatch)
    assert_same(by_kernel, one)


@pytest.mark.parametrize(("rotation", "anchors"), [("hadamard", 4), ("none", 0), ("auto", 0)])
def test_one_region_stores_through_every_pool_transform(tiny, rotation, anchors, monkeypatch):  # noqa: F811
    llm = make_llm(tiny, kv_dtype="int8", rotation=rotation, anchors=anchors)
    by_kernel, one, _ = both_ways(llm, PROMPTS, monkeypatch)
    assert_same(by_kernel, one)


@pytest.mark.parametrize("impl", [cpu_linear.NATIVE, cpu_linear.VEC, cpu_linear.VEC_SERIAL])
def test_one_region_takes_bfloat16_dense_rows(tiny, impl, monkeypatch):  # noqa: F811
    # torch's matmul may win the measured choice for bfloat16 here; both ways must run the
    # same native variant (with or without AMX tiles) for their bits to be comparable
    monkeypatch.setattr(cpu_linear, "implementation", lambda x, w: impl)
    monkeypatch.setattr(cpu_linear, "chosen", lambda *a: impl)
    by_kernel, one, _ = both_ways(make_llm(tiny, "dense", "bfloat16"), PROMPTS, monkeypatch)
    assert_same(by_kernel, one)


def test_one_region_runs_the_chosen_bfloat16_path(tiny, monkeypatch):  # noqa: F811
    """With AMX tiles chosen or not, the step's sums differ in order: the one region follows
    the choice, step by step, rather than keeping the first one it saw."""
    llm = make_llm(tiny, "dense", "bfloat16")
    weight = llm.engine.model.layers[0].gate_up.weight
    if not cpu_linear.amx_applies(weight):
        pytest.skip("no AMX tiles here for this model's weights")
    monkeypatch.setenv(fused_one_region.ENV, "on")
    ids, positions, meta, pool = capture_decode_step(llm, PROMPTS)
    before = [t.clone() for t in pool_tensors(pool)]
    got = {}
    for impl in (cpu_linear.NATIVE, cpu_linear.VEC, cpu_linear.NATIVE):
        for t, b in zip(pool_tensors(pool), before, strict=True):
            t.copy_(b)
        monkeypatch.setattr(cpu_linear, "chosen", lambda *a, impl=impl: impl)
        h = fused_decode.run_layers(llm.engine.model, ids, positions, meta, pool).clone()
        assert torch.equal(got.setdefault(impl, h), h)
    assert not torch.equal(got[cpu_linear.NATIVE], got[cpu_linear.VEC])


def test_one_region_keeps_a_choice_of_torch(tiny, monkeypatch):  # noqa: F811
    llm = make_llm(tiny, "dense")
    model = llm.engine.model
    ids, positions, meta, pool = capture_decode_step(llm, PROMPTS)
    monkeypatch.setattr(cpu_linear, "chosen", lambda *a: cpu_linear.TORCH)
    h = fused_decode.embed(model, ids)
    kv = fused_decode.pool_plan(pool)
    assert not fused_one_region.run(model, kv, h, positions, meta.slot_mapping,
                                    fused_decode.fused_rows.as_rows(meta), torch.float32)
    assert torch.equal(h, fused_decode.embed(model, ids))  # untouched


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_one_region_covers_every_family(arch, tmp_path, monkeypatch):
    path = save_tiny_model(tmp_path / arch, arch, seed=1)
    prompts = [[5, 9, 2, 7, 1], [3] * 11, list(range(40, 61))]  # past the tiny window
    by_kernel, one, _ = both_ways(make_llm(path, "dense"), prompts, monkeypatch)
    assert_same(by_kernel, one)


def test_one_region_on_long_rows_and_shared_prefixes(tiny, monkeypatch):  # noqa: F811
    """Contexts cut into several spans (merged after the attention's first loop), and rows
    that read the same prefix blocks (attended once as one group)."""
    long = [(7 * i) % 97 + 3 for i in range(700)]
    llm = make_llm(tiny, kv_dtype="int8", max_len=1024, blocks=1024)
    by_kernel, one, meta = both_ways(llm, [long, long[:600] + [1, 2], long[:300], [4, 5]],
                                     monkeypatch)
    assert max(meta.context_lens) > 600
    assert_same(by_kernel, one)


def test_the_engine_decodes_the_same_tokens_either_way(tiny, monkeypatch):  # noqa: F811
    prompts = [[5, 9, 2, 7, 1], list(range(40, 70))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(fused_one_region.ENV, mode)
        llm = make_llm(tiny, kv_dtype="fp8")
        got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert got["off"] == got["on"]
