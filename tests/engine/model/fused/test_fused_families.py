"""The fused CPU decode step (engine/model/fused/decode.py) on every model family's tiny checkpoint
(kvscope.testing.tiny_models: qwen3's q/k norms and sliding layer, mistral's window, gemma2's
sandwich norms, gelu-tanh, soft-capping and sliding layers, gemma3's q/k norms and local RoPE
tables, phi3's partial rotary) against the model's ordinary forward on the same weights, and
its greedy tokens against Hugging Face generate."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.fused import decode as fused_decode
from kvscope.engine.model.fused import model_view as fused_model
from kvscope.engine.model.fused import one_region as fused_one_region
from kvscope.engine.server import snapshots
from kvscope.kernels import native
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_models import WINDOW, save_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")

ARCHS = ["mistral", "qwen3", "gemma2", "gemma3_text", "phi3"]
MODES = [("dense", "float32"), ("int4", "float32"), ("dense", "bfloat16")]
# Prompts longer than the tiny models' window (WINDOW), so sliding layers drop keys.
PROMPTS = [[5, 9, 2, 7, 1], [3] * 11, list(range(40, 61))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = save_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=1)
        return made[arch]
    return get


def make_llm(path, weights="dense", dtype="float32", kv_dtype="float32") -> LLM:
    return LLM(EngineConfig(model=str(path), device="cpu", weights=weights, block_size=4,
                            num_kv_blocks=128, max_model_len=256, kv_dtype=kv_dtype,
                            dtype=dtype))


def decode_step(llm, prompts=PROMPTS, skip=2):
    """(input_ids, positions, meta, pool) of the (skip+1)-th step in which every row decodes:
    past the window on the longer prompts."""
    engine, model = llm.engine, llm.engine.model
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    seen = []
    forward = model.forward

    def grab(ids, positions, meta, pool):
        if not meta.prefill_seqs:
            seen.append((ids.clone(), positions.clone(), meta, pool))
        return forward(ids, positions, meta, pool)
    model.forward = grab
    while len(seen) <= skip:
        engine.step()
    model.forward = forward
    return seen[skip]


def forward(model, fused, step):
    model.fused_decode = fused
    try:
        return model.forward(*step)
    finally:
        model.fused_decode = True


def relative(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# Dense float32: the same float32 ops in another order (norm sums, matmul and attention
# accumulation, fused multiply-adds), a few ulp (1e-7) per op through 2-4 layers; measured <=
# 1.5e-6. int4: both steps round each matmul input to bfloat16 (2^-9); where the orders differ an
# element can land on the other side of a bfloat16 step and carry on, as in
# tests/engine/model/fused/test_fused_decode.py. Dense bfloat16: the ordinary forward rounds the
# residual stream, norm outputs and activations to bfloat16 (2^-8 steps) after every op where this
# step keeps float32, and the two part by up to 4.4 % of the largest value (phi3, measured): a loose
# bound, backed by a tighter check against the float32 model below.
BOUND = {("dense", "float32"): 1e-5, ("int4", "float32"): 2e-2, ("dense", "bfloat16"): 2 ** -4}


@pytest.mark.parametrize(("weights", "dtype"), MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_fused_step_computes_what_the_ordinary_forward_does(checkpoints, arch, weights,
                                                              dtype):
    llm = make_llm(checkpoints(arch), weights, dtype)
    model = llm.engine.model
    assert fused_model.unsupported_reason(model) is None
    assert model.fused_decode
    step = decode_step(llm)
    ids, positions, meta, pool = step
    assert fused_model.supports_step(meta, pool)
    slots = meta.slot_mapping
    plain = forward(model, False, step)
    kv_plain = [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
                for k, v in pool.caches]
    for k, v in pool.caches:  # the fused step must write these slots itself
        k.view(-1, *k.shape[2:])[slots] = float("nan")
        v.view(-1, *v.shape[2:])[slots] = float("nan")
    fused = forward(model, True, step)
    assert relative(fused, plain) < BOUND[weights, dtype]
    if dtype == "bfloat16":  # its float32 stream keeps it as close to the float32 model
        exact = make_llm(checkpoints(arch)).engine.model.forward(*step)
        assert relative(fused, exact) < 1.25 * relative(plain, exact)
    # K and V as written: q/k norms and RoPE (partial, local) on k. A bfloat16 model's K/V
    # past the first layer part by more than rounding order (its residual stream rounds), and
    # in the first its RoPE rounds each product to bfloat16: 4 steps (2^-8) of the largest.
    layers = 1 if dtype == "bfloat16" else len(pool.caches)
    tol = 1e-5 if (weights, dtype) == ("dense", "float32") else 2e-2
    for (k, v), (kp, vp) in list(zip(pool.caches, kv_plain, strict=True))[:layers]:
        for got, want in ((k.view(-1, *k.shape[2:])[slots], kp),
                          (v.view(-1, *v.shape[2:])[slots], vp)):
            if dtype == "bfloat16":
                assert relative(got, want) < 4 * 2 ** -8
            else:
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype == "float32":
        assert torch.equal(model.compute_logits(fused).argmax(-1),
                           model.compute_logits(plain).argmax(-1))


def ablations(model):
    """The family's features, each as a change that turns it off in the fused step only:
    name -> a callable that applies it (undone by monkeypatch)."""
    family, layers, tables = model.family, model.layers, model.fused_tables
    none = [None] * len(layers)
    out = {}
    if family.embed_scale != 1.0:
        out["embed_scale"] = ("family", dataclasses.replace(family, embed_scale=1.0))
    if family.activation == "gelu_tanh":
        out["gelu_tanh"] = ("family", dataclasses.replace(family, activation="silu"))
    if family.attn_softcap:
        out["softcap"] = ("family", dataclasses.replace(family, attn_softcap=0.0))
    if any(t is not None for t in tables.q_norms):
        out["qk_norm"] = ("tables", dataclasses.replace(tables, q_norms=none, k_norms=none))
    if any(t is not None for t in tables.attn_out_norms):
        out["sandwich"] = ("tables", dataclasses.replace(tables, attn_out_norms=none,
                                                         mlp_out_norms=none))
    if tables.local_cos is not None:
        out["local_rope"] = ("tables", dataclasses.replace(tables, local_cos=tables.cos,
                                                           local_sin=tables.sin))
    if any(layer.window for layer in layers):
        out["window"] = ("window", None)
    return out


def windowless(attention):
    """fused_decode.attention with its window argument (the sixth) dropped."""
    return lambda *a, **kw: attention(*a[:5], 0, *a[6:], **kw)


EXPECTED = {"mistral": {"window"}, "qwen3": {"qk_norm", "window"},
            "gemma2": {"embed_scale", "gelu_tanh", "softcap", "sandwich", "window"},
            "gemma3_text": {"embed_scale", "gelu_tanh", "qk_norm", "sandwich", "local_rope",
                            "window"},
            "phi3": set()}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_feature_changes_the_fused_step(checkpoints, arch, monkeypatch):
    """The comparison above would catch a feature the fused step skipped: on these tiny
    models, turning any one of them off in the fused step alone moves its hidden states far
    past the float32 bound."""
    # The ablations patch the kernel-by-kernel step's Python (engine.model.fused.one_region has
    # its own equality test against it on every family).
    monkeypatch.setenv(fused_one_region.ENV, "off")
    llm = make_llm(checkpoints(arch))
    # Keep the blocks behind an all-windowed model's window (mistral frees them): switching
    # the window off must read them, and this asks what the fused attention's window does.
    llm.engine.reclaim_window = 0
    model = llm.engine.model
    if arch == "phi3":  # partial rotary: nothing to switch off, but it must be partial
        assert model.fused_tables.cos.shape[1] < model.shape.head_dim
    step = decode_step(llm)
    plain = forward(model, False, step)
    found = ablations(model)
    assert set(found) == EXPECTED[arch]
    for name, (kind, value) in found.items():
        with monkeypatch.context() as mp:
            if kind == "family":
                mp.setattr(model, "family", value)
            elif kind == "tables":
                mp.setattr(model, "fused_tables", value)
            else:
                mp.setattr(fused_decode, "attention", windowless(fused_decode.attention))
            assert relative(forward(model, True, step), plain) > 1e-3, name


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_the_fused_step_equals_hugging_face(checkpoints, arch):
    path = checkpoints(arch)
    llm = make_llm(path)
    assert llm.engine.model.fused_decode
    n = 16  # the prompts plus n stay under phi3's longrope boundary (48 positions)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, n)


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_greedy_equals_with_and_without_fusion(checkpoints, arch):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fused = make_llm(checkpoints(arch), weights="int4")
    plain = make_llm(checkpoints(arch), weights="int4")
    assert fused.engine.model.fused_decode
    plain.engine.model.fused_decode = False
    got = [o.token_ids for o in fused.generate(PROMPTS, params)]
    assert got == [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_a_family_it_does_not_cover_is_named_once(checkpoints, monkeypatch, caplog):
    """A family the fused step does not know runs the ordinary forward, says why in one log
    line, and the notice the window shows is that line."""
    llm = make_llm(checkpoints("qwen3"))
    model = llm.engine.model
    monkeypatch.setattr(fused_model, "COVERED_FAMILIES", ("llama",))
    monkeypatch.setattr(fused_model, "_told", set())
    with caplog.at_level("WARNING", logger="kvscope.engine"):
        reason = fused_model.unsupported_reason(model)
        assert fused_model.unsupported_reason(model) == reason
    assert reason is not None and "qwen3" in reason
    assert [r.getMessage() for r in caplog.records if r.name == "kvscope.engine"] == [reason]
    assert fused_model.decode_path_notice(model) == reason
    # What the window receives: the hello's (and every stats frame's) EngineSettings.
    assert snapshots.engine_settings(llm.engine).decode_path_notice == reason
    monkeypatch.undo()
    assert fused_model.decode_path_notice(model) == ""
    assert snapshots.engine_settings(llm.engine).decode_path_notice == ""


def test_the_window_and_softcap_need_the_native_attention_to_take_them(checkpoints,
                                                                      monkeypatch):
    model = make_llm(checkpoints("gemma2")).engine.model
    assert model.family.attn_softcap and WINDOW in model.family.layer_windows

    def old_attention(query, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None,
                      anchors=None):
        raise AssertionError("not called")
    monkeypatch.setattr(fused_decode.cpu_attention, "paged_attention_cpu", old_attention)
    monkeypatch.setattr(fused_model, "_told", set())
    reason = fused_model.unsupported_reason(model)
    assert reason is not None and "sliding window" in reason
    mistral = make_llm(checkpoints("mistral"))  # built while the attention lacks `window`
    assert not mistral.engine.model.fused_decode


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels did not build")
@pytest.mark.parametrize(("arch", "weights", "said"), [("qwen2", "dense", "bias"),
                                                        ("qwen2", "int8", "bias")])
def test_weights_the_fused_step_cannot_take_are_said_not_silent(checkpoints, monkeypatch,
                                                                 caplog, arch, weights, said):
    """qwen2's q/k/v bias keeps the decode on the ordinary forward, whatever the weights: one
    log line says so, and so does the window's notice; a model that fuses has none."""
    monkeypatch.setattr(fused_model, "_told", set())
    with caplog.at_level("WARNING", logger="kvscope.engine"):
        llm = make_llm(checkpoints(arch), weights=weights)
    model = llm.engine.model
    assert not model.fused_decode
    notice = snapshots.engine_settings(llm.engine).decode_path_notice
    assert said in notice and notice == model.matmul_reason
    assert [r.getMessage() for r in caplog.records if r.name == "kvscope.engine"] == [notice]
    fused = make_llm(checkpoints("llama")).engine
    assert fused.model.fused_decode
    assert snapshots.engine_settings(fused).decode_path_notice == ""
