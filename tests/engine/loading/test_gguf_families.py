"""The new families from a .gguf file: a tiny HF model written as an F32 GGUF (the layout
llama.cpp's converter gives), loaded by the engine through model_files.convert_gguf, must
generate what Hugging Face generates from the original model (issue 24).

Two sets of tiny models: PLAIN ones use only what transformers' GGUF reader carries (its
config keys; defaults for the rest), RESTORED ones use the fields that reader drops and the
engine puts back from the file's metadata (engine.loading.gguf_config): Qwen3's head_dim, Gemma 2's
caps and query scale, Gemma 3's layer pattern and RoPE scaling, Phi-3's window, partial
rotary and longrope factors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.testing.hf_reference import hf_greedy
from kvscope.testing.tiny_gguf import write_tiny_gguf
from kvscope.testing.tiny_models import save_tiny_model

# Per family, a tiny model whose every setting transformers' reader takes from a GGUF;
# it fills the rest with its config defaults, so these are those defaults.
PLAIN = {
    # transformers reads no key_length for qwen3: head_dim is Qwen3Config's 128 (as in every
    # real Qwen3). llama.cpp writes no sliding window for it either.
    "qwen3": {"head_dim": 128, "use_sliding_window": False, "sliding_window": None},
    # The window, head_dim and the layer pattern travel; the caps and the query scalar are
    # Gemma2Config's defaults (50, 30, 256).
    "gemma2": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 256},
    # Six layers: five sliding, one global (Gemma 3's default pattern).
    "gemma3_text": {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 8,
                    "query_pre_attn_scalar": 256, "layer_types": None,
                    "rope_parameters": None},
    # Plain RoPE over the whole head: Phi-3-mini-4k's shape, no longrope factors.
    "phi3": {"rope_parameters": None, "original_max_position_embeddings": 4096},
    # llama.cpp writes Mistral as a llama and keeps no window: a window-free Mistral.
    "mistral": {"sliding_window": None},
}
# The families' own math, as far as llama.cpp's GGUF keys state it (tiny_models' family
# overrides, less what no GGUF says: Qwen3's window; llama.cpp's Gemma query scale is
# head_dim below 27B).
RESTORED = {
    "qwen3": {"head_dim": 16, "use_sliding_window": False, "sliding_window": None},
    "gemma2": {"query_pre_attn_scalar": 16},  # caps 3.0 and 15.0 from tiny_models
    "gemma3_text": {"query_pre_attn_scalar": 16},  # [s, s, full, s], linear x2 on full
    "phi3": {"sliding_window": 8},  # longrope, half the head rotated, from tiny_models
}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the converter caches


def tiny_pair(tmp_path, arch: str, overrides: dict, name: str | None = None):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "hf", arch=arch, seed=5, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf, write_tiny_gguf(hf, tmp_path / f"tiny-{arch}.gguf", name)


def gguf_llm(gguf) -> LLM:
    # max_model_len: within Phi-3's original context, where longrope's table is fixed.
    return LLM(EngineConfig(model=str(gguf), weights="dense", dtype="float32",
                            kv_dtype="float32", block_size=4, num_kv_blocks=128,
                            max_model_len=256))


def as_f32(value):
    """value with every float rounded to float32."""
    if isinstance(value, dict):
        return {k: as_f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_f32(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


def check_generates_like_hf(hf, gguf, arch):
    llm = gguf_llm(gguf)
    assert llm.engine.loaded.hf_config.model_type == ("llama" if arch == "mistral" else arch)
    g = torch.Generator().manual_seed(1)
    # Past the window of 8, and over several blocks.
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 19)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 16)
    return llm


@pytest.mark.parametrize("arch", list(PLAIN))
def test_family_from_gguf_generates_like_hf(tmp_path, arch):
    hf, gguf = tiny_pair(tmp_path, arch, PLAIN[arch])
    check_generates_like_hf(hf, gguf, arch)


@pytest.mark.parametrize("arch", list(RESTORED))
def test_fields_transformers_drops_are_restored_from_the_file(tmp_path, arch):
    from transformers import AutoConfig

    from kvscope.engine.loading.gguf_config import GGUFFacts, restore_config

    hf, gguf = tiny_pair(tmp_path, arch, RESTORED[arch])
    # transformers alone would compute another model...
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    notes = restore_config(config, GGUFFacts(gguf))
    assert notes, "transformers read everything: this case tests nothing"
    # ...the restored config is the original one, field for field that matters.
    want = hf.config.to_dict()
    for key in ("head_dim", "attn_logit_softcapping", "final_logit_softcapping",
                "query_pre_attn_scalar", "layer_types", "sliding_window",
                "original_max_position_embeddings"):
        if key in want:
            assert getattr(config, key, None) == want[key], key
    if arch in ("gemma3_text", "phi3"):
        # A GGUF keeps longrope's factors as float32, as the rotary tables use them.
        assert as_f32(config.rope_parameters) == as_f32(want["rope_parameters"])
    llm = check_generates_like_hf(hf, gguf, arch)
    if arch == "phi3":  # every layer slides the window: its blocks behind it are freed
        assert llm.engine.reclaim_window == 8


def test_a_llama_file_named_mistral_is_refused_clearly(tmp_path):
    _, gguf = tiny_pair(tmp_path, "mistral", PLAIN["mistral"], name="mistral")
    with pytest.raises(ValueError, match="named exactly 'mistral'"):
        gguf_llm(gguf)
