"""The K/V rotation: the matrices, the torch path, the engine option and reconfiguring it live."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.kernels import ops
from kvscope.kernels.attention_ref import AttentionMetadata, group_decode_rows
from kvscope.kernels.quant import dequantize
from kvscope.kernels.rotation import (
    hadamard,
    matrix_name,
    random_orthogonal,
    rotate,
    rotation_matrix,
    unrotate,
)
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.test_engine_tiny import random_prompts
from tests.engine.test_reconfigure import run


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)


@pytest.fixture(scope="module")
def odd_path(tmp_path_factory):
    """head_dim 24: not a power of two, so the rotation is the seeded orthogonal matrix."""
    return save_tiny_model(tmp_path_factory.mktemp("odd"), "llama", seed=8, hidden_size=96,
                           num_attention_heads=4, num_key_value_heads=2)


# -- the matrices ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthogonal_and_flat(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    # Every channel mixes into every other equally.
    torch.testing.assert_close(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


def test_hadamard_refuses_other_sizes():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(24)


@pytest.mark.parametrize("n", [24, 80, 96])
def test_random_orthogonal_is_orthogonal_and_seeded(n):
    q = random_orthogonal(n)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64))
    assert torch.equal(q, random_orthogonal(n))       # the same matrix on every call
    assert not torch.equal(q, random_orthogonal(n, seed=1))
    assert float(q.abs().min()) > 0                   # a dense mix, not a permutation


def test_rotation_matrix_picks_by_head_dim():
    torch.testing.assert_close(rotation_matrix("hadamard", 64), hadamard(64).float())
    torch.testing.assert_close(rotation_matrix("hadamard", 24), random_orthogonal(24).float())
    assert rotation_matrix("none", 64) is None
    assert (matrix_name(64), matrix_name(24)) == ("Hadamard", "random orthogonal")
    with pytest.raises(ValueError, match="'givens'"):
        rotation_matrix("givens", 64)


def test_rotate_then_unrotate_is_the_identity():
    x = torch.randn(5, 3, 24)
    r = rotation_matrix("hadamard", 24)
    torch.testing.assert_close(unrotate(rotate(x, r), r), x, atol=1e-5, rtol=1e-5)
    assert rotate(x, None) is x and unrotate(x, None) is x


# -- the torch path (kernels.ops on the ref backend) -----------------------------------------
def one_sequence(head_dim, ctx, g):
    starts, lens = [0, ctx], [ctx]
    meta = AttentionMetadata(starts, lens, torch.tensor([[0, 1, 2, 3]]), torch.arange(ctx),
                             group_decode_rows(starts, lens), [0])
    k = torch.randn(ctx, 1, head_dim, generator=g)
    k[..., 3] += 12.0  # a constant outlier channel, as real keys have
    v = torch.randn(ctx, 1, head_dim, generator=g)
    return meta, k, v, torch.randn(ctx, 2, head_dim, generator=g)


def attend(kv_dtype, rotation, meta, k, v, q):
    head_dim = k.shape[-1]
    shape = (4, 4, 1, head_dim)
    kc, vc = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    ks = vs = None
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        ks, vs = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    ops.write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs, rotation=rotation)
    out = ops.paged_attention(q, kc, vc, meta, head_dim ** -0.5, ks, vs, rotation=rotation)
    return out, kc, ks


def test_torch_path_rotation_is_invisible_in_float32(monkeypatch):
    monkeypatch.setenv(ops.ENV, "ref")
    g = torch.Generator().manual_seed(0)
    meta, k, v, q = one_sequence(16, 13, g)
    r = rotation_matrix("hadamard", 16)
    plain, plain_k, _ = attend(torch.float32, None, meta, k, v, q)
    rotated, rotated_k, _ = attend(torch.float32, r, meta, k, v, q)
    torch.testing.assert_close(rotated, plain, atol=1e-5, rtol=1e-5)
    # ...while the pool really holds k @ R.
    torch.testing.assert_close(rotated_k.view(-1, 16)[:13], (k @ r).view(-1, 16))
    assert not torch.allclose(rotated_k, plain_k)


def test_torch_path_rotation_cuts_the_int8_error(monkeypatch):
    """Against float64 attention over the same K/V, rotated int8 KV is the closer one.

    (fp8 is a float format: its error is relative per element, an outlier does not flatten
    the other channels' resolution, and on this synthetic data rotation does not help it.)"""
    kv_dtype = torch.int8
    monkeypatch.setenv(ops.ENV, "ref")
    g = torch.Generator().manual_seed(1)
    meta, k, v, q = one_sequence(64, 13, g)
    exact, _, _ = attend(torch.float64, None, meta, k.double(), v.double(), q.double())
    err = {}
    for name, r in (("none", None), ("hadamard", rotation_matrix("hadamard", 64))):
        out, kc, ks = attend(kv_dtype, r, meta, k, v, q)
        err[name] = float((out.double() - exact).abs().max())
        stored = dequantize(kc.view(torch.uint8).view(kv_dtype), ks).view(-1, 64)[:13]
        back = stored @ r.T if r is not None else stored
        err[name + " k"] = float((back - k.view(-1, 64)).pow(2).mean().sqrt())
    assert err["hadamard k"] < 0.6 * err["none k"], err
    assert err["hadamard"] < err["none"], err


# -- the engine option -----------------------------------------------------------------------
def test_invalid_rotation_names_it():
    with pytest.raises(ValueError, match="kv_rotation='givens'"):
        EngineConfig(kv_rotation="givens")


@pytest.mark.parametrize("kv_dtype,setting,expected", [
    ("int8", "auto", "calibrated"), ("fp8", "auto", "calibrated"), ("float32", "auto", "none"),
    ("fp8", "hadamard", "hadamard"), ("int8", "hadamard", "hadamard"),
    ("bfloat16", "auto", "none"), ("int8", "none", "none"), ("float32", "hadamard", "hadamard"),
    ("float32", "calibrated", "calibrated"),
])
def test_auto_rotates_and_balances_exactly_the_one_byte_pools(path, kv_dtype, setting, expected):
    llm = LLM(EngineConfig(model=str(path), kv_dtype=kv_dtype, kv_rotation=setting,
                           num_kv_blocks=16))
    stats = llm.stats()
    assert stats.kv_rotation == expected
    assert (llm.engine.pool.rotation is not None) == (expected != "none")
    assert (llm.engine.pool.k_balance is not None) == (expected == "calibrated")


def test_rotation_keeps_bytes_per_token(path):
    def per_token(rotation):
        llm = LLM(EngineConfig(model=str(path), kv_dtype="int8", kv_rotation=rotation,
                               kv_cache_bytes=1 << 20))
        return llm.stats().kv_bytes_per_token, llm.stats().num_kv_blocks

    assert per_token("calibrated") == per_token("hadamard") == per_token("none")


@pytest.mark.parametrize("model", ["path", "odd_path"])
def test_float32_greedy_is_unchanged_by_rotation(request, model):
    model = request.getfixturevalue(model)
    prompts = random_prompts([9, 25, 4], seed=11)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = {}
    for rotation in ("none", "hadamard", "calibrated"):
        llm = LLM(EngineConfig(model=str(model), kv_dtype="float32", kv_rotation=rotation,
                               block_size=4, num_kv_blocks=64))
        outs[rotation] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["hadamard"] == outs["none"] == outs["calibrated"]


def test_rotation_changes_live_without_losing_a_request(path):
    prompts = random_prompts([7, 30, 12], seed=4)
    base = run(LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64,
                                kv_dtype="float32")), prompts)
    llm = LLM(EngineConfig(model=str(path), block_size=8, num_kv_blocks=64, kv_dtype="float32"))
    outs = run(llm, prompts, {3: {"kv_rotation": "hadamard"}, 8: {"kv_rotation": "none"},
                              12: {"kv_rotation": "hadamard", "kv_dtype": "int8"}})
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in outs)
    # float32 KV through steps 3..11: rotated or not, the same greedy tokens up to there.
    assert all(o.token_ids[:8] == b.token_ids[:8] for o, b in zip(outs, base, strict=True))
    stats = llm.stats()
    assert (stats.kv_dtype, stats.kv_rotation) == ("int8", "hadamard")
    assert stats.num_free_blocks == stats.num_kv_blocks  # nothing leaked
    with pytest.raises(ValueError, match="kv_rotation"):
        llm.engine.reconfigure(kv_rotation="sideways")
    assert llm.stats().kv_rotation == "hadamard"
