"""The embedded SmolLM2-135M-Instruct: greedy output equals Hugging Face generate."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.loading.loader import load_model

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "List three prime numbers and explain why they are prime.",
    "Hi",
    ("Explain the difference between a stack and a queue to a five year old, "
     "using an example from a kitchen."),
]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def loaded():
    return load_model("default", torch.float32)


@pytest.fixture(scope="session")
def hf_model(loaded):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(loaded.checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts(loaded):
    tok = loaded.tokenizer
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="session")
def hf_outputs(hf_model, prompts):
    """HF generate, one prompt at a time (no padding), stopping at EOS like the engine."""
    results = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=MAX_TOKENS, do_sample=False)
            results.append(out[0, len(p):].tolist())
    return results


def strip_eos(tokens, eos_ids):
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_greedy_equals_hf_generate(loaded, prompts, hf_outputs, block_size):
    llm = LLM(EngineConfig(block_size=block_size, max_num_batched_tokens=128, weights="dense"),
              loaded=loaded)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for out, ref in zip(outs, hf_outputs, strict=True):
        # HF pads a finished sequence with pad tokens; compare the real reply.
        assert out.token_ids == ref[:len(out.token_ids)]
        assert strip_eos(out.token_ids, loaded.eos_token_ids) == \
            strip_eos(ref[:len(out.token_ids)], loaded.eos_token_ids)
        assert out.finish_reason in ("stop", "length")
        assert out.text == loaded.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert any(o.finish_reason == "length" for o in outs)
    assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks


def test_greedy_equals_hf_generate_with_preemption(loaded, prompts, hf_outputs):
    # 12 blocks of 16 slots: the five requests together need ~20, so some must be preempted.
    llm = LLM(EngineConfig(block_size=16, num_kv_blocks=12, max_num_batched_tokens=256,
                           weights="dense"),
              loaded=loaded)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert llm.stats().num_preemptions > 0
    for out, ref in zip(outs, hf_outputs, strict=True):
        assert out.token_ids == ref[:len(out.token_ids)]
    assert llm.stats().num_free_blocks == 12


def test_stop_string_cuts_the_text(loaded, prompts, hf_outputs):
    llm = LLM(EngineConfig(), loaded=loaded)
    full = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS))[0].text
    word = full.split()[2]
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, stop=[word]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(word)]


def test_chat_applies_the_template(loaded, prompts, hf_outputs):
    # The default configuration: greedy chat equals Hugging Face float32 token for token.
    llm = LLM(EngineConfig(), loaded=loaded)
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                   SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert out.prompt_token_ids == prompts[0]
    assert out.token_ids == hf_outputs[0][:len(out.token_ids)]
    assert "Paris" in out.text


def test_streamed_deltas_add_up_to_the_text(loaded):
    from kvscope.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(), loaded)
    # Non-ASCII output exercises the multi-byte handling of incremental detokenisation.
    rid = engine.add_request("Translate to Japanese and Greek: good morning, my friend.",
                             SamplingParams(max_tokens=40, temperature=0.8, seed=3))
    pieces = []
    while engine.has_unfinished():
        pieces += [d.text for d in engine.step().outputs if d.request_id == rid]
    out = engine.pop_output(rid)
    assert "".join(pieces) == out.text
    assert all("\ufffd" not in p for p in pieces)
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
