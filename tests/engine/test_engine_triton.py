"""The whole engine on the Triton kernels (interpreted on CPU) gives the reference's tokens."""
from __future__ import annotations

import pytest

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.test_engine_tiny import random_prompts


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_triton_path_matches_reference_path(tmp_path, monkeypatch, kv_dtype):
    path = save_tiny_model(tmp_path, "llama", seed=6)
    prompts = random_prompts([9, 3], seed=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(backend):
        monkeypatch.setenv("KVSCOPE_KERNELS", backend)
        llm = LLM(EngineConfig(model=str(path), block_size=4, num_kv_blocks=32,
                               kv_dtype=kv_dtype, max_num_batched_tokens=8))
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert run("triton") == run("ref")
