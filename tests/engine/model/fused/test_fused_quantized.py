"""The fused CPU decode step (engine/model/fused/decode.py) on int8 and fp8 KV pools, rotated,
K-balanced and anchored as the defaults make them, against the model's ordinary forward on the
same pool: same hidden states up to rounding, the same codes written, the same greedy
tokens."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.fused import decode as fused_decode
from kvscope.engine.model.fused import model_view as fused_model
from kvscope.kernels import native
from tests.engine.model.fused.test_fused_decode import capture_decode_step
from tests.engine.model.test_weight_formats import tiny  # noqa: F401  (a 4-bit tiny model fixture)

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"{native.ENV}=off")
PROMPTS = [[5, 9, 2, 7, 1], [3] * 11, [8, 4], list(range(40, 70))]


def make_llm(model, kv_dtype, rotation="auto", anchors=4, weights="dense") -> LLM:
    return LLM(EngineConfig(model=str(model), device="cpu", weights=weights, block_size=4,
                            num_kv_blocks=128, max_model_len=256, kv_dtype=kv_dtype,
                            kv_rotation=rotation, kv_anchor_tokens=anchors, dtype="float32"))


def slot_rows(cache, slots):
    return cache.view(-1, *cache.shape[2:])[slots]


def codes(rows):
    """int8 codes as they are; fp8 as the order of their values, one step apart = 1 apart."""
    if rows.dtype == torch.int8:
        return rows.int()
    b = rows.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize(("rotation", "anchors"), [("auto", 4), ("auto", 0), ("hadamard", 4),
                                                   ("none", 0)])
@pytest.mark.parametrize("weights", ["dense", "int4"])
def test_a_fused_step_on_a_1_byte_pool_computes_what_the_torch_step_does(
        tiny, kv_dtype, rotation, anchors, weights):  # noqa: F811
    llm = make_llm(tiny, kv_dtype, rotation, anchors, weights)
    model = llm.engine.model
    ids, positions, meta, pool = capture_decode_step(llm, PROMPTS)
    assert fused_model.supports_step(meta, pool)
    assert (pool.k_balance is not None) == (rotation == "auto")
    assert (pool.anchors is not None) == (anchors > 0)
    assert (meta.anchor_index is not None and bool((meta.anchor_index >= 0).any())) \
        == (anchors > 0)  # the step really reads anchor rows
    slots = meta.slot_mapping
    model.fused_decode = False
    plain = model.forward(ids, positions, meta, pool)
    want = [(slot_rows(k, slots).clone(), slot_rows(v, slots).clone(),
             slot_rows(ks, slots).clone(), slot_rows(vs, slots).clone())
            for (k, v), (ks, vs) in zip(pool.caches, pool.scales, strict=True)]
    for ks, vs in pool.scales:  # the fused step must write these slots itself
        for t in (ks, vs):
            t.view(-1, *t.shape[2:])[slots] = float("nan")
    model.fused_decode = True
    fused = model.forward(ids, positions, meta, pool)
    # dense: the paths differ in float32 rounding order (RoPE, the rotation's sums), and where
    # that moves a value across a code's rounding boundary, by one code step of one element.
    # int4: each matmul input is rounded to bfloat16 in both, in a different order (2^-9).
    bound = 1e-3 if weights == "dense" else 3e-2
    assert float((fused - plain).abs().max() / plain.abs().max()) < bound
    assert torch.equal(model.compute_logits(fused).argmax(-1),
                       model.compute_logits(plain).argmax(-1))
    if weights != "dense":
        return
    # The first layer's rows come from identical inputs up to rounding order: codes at most
    # one step apart (and rarely), scales equal to float32 rounding. Past it, the layers'
    # inputs part by the differences above.
    (k, v), (ks, vs) = pool.caches[0], pool.scales[0]
    kw, vw, ksw, vsw = want[0]
    for got, exp in ((slot_rows(k, slots), kw), (slot_rows(v, slots), vw)):
        diff = (codes(got) - codes(exp)).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02
    assert not bool(slot_rows(ks, slots).isnan().any() or slot_rows(vs, slots).isnan().any())
    torch.testing.assert_close(slot_rows(ks, slots), ksw, rtol=1e-5, atol=0)
    torch.testing.assert_close(slot_rows(vs, slots), vsw, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_greedy_tokens_equal_with_and_without_fusion(tiny, kv_dtype):  # noqa: F811
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fused = make_llm(tiny, kv_dtype)
    plain = make_llm(tiny, kv_dtype)
    plain.engine.model.fused_decode = False
    calls = []
    run_layers = fused_decode.run_layers

    def counted(*a, **k):
        calls.append(1)
        return run_layers(*a, **k)

    fused_decode.run_layers = counted
    try:
        got = [o.token_ids for o in fused.generate(PROMPTS, params)]
    finally:
        fused_decode.run_layers = run_layers
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert calls, "the fused step never ran"
    assert got == want


def test_a_float16_pool_stands_aside_and_says_why(tiny):  # noqa: F811
    llm = make_llm(tiny, "float16")
    _, _, meta, pool = capture_decode_step(llm, [[1, 2, 3]])
    assert not fused_model.supports_step(meta, pool)
    reason = fused_model.pool_reason(pool)
    assert reason is not None and "float16" in reason
