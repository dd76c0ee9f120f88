"""Mixtures of experts (Mixtral, Qwen3-MoE) against Hugging Face on tiny random checkpoints.

Greedy generate token for token in float32 (block sizes 1 and 16, a batch of mixed lengths,
under preemption, with prefix-cache hits), the router's chosen experts and weights and the
whole MoE block against Hugging Face's own modules on the same hidden states, the experts run
grouped by expert, int8/int4 expert weights close to dense, and the expert load counted.
The tiny models (kvscope.testing.tiny_models) have 8 experts, top-2; one Qwen3-MoE keeps a
dense layer (mlp_only_layers) and normalises nothing, one normalises its top-k and makes every
other layer dense (decoder_sparse_step 2); one Mixtral slides a window on every layer.
"""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.moe import moe_mlp, route
from kvscope.engine.model.weight_formats import DenseLinear, Int4Linear, Int8Linear
from kvscope.engine.scoring import token_log_probs
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_models import WINDOW, save_tiny_model

MODELS = {
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", {"sliding_window": WINDOW}),
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3_moe_norm": ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2,
                                     "norm_topk_prob": True}),
    # use_sliding_window: Qwen3-MoE slides the window on every layer.
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": WINDOW}),
}
WINDOWED = ("mixtral_window", "qwen3_moe_window")
PROMPT_LENGTHS = [5, 41, 23, 1, 60]
MAX_TOKENS = 16


def random_prompts(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts(PROMPT_LENGTHS, seed=1)


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    """(name, checkpoint, HF model, HF greedy outputs of PROMPTS)."""
    arch, overrides = MODELS[request.param]
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return request.param, path, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def make_llm(path, **kw) -> LLM:
    cfg = {"weights": "dense", "dtype": "float32", "kv_dtype": "float32", "max_model_len": 256,
           "block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 32, **kw}
    return LLM(EngineConfig(model=str(path), **cfg))


def greedy(n=MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def sparse_layers(model):
    return [(i, layer.experts) for i, layer in enumerate(model.layers)
            if layer.experts is not None]


def test_the_model_has_the_layers_the_config_makes_sparse(tiny):
    name, path, hf, _ = tiny
    model = make_llm(path).engine.model
    hf_sparse = [i for i, layer in enumerate(hf.model.layers)
                 if type(layer.mlp).__name__.endswith("SparseMoeBlock")]
    assert [i for i, _ in sparse_layers(model)] == hf_sparse
    assert (len(hf_sparse) < len(hf.model.layers)) == (name in ("qwen3_moe", "qwen3_moe_norm"))
    assert model.fused_reason is not None  # the fused CPU decode has no experts: said
    # The window's calculator (kvmath, from config.json) sees the windows the engine runs.
    import json

    from kvscope.kvmath.windows import layer_windows

    config = json.loads((path / "config.json").read_text())
    assert layer_windows(config) == list(model.family.layer_windows)
    assert (WINDOW in model.family.layer_windows) == (name in WINDOWED)


@pytest.mark.parametrize(("backend", "block_size"), [("ref", 16), ("auto", 1), ("auto", 16)])
def test_greedy_matches_hf_for_a_batch_of_mixed_lengths(tiny, monkeypatch, backend, block_size):
    _, path, _, want = tiny
    monkeypatch.setenv("KVSCOPE_KERNELS", backend)
    llm = make_llm(path, block_size=block_size, num_kv_blocks=1024 // block_size)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == want
    assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks


def test_preemption_under_a_tight_pool_keeps_outputs_exact(tiny):
    name, path, _, want = tiny
    windowed = name in WINDOWED  # blocks behind the window go back to the pool
    llm = make_llm(path, block_size=4, num_kv_blocks=16 if windowed else 24,
                   max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, greedy())
    assert windowed or llm.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == want


def test_speculative_verifies_keep_outputs_exact(tiny, monkeypatch):
    """Drafts verified in one forward (several rows per sequence through the experts) and
    rolled back where rejected: the tokens stay HF's. The drafts come from an oracle that
    knows HF's answer and spoils some of it (tests/engine/spec_decode/spec_oracle.py), so
    accepted and rejected tokens both occur."""
    from kvscope.engine.spec_decode import decoder as spec_decode
    from tests.engine.spec_decode.spec_oracle import Oracle

    _, path, _, want = tiny
    oracle = Oracle({tuple(p): w for p, w in zip(PROMPTS, want, strict=True)}, 256)
    monkeypatch.setattr(spec_decode, "propose_matched", oracle.matched)
    llm = make_llm(path, speculative_method="ngram", num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == want
    c = llm.engine.spec.counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens


def test_prefix_cache_hits_keep_outputs_exact(tiny):
    """Prompts sharing a 24-token prefix: the second batch reads the first's blocks."""
    _, path, hf, _ = tiny
    shared = random_prompts([24], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 1], seed=8)]
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], greedy())
    rest = llm.generate(prompts[1:], greedy())
    assert llm.stats().prefix_cache_hits >= 2 * 24
    got = [o.token_ids for o in first + rest]
    assert got == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_teacher_forced_log_probs_match_hf(tiny):
    _, path, hf, _ = tiny
    llm = make_llm(path, block_size=16, num_kv_blocks=32)
    ids = random_prompts([90], seed=5)[0]
    got = token_log_probs(llm.engine, ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_int8_kv_calibrates_through_the_experts(tiny):
    """int8 KV's calibration runs the model's own layers (engine.model.dense_forward), experts
    included: its keys are the ones the paged forward writes, and the log-probs stay near the
    float32 pool's (the bound is looser than a dense family's: on these peaked tiny models a
    small change of a hidden state flips near-tied routing choices, and Mixtral's, without
    q/k norms, moves most; a wrong calibration costs nats)."""
    from kvscope.engine.kv_cache.calibration import queries_and_keys

    _, path, _, _ = tiny
    exact_llm = make_llm(path, kv_rotation="none", num_kv_blocks=64)
    ids = random_prompts([40], seed=3)[0]
    exact = token_log_probs(exact_llm.engine, ids)
    qk = queries_and_keys(exact_llm.engine.model, ids)
    for (_, k), (k_cache, _) in zip(qk, exact_llm.engine.pool.caches, strict=True):
        rows = k_cache.view(-1, *k_cache.shape[2:])[:len(ids)]
        torch.testing.assert_close(rows, k, atol=1e-5, rtol=1e-5)
    llm = make_llm(path, kv_dtype="int8", num_kv_blocks=64)
    assert llm.stats().kv_rotation == "calibrated"
    got = token_log_probs(llm.engine, ids)
    kl = (exact.exp() * (exact - got)).sum(-1)
    assert 0 < float(kl.median()) < 0.3


def hidden_states(n, size, seed=0):
    return torch.randn(n, size, generator=torch.Generator().manual_seed(seed))


def test_routing_is_hf_routing(tiny):
    """The experts each row picks and their weights, from HF's router module and ours on
    the same hidden states."""
    _, path, hf, _ = tiny
    model = make_llm(path).engine.model
    for i, experts in sparse_layers(model):
        x = hidden_states(53, hf.config.hidden_size, seed=i)
        with torch.inference_mode():
            _, hf_weights, hf_experts = hf.model.layers[i].mlp.gate(x)
            weights, chosen = route(x, experts.router, model.moe)
        assert torch.equal(chosen, hf_experts)
        assert weights.dtype == hf_weights.dtype
        torch.testing.assert_close(weights, hf_weights, rtol=1e-5, atol=1e-6)
        if model.moe.normalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(53))


def test_the_block_is_hf_block(tiny):
    _, path, hf, _ = tiny
    model = make_llm(path).engine.model
    for i, experts in sparse_layers(model):
        x = hidden_states(40, hf.config.hidden_size, seed=10 + i)
        with torch.inference_mode():
            want = hf.model.layers[i].mlp(x[None])[0]
            got = moe_mlp(x, experts, model.moe, model.family.activation)
        # float32 rounding of outputs tens in size (the tiny models' weights are peaked).
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_the_block_is_hf_block_in_bfloat16(tiny):
    """In a bfloat16 model Mixtral weighs its experts' outputs in float32 and rounds the sum
    once; Qwen3-MoE casts the routing weights to bfloat16 first: each as its HF block does."""
    import copy

    _, path, hf, _ = tiny
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    model = make_llm(path, dtype="bfloat16", kv_dtype="bfloat16").engine.model
    for i, experts in sparse_layers(model):
        x = hidden_states(40, hf.config.hidden_size, seed=30 + i).to(torch.bfloat16)
        with torch.inference_mode():
            want = hf16.model.layers[i].mlp(x[None])[0]
            got = moe_mlp(x, experts, model.moe, model.family.activation)
            weights, _ = route(x, experts.router, model.moe)
            _, hf_weights, _ = hf16.model.layers[i].mlp.gate(x)
        assert got.dtype == torch.bfloat16
        assert weights.dtype == hf_weights.dtype  # float32 for Mixtral, bfloat16 for Qwen3-MoE
        # bfloat16 matmuls round in their own order on each side: a few units of its 8 bits.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_experts_run_once_per_step_over_all_their_tokens(tiny):
    """Grouped by expert: per layer and forward, one gate|up call per expert any token chose,
    over all of that expert's rows, never one call per (token, expert) pair."""
    _, path, _, _ = tiny
    llm = make_llm(path)
    model = llm.engine.model
    calls: dict[tuple[int, int], list[int]] = {}
    for i, experts in sparse_layers(model):
        for e, linear in enumerate(experts.gate_up):
            def counted(x, linear=linear, key=(i, e)):
                calls.setdefault(key, []).append(x.shape[0])
                return linear(x)
            experts.gate_up[e] = counted
    prompts = random_prompts([40] * 4, seed=11)
    llm.generate(prompts, greedy(2))
    top_k, sparse = model.moe.top_k, len(sparse_layers(model))
    # Each forward's rows: prefill chunks then decodes; every (token, layer) pair is routed
    # to top_k experts, so rows over all calls add up to that.
    total_rows = sum(sum(rows) for rows in calls.values())
    fed = sum(len(p) + 1 for p in prompts)  # prompts, then one decode each (2 tokens)
    assert total_rows == fed * top_k * sparse
    forwards = llm.stats().num_steps
    assert max(len(rows) for rows in calls.values()) <= forwards
    assert any(max(rows) > 1 for rows in calls.values())


def expert_outputs(experts, x, activation):
    from kvscope.engine.model.moe import activate

    return [down(activate(gate_up(x), activation))
            for gate_up, down in zip(experts.gate_up, experts.down, strict=True)]


@pytest.mark.parametrize(("weights", "kind", "min_cos"),
                         [("int8", Int8Linear, 0.9999), ("int4", Int4Linear, 0.98)])
def test_quantized_experts_stay_close_to_dense(tiny, weights, kind, min_cos):
    """Every expert's matmuls take the weight format, the router stays dense (so a token
    picks the same experts from the same rows), and each expert's output stays close to its
    dense one. The whole tiny model's log-probs move more than a dense family's: a small change
    of the hidden state flips a near-tied routing choice (a discontinuity of any MoE); int8
    still keeps the typical position's KL small."""
    _, path, _, _ = tiny
    dense_llm = make_llm(path, num_kv_blocks=64)
    llm = make_llm(path, weights=weights, num_kv_blocks=64)
    model = llm.engine.model
    for (i, experts), (_, dense) in zip(sparse_layers(model), sparse_layers(dense_llm.engine.model),
                                        strict=True):
        assert isinstance(experts.router, DenseLinear)
        assert all(isinstance(x, kind) for x in experts.gate_up + experts.down)
        x = hidden_states(64, model.shape.hidden_size, seed=20 + i)
        with torch.inference_mode():
            assert torch.equal(route(x, experts.router, model.moe)[1],
                               route(x, dense.router, model.moe)[1])
            for got, want in zip(expert_outputs(experts, x, model.family.activation),
                                 expert_outputs(dense, x, model.family.activation), strict=True):
                cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
                assert float(cos) > min_cos
    ids = random_prompts([90], seed=9)[0]
    exact = token_log_probs(dense_llm.engine, ids)
    quant = token_log_probs(llm.engine, ids)
    assert not torch.equal(quant, exact)
    if weights == "int8":
        kl = (exact.exp() * (exact - quant)).sum(-1)
        assert float(kl.median()) < 0.05


def test_expert_load_counts_every_routed_token(tiny):
    _, path, _, _ = tiny
    llm = make_llm(path)
    model = llm.engine.model
    llm.generate(PROMPTS, greedy())
    fed = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    routed = model.moe.top_k * len(sparse_layers(model))
    assert sum(model.expert_load.totals()) == fed * routed
    assert len(model.expert_load.last_step()) == model.moe.num_experts
    # The last step decoded the longest prompt's last token alone or with others.
    assert 0 < sum(model.expert_load.last_step()) <= len(PROMPTS) * routed


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.0.down_proj.weight",
                                  "model.layers.0.block_sparse_moe.experts.0.w2.weight"])
def test_auto_weights_see_a_4_bit_mixture_of_experts(name):
    """weights='auto' picks int4 for a checkpoint whose experts are 4-bit already (a Q4
    GGUF's), probing the first expert where a dense model has its MLP."""
    from kvscope.engine.model.weight_formats import dequantize_int4, quantize_int4, resolve_weights

    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert resolve_weights("auto", "cpu", {name: dequantize_int4(*quantize_int4(w))}) == "int4"
    assert resolve_weights("auto", "cpu", {name: w}) == "dense"
