"""The embedded SmolLM2-135M-Instruct with n-gram drafts: greedy replies equal the replies
without, token for token, on prompts whose replies repeat their input (drafts accepted)."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.loader import load_model

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


# Dense weights only: with int4 weights (the CPU default for the embedded GGUF) the fused
# one-token decode and the ordinary forward a verify takes use different int4 matmul paths,
# which round differently and, at a near-tie, flip a greedy choice (measured: the replies
# agreed for their first tokens, then differed), as a preemption's recompute can too.
@pytest.mark.parametrize("weights", ["dense"])
def test_embedded_greedy_with_drafts_equals_without(loaded, weights):
    tok = loaded.tokenizer
    prompts = []
    for text in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    params = SamplingParams(max_tokens=40)
    outs = {}
    for method in ("off", "ngram"):
        llm = LLM(EngineConfig(weights=weights, speculative_method=method, block_size=16), loaded)
        outs[method] = llm.generate(prompts, params)
        if method == "ngram":
            c = llm.engine.spec.counters
            assert c.num_accepted_tokens > 10  # the replies repeat the prompts
            assert llm.stats().num_free_blocks == llm.stats().num_kv_blocks
    for a, b in zip(outs["off"], outs["ngram"], strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
