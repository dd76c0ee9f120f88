"""`kvscope bench`'s arithmetic on a mixture of experts: the FLOPs count the router and the top_k
experts a token runs, and the kernel table walks the experts' matmuls, never the absent MLP."""
from __future__ import annotations

import math

import pytest

from kvscope.engine import LLM, EngineConfig
from kvscope.engine.measure.bench import matmul_params_per_layer
from kvscope.engine.measure.kernel_table import model_decisions
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="mixtral")
    return LLM(EngineConfig(model=str(path), device="cpu", dtype="float32",
                            weights="dense", num_kv_blocks=16)).engine.model


def test_matmul_params_are_the_active_ones(mixtral):
    k = mixtral.moe.top_k
    expected = 0
    for layer in mixtral.layers:
        e = layer.experts
        expected += sum(math.prod(w.shape) for w in (layer.qkv, layer.o_proj, e.router))
        expected += k * (math.prod(e.gate_up[0].shape) + math.prod(e.down[0].shape))
    every_expert = sum(math.prod(w.shape) for layer in mixtral.layers for w in layer.linears())
    assert matmul_params_per_layer(mixtral) == expected < every_expert


def test_kernel_decisions_cover_the_experts(mixtral):
    linears = {id(lin) for lin, _ in model_decisions(mixtral, concurrency=4)}
    expert = mixtral.layers[0].experts.gate_up[0]
    shapes = {tuple(lin.shape) for lin, _ in model_decisions(mixtral, 4)}
    assert linears and tuple(expert.shape) in shapes
