"""`kvscope kv-calc` and kvmath on explicit head_dim and sliding-window configs (issue 24)."""
from __future__ import annotations

import json

import pytest

from kvscope import main as launcher
from kvscope.kvmath import kv_size
from kvscope.kvmath.windows import layer_windows, uniform_window

# Shapes of real configs (config.json fields only), kept small where the size does not matter.
QWEN3 = {"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "hidden_size": 1024, "head_dim": 128,
         "sliding_window": None, "use_sliding_window": False}
MISTRAL_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096}
GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "hidden_size": 2304, "head_dim": 256,
          "sliding_window": 4096}
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 26, "num_attention_heads": 4,
          "num_key_value_heads": 1, "hidden_size": 1152, "head_dim": 256,
          "sliding_window": 512,
          "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(26)]}


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def calc(capsys, config, *extra) -> dict:
    assert launcher.main(["kv-calc", "--config", json.dumps(config), "--json", *extra]) == 0
    result: dict = json.loads(capsys.readouterr().out)
    return result


def calc_text(capsys, config, tokens: int) -> str:
    assert launcher.main(["kv-calc", "--config", json.dumps(config),
                          "--tokens", str(tokens)]) == 0
    text: str = capsys.readouterr().out
    return text


def test_explicit_head_dim_wins_over_hidden_over_heads(capsys):
    # Qwen3-0.6B: 16 heads x 128 = 2048 != hidden 1024.
    out = calc(capsys, QWEN3, "--dtype", "bf16", "--tokens", "1000")
    assert out["head_dim"] == 128
    assert out["bytes_per_token"] == 2 * 28 * 8 * 128 * 2
    assert out["total_bytes"] == 1000 * out["bytes_per_token"]
    assert out["windowed_layers"] == 0 and out["reclamation_saving"] == 0.0
    # A null head_dim (older configs) falls back to hidden / heads.
    assert kv_size.shape_from_config({**QWEN3, "head_dim": None}).head_dim == 64


def test_all_windowed_model_caps_a_sequence_at_its_window(capsys):
    out = calc(capsys, MISTRAL_V01, "--dtype", "bf16", "--tokens", "32768")
    per = 2 * 32 * 8 * 128 * 2
    assert out["bytes_per_token"] == per and out["total_bytes"] == 32768 * per
    assert (out["windowed_layers"], out["window"]) == (32, 4096)
    assert out["sequence_tokens_held"] == 4096 and out["sequence_bytes"] == 4096 * per
    assert out["reclamation_saving"] == 0.0  # the engine already frees it
    short = calc(capsys, MISTRAL_V01, "--tokens", "1000")
    assert short["sequence_tokens_held"] == 1000
    text = calc_text(capsys, MISTRAL_V01, 32768)
    assert "capped at 4,096 tokens" in text and "512.0 MiB per sequence" in text


@pytest.mark.parametrize(("config", "windowed", "window"),
                         [(GEMMA2, 13, 4096), (GEMMA3, 22, 512)])
def test_mixed_model_keeps_full_tables_and_says_what_reclaiming_would_save(
        capsys, config, windowed, window):
    n = 32768
    out = calc(capsys, config, "--tokens", str(n))
    assert (out["windowed_layers"], out["window"]) == (windowed, window)
    assert out["sequence_tokens_held"] == n  # one block table for all layers: nothing freed
    want = windowed / config["num_hidden_layers"] * (1 - window / n)
    assert out["reclamation_saving"] == pytest.approx(want)
    text = calc_text(capsys, config, n)
    assert f"per-layer reclamation would save {100 * want:.1f}% at 32,768 tokens" in text
    assert f"{windowed} of {config['num_hidden_layers']} layers" in text
    # Within the window there is nothing behind it to free.
    assert calc(capsys, config, "--tokens", str(window))["reclamation_saving"] == 0.0


def test_layer_windows_reads_each_family_like_transformers():
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    cases = [MistralConfig(num_hidden_layers=3, sliding_window=8),
             MistralConfig(num_hidden_layers=3, sliding_window=None),
             Gemma2Config(num_hidden_layers=4, sliding_window=16),
             Gemma3TextConfig(num_hidden_layers=7, sliding_window=16),
             Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                         max_window_layers=2),
             Qwen2Config(num_hidden_layers=4)]
    for cfg in cases:
        d = cfg.to_dict()
        types = d.get("layer_types") or (["sliding_attention"] * cfg.num_hidden_layers
                                         if cfg.sliding_window else None)
        want = [cfg.sliding_window if t == "sliding_attention" else 0
                for t in types] if types else [0] * cfg.num_hidden_layers
        assert layer_windows(d) == want, d["model_type"]
    # Configs saved before layer_types: the family's own pattern.
    old_gemma2 = {k: v for k, v in Gemma2Config(num_hidden_layers=4).to_dict().items()
                  if k != "layer_types"}
    assert layer_windows(old_gemma2) == [4096, 0, 4096, 0]
    old_gemma3 = {**GEMMA3, "layer_types": None, "sliding_window_pattern": 6}
    assert layer_windows(old_gemma3) == layer_windows(GEMMA3)
    assert uniform_window([8, 8, 8]) == 8
    assert uniform_window([8, 0, 8]) == uniform_window([0, 0]) == uniform_window([]) == 0


def test_sequence_blocks_match_what_the_window_spans():
    shape = kv_size.shape_from_config(MISTRAL_V01)
    # Keys p-4095..p cover 4096 positions: 257 blocks of 16 unless aligned, never more.
    assert kv_size.sequence_blocks(shape, 100_000, 16) == 257
    assert kv_size.sequence_blocks(shape, 100, 16) == 7
    glob = kv_size.shape_from_config(QWEN3)
    assert kv_size.sequence_blocks(glob, 100_000, 16) == 6250


def test_the_calculator_reads_windows_as_the_engine_does():
    """kvmath (torch-free, for kv-calc and the window) against engine.model.family."""
    from transformers import AutoConfig

    from kvscope.engine.model.family import layer_windows as engine_windows
    from kvscope.testing.tiny_models import ARCHS, FAMILY_OVERRIDES

    for arch in ARCHS:  # tiny_models' shapes (phi3's longrope factors fit these heads)
        for extra in ({}, {"sliding_window": 16}, {"sliding_window": None}):
            cfg = AutoConfig.for_model(arch, **{**TINY, **FAMILY_OVERRIDES[arch], **extra})
            assert layer_windows(cfg.to_dict()) == engine_windows(cfg), (arch, extra)
