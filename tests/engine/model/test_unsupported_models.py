"""Models the engine cannot compute exactly are refused from their config, before any weight
is read, with an error naming the model type or field and the supported families."""
from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine import LLM, EngineConfig
from kvscope.engine.loading import checkpoint_files as model_files
from kvscope.engine.model.support import check_supported
from kvscope.testing.tiny_models import save_tiny_model

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def config(model_type, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**SMALL, **fields})


REFUSALS = [
    ("qwen2_moe", {}, "mixture of experts"),
    ("olmoe", {}, "mixture of experts"),
    # Routing variants in the MoE families the engine runs, named by their field.
    ("qwen3_moe", {"shared_expert_intermediate_size": 32},
     "shared experts (shared_expert_intermediate_size=32)"),
    ("qwen3_moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("mixtral", {"n_group": 4, "topk_group": 2}, "group-limited routing (n_group=4)"),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 6},
     "num_experts_per_tok=6 with 4 experts"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ("deepseek_v3", {"kv_lora_rank": 16, "q_lora_rank": 16}, "multi-head latent attention"),
    ("gemma3", {}, "vision tower"),
    ("llava", {}, "vision tower"),
    ("qwen2_vl", {}, "vision tower"),
    ("qwen3_next", {}, "hybrid linear"),
    ("gpt_oss", {}, "mixture of experts"),
    ("gpt2", {}, "is not supported: expected one of"),
    ("llama", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
     "rope_type 'proportional'"),
    ("qwen2", {"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}},
     "rope_type 'mrope'"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ("qwen3", {"layer_types": ["full_attention", "linear_attention"]}, "layer_types"),
]


@pytest.mark.parametrize(("model_type", "fields", "message"), REFUSALS,
                         ids=[f"{r[0]}-{r[2].split()[0]}" for r in REFUSALS])
def test_refusal_names_what_is_not_supported(model_type, fields, message):
    cfg = config(model_type, **fields)
    with pytest.raises(ValueError) as err:
        check_supported(cfg)
    text = str(err.value)
    assert message in text
    assert repr(cfg.model_type) in text
    assert "gemma3_text" in text and "phi3" in text  # the supported families are listed


def test_attention_sinks_are_refused():
    cfg = config("llama")
    cfg.use_attention_sinks = True
    with pytest.raises(ValueError, match="attention sinks .*use_attention_sinks"):
        check_supported(cfg)


@pytest.mark.parametrize(("model_type", "fields", "limit"), [
    ("phi3", {"max_position_embeddings": 512, "original_max_position_embeddings": 128,
              "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                               "long_factor": [2.0] * 8}}, 128),
    ("llama", {"max_position_embeddings": 256,
               "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 256),
])
def test_length_dependent_rope_is_refused_past_its_length(model_type, fields, limit):
    cfg = config(model_type, **fields)
    check_supported(cfg, max_model_len=limit)
    with pytest.raises(ValueError, match=f"max_model_len <= {limit}"):
        check_supported(cfg, max_model_len=limit + 1)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2",
                                        "gemma3_text", "phi3", "qwen3_moe", "mixtral"])
def test_supported_families_pass(model_type):
    check_supported(config(model_type, head_dim=16))


def test_a_refused_checkpoint_reads_no_weights(tmp_path, monkeypatch):
    path = save_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4,
               shared_expert_intermediate_size=32)
    (path / "config.json").write_text(json.dumps(cfg))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read for a refused model")

    monkeypatch.setattr(model_files, "load_state_dict", no_weights)
    monkeypatch.setattr(model_files, "load_tokenizer", no_weights)
    with pytest.raises(ValueError, match="'qwen2_moe': mixture of experts"):
        LLM(EngineConfig(model=str(path), weights="dense", dtype="float32"))


def test_longrope_past_its_boundary_is_refused_at_engine_start(tmp_path):
    path = save_tiny_model(tmp_path / "m", "phi3")
    with pytest.raises(ValueError, match="rope_type 'longrope' past "
                                         "original_max_position_embeddings=256"):
        LLM(EngineConfig(model=str(path), weights="dense", dtype="float32",
                         max_model_len=512))


def test_a_checkpoint_tensor_the_engine_would_not_use_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m", "llama")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensors the engine does not compute "
                                         r"\(layers.0.self_attn.q_norm.weight\)"):
        LLM(EngineConfig(model=str(path), weights="dense", dtype="float32"))


def test_the_window_refuses_what_the_engine_refuses():
    """kvmath.model_support over config.json's dict (what the window reads, without
    transformers) refuses every model the engine refuses, naming the same thing (the lists
    of fields differ where transformers aliases one: num_experts for num_local_experts),
    and none the engine runs; its names match the engine's math."""
    from kvscope.engine.model import family, rope
    from kvscope.kvmath import model_support

    for model_type, fields, message in REFUSALS:
        cfg = config(model_type, **fields)
        with pytest.raises(ValueError):
            check_supported(cfg)
        why = model_support.refusal(json.loads(cfg.to_json_string()))
        assert why is not None and message in why and repr(cfg.model_type) in why
    for model_type in family.SUPPORTED_FAMILIES:
        assert model_support.refusal(json.loads(config(model_type).to_json_string())) is None
    assert model_support.SUPPORTED_FAMILIES == family.SUPPORTED_FAMILIES
    assert model_support.GEMMA_FAMILIES == family.GEMMA_FAMILIES
    assert model_support.ATTENTION_LAYER_TYPES == family.ATTENTION_LAYER_TYPES
    assert model_support.ACTIVATIONS == family.ACTIVATIONS
    assert model_support.PER_LAYER_TYPE == rope.PER_LAYER_TYPE
    assert set(model_support.MOE_FAMILIES) <= set(rope.ROTARY_CLASSES)
