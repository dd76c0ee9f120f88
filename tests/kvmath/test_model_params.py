"""kvmath.model_params: a model's total parameters equal Hugging Face's own model of the same
config, its active ones what a token runs through (the experts it is not routed to left out),
and the calculator's MoE presets match their published model cards."""
from __future__ import annotations

import pytest

from kvscope.kvmath import presets
from kvscope.kvmath.model_params import param_count
from kvscope.testing.tiny_models import FAMILY_OVERRIDES

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
CASES = [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("gemma2", {}), ("gemma3_text", {}), ("phi3", {}), ("mixtral", {}),
    ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
]


def hf_model(arch, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**SMALL, **FAMILY_OVERRIDES[arch], **overrides})
    return AutoModelForCausalLM.from_config(cfg)


def inactive_experts(model) -> int:
    """Parameters of the experts a token is not routed to, over the MoE layers."""
    cfg, out = model.config, 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            one = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
            out += (experts.num_experts - cfg.num_experts_per_tok) * one
    return out


@pytest.mark.parametrize(("arch", "overrides"), CASES,
                         ids=[f"{a}-{'-'.join(o) or 'plain'}" for a, o in CASES])
def test_totals_and_active_match_hf(arch, overrides):
    model = hf_model(arch, overrides)
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once
    got = param_count(model.config.to_dict())
    assert got.total == total
    assert got.active == total - inactive_experts(model)
    assert got.moe == (arch in ("mixtral", "qwen3_moe"))


def test_moe_presets_match_their_model_cards():
    qwen = param_count(presets.QWEN3_30B_A3B)  # "30.5B in total and 3.3B activated"
    assert round(qwen.total / 1e9, 1) == 30.5
    assert qwen.active == pytest.approx(3.3e9, rel=0.02)  # 3.35B with both embeddings
    mixtral = param_count(presets.MIXTRAL_8X7B)  # "46.7B total, 12.9B per token"
    assert round(mixtral.total / 1e9, 1) == 46.7
    assert round(mixtral.active / 1e9, 1) == 12.9
    qwen2 = param_count(presets.QWEN2_7B)  # the hub's "7.62B params"
    assert round(qwen2.total / 1e9, 2) == 7.62 and not qwen2.moe


def test_the_calculators_moe_presets_count_every_expert_for_what_fits():
    """What fits swaps in a preset's weights: all of a mixture's experts (its total), while a
    token reads only its active ones."""
    from kvscope.app.calculator import kv_math

    for name, total_b, active_b in (("Qwen3-30B-A3B (MoE)", 30.5, 3.35),
                                    ("Mixtral-8x7B (MoE)", 46.7, 12.9)):
        assert round(kv_math.PRESET_PARAMS_B[name], 1) == total_b
        assert round(kv_math.PRESET_ACTIVE_PARAMS_B[name], 2 if active_b < 10 else 1) == active_b
        assert kv_math.preset_weights_bytes(name) == int(kv_math.PRESET_PARAMS_B[name] * 2e9)
    assert kv_math.PRESETS["Qwen3-30B-A3B (MoE)"] == (48, 4, 128)
    assert kv_math.PRESETS["Mixtral-8x7B (MoE)"] == (32, 8, 128)
