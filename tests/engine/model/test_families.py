"""Every model family against Hugging Face on tiny random checkpoints (float32 weights and KV).

Each family's tiny model (kvscope.testing.tiny_models) exercises its own math: qwen3's q/k
norms, gemma's (1 + w) norms, embedding scale, GELU, sandwich norms, query scalar, soft-caps and
interleaved windows (gemma3: local/global rope, linear scaling on the global layers), mistral's
window on every layer, phi3's fused checkpoint weights, partial rotary and longrope factors.
Prompts run past the windows (8 tokens). Near-ties: the tiny models use initializer_range 0.3
so that the top two logits of a greedy step lie far apart next to float32 rounding; the gemma2
model's head is untied, since a tied head with sqrt(hidden)-scaled embeddings keeps repeating
its input. Greedy tests compare token for token with HF `generate`; teacher-forced tests compare
log-probs within float32 tolerance (engine.scoring.token_log_probs). Run under the torch
reference kernels (KVSCOPE_KERNELS=ref) and under the default backend (the native CPU decode
attention, when it builds).
"""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.kv_cache.calibration import queries_and_keys
from kvscope.engine.scoring import token_log_probs
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_models import PHI3_MAX_LEN, WINDOW, save_tiny_model

# name: (arch, overrides); llama with biases on every projection rides along.
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "gemma2": ("gemma2", {"tie_word_embeddings": False}),
    "gemma3_text": ("gemma3_text", {}),
    "phi3": ("phi3", {}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # Layer 0 global, layer 1 sliding (max_window_layers).
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                               "max_window_layers": 1}),
}


PROMPT_LENGTHS = [5, 41, 23, 1, 60]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    """(name, checkpoint, HF model, HF greedy outputs of PROMPTS): generated once per family,
    Hugging Face generate being the slow part."""
    arch, overrides = FAMILIES[request.param]
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the reference runs as ignore_eos
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, path, hf, want


def use_backend(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("KVSCOPE_KERNELS", backend)


def make_llm(path, **kw) -> LLM:
    cfg = {"weights": "dense", "dtype": "float32", "kv_dtype": "float32",
           "max_model_len": PHI3_MAX_LEN, "block_size": 4, "num_kv_blocks": 256,
           "max_num_batched_tokens": 32, **kw}
    return LLM(EngineConfig(model=str(path), **cfg))


def random_prompts(lengths, seed=0, vocab=250):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts(PROMPT_LENGTHS, seed=1)


def hf_log_probs(hf, ids):
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_the_model_is_the_family_asked_for(tiny):
    name, path, hf, _ = tiny
    model = make_llm(path).engine.model
    assert model.family.model_type == hf.config.model_type
    if name in ("qwen3", "mistral", "gemma2", "gemma3_text", "qwen2_window"):
        assert WINDOW in model.family.layer_windows  # the prompts run past it


@pytest.mark.parametrize(("backend", "block_size"), [("ref", 16), ("auto", 1), ("auto", 16)])
def test_greedy_matches_hf_for_a_batch_past_the_window(tiny, monkeypatch, backend, block_size):
    _, path, _, want = tiny
    use_backend(monkeypatch, backend)
    llm = make_llm(path, block_size=block_size, num_kv_blocks=1024 // block_size)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks


def test_preemption_under_a_tight_pool_keeps_outputs_exact(tiny, monkeypatch):
    name, path, _, want = tiny
    use_backend(monkeypatch, "auto")
    # Mistral windows every layer, so the blocks behind its window go back to the pool as it
    # runs: 16 blocks (64 tokens) serve five sequences of up to 76 tokens without running dry.
    windowed = name == "mistral"
    llm = make_llm(path, block_size=4, num_kv_blocks=16 if windowed else 24,
                   max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert windowed or llm.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == want


def test_mistral_with_a_wider_window_preempts_and_stays_exact(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    use_backend(monkeypatch, "auto")
    llm = make_llm(path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def test_teacher_forced_log_probs_match_hf(tiny):
    _, path, hf, _ = tiny
    llm = make_llm(path, block_size=16, num_kv_blocks=32)
    ids = random_prompts([90], seed=5)[0]
    got = token_log_probs(llm.engine, ids)
    torch.testing.assert_close(got, hf_log_probs(hf, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("weights", "min_cos", "max_kl"), [("int8", 0.995, 0.02),
                                                             ("int4", 0.8, 1.0)])
def test_quantized_weights_stay_close_to_dense(tiny, weights, min_cos, max_kl):
    """int8/int4 weights change the model a little (not an equality): the teacher-forced
    log-probs stay near dense ones. The bounds are loose for int4, whose 4-bit groups on
    these random (initializer_range 0.3) weights flip many greedy choices."""
    _, path, _, _ = tiny
    ids = random_prompts([90], seed=9)[0]
    dense = token_log_probs(make_llm(path, num_kv_blocks=64).engine, ids)
    quant_llm = make_llm(path, weights=weights, num_kv_blocks=64)
    assert quant_llm.engine.weights == weights
    quant = token_log_probs(quant_llm.engine, ids)
    assert not torch.equal(quant, dense)  # really quantized
    kl = float((dense.exp() * (dense - quant)).sum(-1).mean())
    cos = torch.nn.functional.cosine_similarity(dense - dense.mean(-1, keepdim=True),
                                                quant - quant.mean(-1, keepdim=True), dim=-1)
    assert kl < max_kl
    assert float(cos.mean()) > min_cos


def test_calibration_keys_are_the_keys_the_model_writes(tiny):
    """engine.kv_cache.calibration's dense pass (engine.model.dense_forward) runs the family's own
    layer step: its keys equal those the paged forward writes into a float32 pool."""
    _, path, _, _ = tiny
    llm = make_llm(path, kv_rotation="none", block_size=4, num_kv_blocks=64)
    ids = random_prompts([40], seed=3)[0]
    token_log_probs(llm.engine, ids)
    qk = queries_and_keys(llm.engine.model, ids)
    assert len(qk) == len(llm.engine.pool.caches)
    for (_, k), (k_cache, _) in zip(qk, llm.engine.pool.caches, strict=True):
        rows = k_cache.view(-1, *k_cache.shape[2:])[:len(ids)]  # blocks 0.. in order
        torch.testing.assert_close(rows, k, atol=1e-5, rtol=1e-5)


def test_int8_kv_with_its_calibrated_balance_stays_close(tiny):
    """int8 KV (kv_rotation auto: calibrated) moves the log-probs only a little; for gemma2
    the balance has no K shift, which its attention soft-cap would not ignore."""
    name, path, _, _ = tiny
    if name == "qwen2_window":
        pytest.skip("transformers loads the tiny qwen2 tokenizer as Qwen2Tokenizer, which "
                    "encodes the calibration text to no tokens")
    ids = random_prompts([90], seed=9)[0]
    exact = token_log_probs(make_llm(path, num_kv_blocks=64).engine, ids)
    llm = make_llm(path, kv_dtype="int8", num_kv_blocks=64)
    assert llm.stats().kv_rotation == "calibrated"
    balance = llm.engine.pool.k_balance
    assert balance is not None
    if name == "gemma2":
        assert not any(bool(b.shift.any()) for b in balance)
    got = token_log_probs(llm.engine, ids)
    kl = float((exact.exp() * (exact - got)).sum(-1).mean())
    assert 0 < kl < 0.02
