"""Weight-only int4/int8 matmul weights against float64 references, the 'auto' choice, and
the engine on a tiny model in each format against its dense self."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.model.weight_formats import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    int4_is_exact,
    make_linear,
    quantize_int4,
    resolve_weights,
)
from kvscope.testing.tiny_models import save_tiny_model

# The kernels take bfloat16 activations and scales: 8 significant bits, a relative rounding
# of up to 2^-9 per input and per group scale. Over K products of random sign that leaves
# the output a few 2^-9 of its scale, so 2 % of the largest output bounds it with room.
BF16_REL_TOL = 0.02


def q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 GGUF holds them: per 32, w = d * q + m with fp16 d and m and q in
    0..15 (each group's min at 0 and max at 15, as the quantizer places them)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (q * d + m).reshape(n, k)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def test_int4_finds_back_a_q4_1_weight_exactly():
    w = q4_1_weight(64, 128, seed=0)
    codes, scale_zero = quantize_int4(w)
    assert codes.min() >= 0 and codes.max() <= 15
    # Float32 scale and zero rebuild every weight to float32 rounding of d * q + m.
    assert torch.allclose(dequantize_int4(codes, scale_zero), w, rtol=0, atol=1e-7)
    assert int4_is_exact(w)


def test_a_float_weight_is_not_taken_for_a_4bit_one():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    assert not int4_is_exact(w)


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quantized_matmul_matches_float64_of_its_own_weights(cls, rows):
    """int4 on a Q4_1 weight and int8 on its own codes: the only error left is bfloat16
    rounding of the activations and the scales."""
    w = q4_1_weight(96, 192, seed=2)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(3))
    y = cls(w)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert relative_error(y, x.double() @ w.double().T) < BF16_REL_TOL


def test_int8_is_tighter_than_int4_on_a_float_weight():
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(64, 256, generator=g), torch.randn(8, 256, generator=g)
    ref = x.double() @ w.double().T
    e4, e8 = relative_error(Int4Linear(w)(x), ref), relative_error(Int8Linear(w)(x), ref)
    assert e8 < BF16_REL_TOL < e4  # 4-bit on a Gaussian weight is an approximation


def test_bias_leading_dims_and_bfloat16_activations():
    g = torch.Generator().manual_seed(5)
    w, b = q4_1_weight(32, 64, seed=6), torch.randn(32, generator=g)
    x = torch.randn(2, 3, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    for cls in (Int4Linear, Int8Linear):
        y = cls(w, b.to(torch.bfloat16))(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 32)
        ref = x.double() @ w.double().T + b.to(torch.bfloat16).double()
        assert relative_error(y, ref) < BF16_REL_TOL


def test_shapes_the_kernel_cannot_tile_stay_dense():
    assert isinstance(make_linear(torch.randn(24, 64), None, "int4"), DenseLinear)  # rows % 16
    assert isinstance(make_linear(torch.randn(32, 40), None, "int8"), DenseLinear)  # K % 32
    assert isinstance(make_linear(torch.randn(32, 64), None, "int8"), Int8Linear)


def test_auto_picks_int4_only_for_a_4bit_checkpoint_on_cpu():
    q4 = {"model.layers.0.mlp.down_proj.weight": q4_1_weight(64, 128, seed=7)}
    dense = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128)}
    assert resolve_weights("auto", "cpu", q4) == "int4"
    assert resolve_weights("auto", "cpu", dense) == "dense"
    assert resolve_weights("auto", "cuda", q4) == "dense"
    assert resolve_weights("int8", "cpu", dense) == "int8"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weights("int4", "cuda", q4)


def test_engine_config_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="EngineConfig.weights='int3'"):
        EngineConfig(weights="int3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model whose layer weights are 4-bit already, as the embedded GGUF's are; rows
    a multiple of 16 and inputs of 32, so every matmul really is quantized."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path_factory.mktemp("wf") / "m", hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    file = path / "model.safetensors"
    state = load_file(str(file))
    for name, w in state.items():
        if name.endswith("proj.weight"):
            state[name] = dequantize_int4(*quantize_int4(w)).contiguous()
    save_file(state, str(file), metadata={"format": "pt"})
    return path


def make_llm(model, weights: str) -> LLM:
    return LLM(EngineConfig(model=str(model), device="cpu", weights=weights, block_size=4,
                            num_kv_blocks=128, max_model_len=256))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_engine_in_a_quantized_format_tracks_its_dense_self(tiny, weights):
    """Next-token distributions stay close to the dense model's: on 4-bit weights both
    formats hold the weights exactly but for bfloat16 scales, and round the activations to
    bfloat16 at each matmul, which is what the KL bound allows for."""
    from kvscope.engine.scoring import token_log_probs

    ids = [int(t) for t in torch.randint(0, 250, (40,), generator=torch.Generator()
                                         .manual_seed(8))]
    dense = token_log_probs(make_llm(tiny, "dense").engine, ids)
    llm = make_llm(tiny, weights)
    assert llm.stats().weights == weights
    quant = token_log_probs(llm.engine, ids)
    kl = float((dense.exp() * (dense - quant)).sum(-1).mean())
    assert kl < 0.05  # measured ~0.02: this random model's logits are far more peaked
    # A broken kernel agrees at ~1/256 of positions; bfloat16 activations flip near-ties.
    assert (dense.argmax(-1) == quant.argmax(-1)).float().mean() > 0.75
    # Decoding (batched, paged) picks what the same model scoring the sequence in one
    # prefill ranks first.
    prompts = [ids[:10], ids[:17]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6))
    for prompt, out in zip(prompts, outs, strict=True):
        scored = token_log_probs(llm.engine, prompt + list(out.token_ids))
        assert scored[len(prompt) - 1:].argmax(-1).tolist() == list(out.token_ids)


def test_auto_loads_a_4bit_checkpoint_as_int4(tiny):
    assert make_llm(tiny, "auto").stats().weights == "int4"


def test_quantized_weights_take_their_real_bytes(tiny):
    dense = sum(t.nbytes for t in make_llm(tiny, "dense").engine.model.tensors())
    int4 = sum(t.nbytes for t in make_llm(tiny, "int4").engine.model.tensors())
    assert int4 < dense * 0.6  # the embedding table stays float; every matmul is 4-bit


def test_device_panel_counts_the_quantized_bytes(tiny):
    """The device panel's weights figure (and so 'what fits') is what int4 really holds."""
    from kvscope.engine.server.device_monitor import DeviceMonitor

    dense, int4 = make_llm(tiny, "dense").engine, make_llm(tiny, "int4").engine
    dense_bytes = DeviceMonitor(dense).sample().weights_bytes
    int4_bytes = DeviceMonitor(int4).sample().weights_bytes
    layer = int4.model.layers[0]
    lin = layer.gate_up
    n, k = lin.shape
    # one layout is held: torch's codes, or the tiles' (codes and their scales interleaved)
    held = lin.packed if lin.packed is not None else lin.tiles
    scales = 0 if lin.packed is not None else n * k // 32 * 4
    assert held.dtype == torch.uint8 and held.numel() - scales == n * k // 2
    assert int4_bytes == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                              for t in int4.model.tensors()}.values())
    assert int4_bytes < 0.6 * dense_bytes


def test_auto_kv_is_bfloat16_beside_quantized_weights_on_the_cpu(tiny):
    """The CPU default (docs/kv-dtypes.md, "The CPU default"): quantized weights already round
    every matmul input to bfloat16, so 'auto' stores KV in bfloat16 there; dense weights keep
    float32 KV (token-exact with Hugging Face); an explicit dtype is always kept."""
    from kvscope.engine.config import resolve_kv_dtype

    assert make_llm(tiny, "auto").stats().kv_dtype == "bfloat16"
    assert make_llm(tiny, "int8").stats().kv_dtype == "bfloat16"
    assert make_llm(tiny, "dense").stats().kv_dtype == "float32"
    assert resolve_kv_dtype("auto", "auto", "cpu", "int4") == torch.bfloat16
    assert resolve_kv_dtype("auto", "auto", "cpu") == torch.float32
    assert resolve_kv_dtype("float32", "auto", "cpu", "int4") == torch.float32
    assert resolve_kv_dtype("auto", "float16", "cpu", "int4") == torch.float16
    assert resolve_kv_dtype("auto", "auto", "cuda", "dense") == torch.bfloat16
