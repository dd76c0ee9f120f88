"""The exact K shift and q/k balance (kernels/k_balance.py) on the torch path, and its
calibration (engine/kv_cache/calibration.py): exact in float32, what the pool holds, what it buys
an int8 pool, and the engine plumbing (calibrated once, kept across reconfigures)."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig
from kvscope.engine.kv_cache.calibration import calibration_ids, k_balance_from, queries_and_keys
from kvscope.engine.scoring import token_log_probs
from kvscope.kernels import ops
from kvscope.kernels.k_balance import KBalanceLayer, balance_k, balance_q
from kvscope.kernels.quant import dequantize
from kvscope.kernels.rotation import rotation_matrix
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.kv_cache.test_kv_rotation import attend as attend_rotated
from tests.engine.kv_cache.test_kv_rotation import one_sequence


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)


def attend(kv_dtype, rotation, kb, meta, k, v, q):
    head_dim = k.shape[-1]
    shape = (4, 4, k.shape[1], head_dim)
    kc, vc = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    ks = vs = None
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        ks, vs = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    ops.write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs, rotation=rotation, k_balance=kb)
    out = ops.paged_attention(q, kc, vc, meta, head_dim ** -0.5, ks, vs, rotation=rotation,
                              k_balance=kb)
    return out, kc, ks


def random_balance(g, kv_heads, head_dim):
    return KBalanceLayer.of(torch.randn(kv_heads, head_dim, generator=g) * 3,
                            torch.rand(kv_heads, head_dim, generator=g) * 4 + 0.25)


def test_balance_helpers_compute_the_transform():
    g = torch.Generator().manual_seed(3)
    kb = random_balance(g, 2, 8)
    k, q = torch.randn(5, 2, 8, generator=g), torch.randn(5, 6, 8, generator=g)
    torch.testing.assert_close(balance_k(k, kb), (k - kb.shift) * kb.gain)
    # GQA: query heads 0-2 use KV head 0's gains, 3-5 KV head 1's.
    want = q / torch.cat([kb.gain[0].expand(3, 8), kb.gain[1].expand(3, 8)])
    torch.testing.assert_close(balance_q(q, kb), want)
    # Scores move by q.c only: the same for every key of a query.
    s_plain = torch.einsum("qhd,khd->hqk", q[:, :3], k[:, :1].expand(5, 3, 8))
    s_bal = torch.einsum("qhd,khd->hqk", balance_q(q, kb)[:, :3],
                         balance_k(k, kb)[:, :1].expand(5, 3, 8))
    diff = s_plain - s_bal
    torch.testing.assert_close(diff, diff[..., :1].expand_as(diff), atol=1e-4, rtol=1e-4)
    assert balance_k(k, None) is k and balance_q(q, None) is q


def test_balance_refuses_bad_gains():
    with pytest.raises(ValueError, match="positive"):
        KBalanceLayer.of(torch.zeros(1, 4), torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        KBalanceLayer.of(torch.zeros(4), torch.ones(4))


@pytest.mark.parametrize("rotated", [False, True])
def test_torch_path_balance_is_invisible_in_float32(monkeypatch, rotated):
    monkeypatch.setenv(ops.ENV, "ref")
    g = torch.Generator().manual_seed(0)
    meta, k, v, q = one_sequence(16, 13, g)
    kb = random_balance(g, 1, 16)
    r = rotation_matrix("hadamard", 16) if rotated else None
    exact, _, _ = attend_rotated(torch.float64, None, meta, k.double(), v.double(), q.double())
    out, kc, _ = attend(torch.float32, r, kb, meta, k, v, q)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    # ...while the pool really holds ((k - c) * g) @ R.
    want = (k.double() - kb.shift.double()) * kb.gain.double()
    if r is not None:
        want = want @ r.double()
    torch.testing.assert_close(kc.view(-1, 16)[:13].double(), want.view(-1, 16),
                               atol=1e-5, rtol=1e-5)


def test_calibrated_balance_cuts_the_int8_error(monkeypatch):
    """Keys with a big constant offset and queries whose energy sits in a few channels (as the
    embedded model's are): the balance from k_balance_from makes rotated int8 clearly closer
    to float64 attention than the rotation alone."""
    monkeypatch.setenv(ops.ENV, "ref")
    g = torch.Generator().manual_seed(5)
    meta, k, v, q = one_sequence(64, 13, g)
    k = k + torch.randn(64, generator=g) * 6          # a shared offset in every channel
    q = q * torch.where(torch.arange(64) < 8, 6.0, 0.5)  # query energy in 8 channels
    q = q * 0.5
    exact, _, _ = attend_rotated(torch.float64, None, meta, k.double(), v.double(), q.double())
    calib_q = q * (1 + 0.1 * torch.randn(q.shape, generator=g))
    kb = k_balance_from(calib_q, k)
    r = rotation_matrix("hadamard", 64)
    err = {}
    for name, bal in (("hadamard", None), ("calibrated", kb)):
        out, _, _ = attend(torch.int8, r, bal, meta, k, v, q)
        err[name] = float((out.double() - exact).pow(2).mean().sqrt())
    assert err["calibrated"] < 0.5 * err["hadamard"], err


def test_k_balance_from_statistics():
    g = torch.Generator().manual_seed(2)
    tokens, d = 400, 8
    k = torch.randn(tokens, 1, d, generator=g) * torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 4.0])
    k = k + torch.arange(d, dtype=torch.float32)                      # the shift to find
    q = torch.randn(tokens, 2, d, generator=g) * torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1])
    kb = k_balance_from(q, k)
    torch.testing.assert_close(kb.shift[0], torch.arange(d, dtype=torch.float32), atol=0.4,
                               rtol=0)
    assert abs(float(kb.gain.log().mean())) < 1e-5                  # geometric mean 1
    # Strong-query channel 0 gets the largest gain, wide-key channel 7 the smallest.
    assert int(kb.gain[0].argmax()) == 0 and int(kb.gain[0].argmin()) == 7
    torch.testing.assert_close(kb.q_gain, 1 / kb.gain)


def test_calibration_keys_are_the_keys_the_model_writes(path):
    """engine.kv_cache.calibration runs its own copy of the forward pass: its keys must equal the
    ones PagedLlama.forward writes into a float32 pool (catches the two drifting apart)."""
    llm = LLM(EngineConfig(model=str(path), kv_dtype="float32", kv_rotation="none",
                           block_size=4, num_kv_blocks=64))
    engine = llm.engine
    ids = calibration_ids(engine.tokenizer, 200)[:40]
    token_log_probs(engine, ids)
    qk = queries_and_keys(engine.model, ids)
    assert len(qk) == engine.model.shape.num_layers
    for (_, k), (k_cache, _) in zip(qk, engine.pool.caches, strict=True):
        rows = k_cache.view(-1, *k_cache.shape[2:])[:len(ids)]  # blocks 0.. in order
        torch.testing.assert_close(rows, k, atol=1e-5, rtol=1e-5)


def test_calibration_is_computed_once_and_survives_reconfigure(path, monkeypatch):
    from kvscope.engine import llm_engine

    calls = []
    real = llm_engine.calibrate_k_balance
    monkeypatch.setattr(llm_engine, "calibrate_k_balance",
                        lambda *a: calls.append(1) or real(*a))
    llm = LLM(EngineConfig(model=str(path), kv_dtype="float32", num_kv_blocks=32))
    assert llm.engine.pool.k_balance is None and calls == []    # not needed: not computed
    llm.engine.reconfigure(kv_dtype="int8")
    first = llm.engine.pool.k_balance
    assert first is not None and calls == [1]
    llm.engine.reconfigure(block_size=8, kv_dtype="fp8")
    again = llm.engine.pool.k_balance
    assert calls == [1] and len(again) == len(first)
    assert all(torch.equal(a.shift, b.shift) and torch.equal(a.gain, b.gain)
               for a, b in zip(again, first, strict=True))
    assert llm.stats().kv_rotation == "calibrated"
    llm.engine.reconfigure(kv_rotation="hadamard")
    assert llm.engine.pool.k_balance is None and llm.engine.pool.rotation is not None


def test_a_calibrated_pool_needs_its_balance(path):
    from kvscope.engine.kv_cache.pool import KVPool

    llm = LLM(EngineConfig(model=str(path), kv_dtype="int8", num_kv_blocks=8))
    with pytest.raises(ValueError, match="calibrated"):
        KVPool.allocate(llm.engine.model.shape, 4, 4, torch.int8, "cpu", "calibrated")


def test_calibrated_int8_dequantizes_near_the_keys(path):
    """The pool's int8 keys, undone (R^T, / g, + c), are the model's keys: each code is within
    half a step, so in the balanced space (R orthogonal) a key's error norm is at most
    sqrt(head_dim) / 2 steps. Layer 0 only: later layers' keys already differ because
    attention read quantized K/V below them."""
    llm = LLM(EngineConfig(model=str(path), kv_dtype="int8", block_size=4, num_kv_blocks=64))
    engine = llm.engine
    ids = list(range(5, 35))
    token_log_probs(engine, ids)
    want = queries_and_keys(engine.model, ids)[:1]
    r = engine.pool.rotation
    for (_, k), (kc, _), (ks, _), kb in zip(want, engine.pool.caches, engine.pool.scales,
                                            engine.pool.k_balance, strict=False):  # layer 0
        stored = dequantize(kc.view(-1, *kc.shape[2:])[:len(ids)],
                            ks.view(-1, ks.shape[2])[:len(ids)])
        back = (stored @ r.T) / kb.gain + kb.shift
        err = ((back - k) * kb.gain).norm(dim=-1)
        step = ks.view(-1, ks.shape[2])[:len(ids)]
        assert bool((err <= step * 0.5 * k.shape[-1] ** 0.5 * 1.001 + 1e-6).all())
        assert float(err.mean()) > 0  # really quantized
