"""The embedded SmolLM2-135M-Instruct with n-gram drafts: greedy replies equal the replies
without, token for token, on prompts whose replies repeat their input (drafts accepted)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.loading.loader import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this sentence exactly: The harbour clock of Vellmar was built in the spring of "
    "1871 by a watchmaker named Ilse Marrow, who set it by the sun every clear Tuesday.",
    "Rename the variable x to total and show the code:\n\ndef add(xs):\n    x = 0\n"
    "    for v in xs:\n        x += v\n    return x\n",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", torch.float32)


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_both_ways(loaded, prompts, max_tokens, **config):
    """Token ids without drafts and with them (back-off off: every step that can draft
    does), after checking the drafts were accepted and no block is left held."""
    outs = {}
    for method in ("off", "ngram"):
        llm = LLM(EngineConfig(speculative_method=method, **config), loaded)
        llm.engine.spec.backoff.enabled = False
        outs[method] = [o.token_ids for o in
                        llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]
        if method == "ngram":
            assert llm.engine.spec.counters.num_accepted_tokens > 10  # replies repeat prompts
            assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks
    return outs["off"], outs["ngram"]


# int4 is the CPU default for the embedded GGUF. Its near-ties are where a different
# rounding order flips a greedy choice: a verify's rows must round as plain decodes do.
@pytest.mark.parametrize("weights", ["dense", "int4"])
def test_embedded_greedy_with_drafts_equals_without(loaded, weights):
    prompts = [chat(loaded.tokenizer, text) for text in PROMPTS]
    off, ngram = greedy_both_ways(loaded, prompts, 40, weights=weights, block_size=16)
    assert off == ngram


def test_long_document_quotes_agree_with_int4_weights(loaded):
    """Four requests quoting a ~1.2k-token document: their verifies read past the fused
    rows' key limit (engine.model.fused.rows) and the attention cuts long rows into spans, the
    two places where a verify once rounded unlike a plain decode (measured: half of these
    replies differed)."""
    text = (Path(__file__).resolve().parents[3] / "resources" / "spec_grounding.txt").read_text()
    prompts = [chat(loaded.tokenizer, f"{text}\n\nCopy out the {n} paragraph of the text "
                    "above word for word.") for n in ("first", "second", "third", "fourth")]
    off, ngram = greedy_both_ways(loaded, prompts, 64, weights="int4", block_size=16)
    assert off == ngram, [first_difference(a, b) for a, b in zip(off, ngram, strict=True)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
