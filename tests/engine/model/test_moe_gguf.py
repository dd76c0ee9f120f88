"""Mixtures of experts from a .gguf file (issue 55): a tiny Qwen3-MoE written as llama.cpp
lays one out (qwen3moe, experts stacked in ffn_{gate,up,down}_exps) loads through transformers'
GGUF reader with its expert width put back (expert_feed_forward_length, which that reader
drops) and generates what Hugging Face generates from the original; a llama-architecture GGUF
with experts (how llama.cpp writes Mixtral, which transformers reads as a dense Llama) is
refused by name before anything is converted."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_gguf import write_tiny_gguf
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the converter caches


def gguf_llm(gguf) -> LLM:
    return LLM(EngineConfig(model=str(gguf), weights="dense", dtype="float32",
                            kv_dtype="float32", block_size=4, num_kv_blocks=128,
                            max_model_len=256))


def test_a_qwen3_moe_gguf_generates_what_hf_generates(tmp_path):
    from transformers import AutoModelForCausalLM

    # llama.cpp's qwen3moe always renormalises its top-k (transformers' reader sets
    # norm_topk_prob so); every layer is sparse.
    path = save_tiny_model(tmp_path / "hf", "qwen3_moe", seed=5, norm_topk_prob=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = gguf_llm(write_tiny_gguf(hf, tmp_path / "tiny-qwen3moe.gguf"))
    model = llm.engine.model
    assert model.family.model_type == "qwen3_moe"
    assert model.moe.num_experts == 8 and model.moe.top_k == 2 and model.moe.normalize
    assert model.layers[0].experts.down[0].shape == (64, 32)  # moe_intermediate_size restored
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (9, 30, 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
    # The window's Open model reads the same file as a model the engine runs.
    from kvscope.app.model_file import read_model

    facts = read_model(tmp_path / "tiny-qwen3moe.gguf")
    assert facts.family == "qwen3_moe" and facts.refusal is None


def test_a_llama_gguf_with_experts_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "tiny-mixtral.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny mixtral")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"llama.expert_count=8.*transformers' GGUF reader maps "
                                         "no experts"):
        gguf_llm(path)
    from kvscope.app.model_file import read_model

    assert "mixture of experts" in (read_model(path).refusal or "")  # the window refuses too
