"""The Triton kernels against the torch references, on CPU under TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is printed, and in every failure message; set
KVSCOPE_TEST_SEED to replay one). Pools and outputs start poisoned: NaN for float pools and
outputs, code -128 (never produced by the quantizer) or the fp8 NaN byte 0x7F for int8/fp8
pools, NaN scales. Unwritten slots must stay poisoned, written ones must match, and an
attention output must have no NaN: a kernel that skips an element, or reads a slot outside a
sequence's context or a padded block-table entry (block 0 is never allocated here), fails.

Tolerances (kernel vs reference, same cache contents):
* KV write: exact, every dtype. Scales and x / scale use IEEE division like torch, int8 rounds
  half to even like torch.round (tested on exact .5 ties), fp8 e4m3 codes are encoded with
  round-to-nearest-even (ties and subnormals tested), bf16 rows rounded to nearest even.
* Attention, float32 queries (float32, int8 and fp8 pools): atol = rtol = 2e-5. Both compute
  in float32 from the same values (codes are exact in float32; the kernel scales the scores
  by k_scale and the probabilities by v_scale instead of dequantizing first), so only the
  summation order, exp2 vs exp and the online-softmax rescaling differ (observed < 1e-6).
* float16 queries (float16 and fp8 pools): atol = rtol = 4e-3, about 4 float16 ulps at the
  outputs' magnitude (~1): P is rounded to float16 for the P.V product, the output is rounded
  to float16, and the reference dequantizes K/V into float16 (observed <= 2e-3).
* bfloat16 queries (bfloat16 and int8 pools): atol = rtol = 2e-2, a few bfloat16 ulps (2**-8
  relative): the reference rounds dequantized K/V and its intermediates to bfloat16 while the
  kernel keeps codes exact and scales in float32 (observed <= 1.6e-2 at outputs near 2).
"""
from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch

from kvscope.kernels import ops, triton_attention
from kvscope.kernels.attention_ref import (
    AttentionMetadata,
    group_decode_rows,
    paged_attention_ref,
)
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.triton_attention import paged_attention_triton
from kvscope.kernels.triton_kv_write import write_kv_triton
from kvscope.testing.pools import FP8, bits, clone_pool, poisoned, poisoned_pool, sanitized

SEED = int(os.environ.get("KVSCOPE_TEST_SEED", random.SystemRandom().randrange(2**31)))
print(f"test_triton_kernels: seed {SEED} (KVSCOPE_TEST_SEED={SEED} replays it)")

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, FP8]
# (pool dtype, query dtype): every pool dtype, quantized pools under two query dtypes.
ATTN_CASES = [
    (torch.float32, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.int8, torch.float32),
    (torch.int8, torch.bfloat16), (FP8, torch.float32), (FP8, torch.float16),
]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
GQA = [(2, 2), (4, 2), (8, 2), (6, 2)]  # ratios 1, 2, 4 and 3 (padded group)


def case_seed(*parts) -> int:
    """A per-case seed derived from SEED (string seeds hash deterministically)."""
    return random.Random(repr((SEED, *map(str, parts)))).randrange(2**31)


def where(seed: int) -> str:
    return f"(seed {SEED}, case seed {seed})"


def random_rows(g: torch.Generator, n: int, kv_heads: int, head_dim: int,
                spread: float = 2.0, spike: float = 20.0) -> torch.Tensor:
    """Rows of different magnitudes (log-normal, `spread`), a fifth with an outlier element."""
    x = torch.randn(n, kv_heads, head_dim, generator=g)
    x *= torch.exp(torch.randn(n, kv_heads, 1, generator=g) * spread)
    spikes = torch.rand(n, kv_heads, generator=g) < 0.2
    x[..., 0] = torch.where(spikes, x[..., 0] * spike, x[..., 0])
    return x


def tie_rows(head_dim: int) -> torch.Tensor:
    """Rows whose quantization hits exact rounding ties.

    int8: max 127 gives scale 1 (x / scale == x), so .5 values are ties (to even: 2.5 -> 2).
    fp8: max 448 gives scale 1; 17 (16|18), 124 (120|128), 2**-10 (0|2**-9), 3 * 2**-10 are
    ties, 0.49999997 rounds up across an exponent boundary, 1e-3 is a subnormal.
    """
    int8_row = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5]
    fp8_row = [448.0, 17.0, -124.0, 2.0**-10, 3 * 2.0**-10, 0.49999997, 1e-3, -19.0]
    rows = torch.zeros(3, 1, head_dim)
    rows[0, 0, :len(int8_row)] = torch.tensor(int8_row)
    rows[1, 0, :len(fp8_row)] = torch.tensor(fp8_row)
    # rows[2] stays all zero: the scale clamps to MIN_SCALE.
    return rows


# -- KV write --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_kv_write_matches_reference_exactly(dtype, block_size):
    seed = case_seed("write", dtype, block_size)
    g = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = (3, 24) if block_size < 256 else (1, 8)
    num_blocks = max(2, 48 // block_size)
    n = min(11, num_blocks * block_size - 1)
    key = random_rows(g, n, kv_heads, head_dim)
    value = random_rows(g, n, kv_heads, head_dim)
    key[:3, :1] = tie_rows(head_dim)[:n]
    value[-3:, -1:] = tie_rows(head_dim)[:n]
    src_dtype = torch.float32 if dtype == torch.float32 else [torch.float32, torch.float16,
                                                              torch.bfloat16][seed % 3]
    key, value = key.to(src_dtype), value.to(src_dtype)
    # K and V as strided views into one qkv-like buffer, as the model produces them.
    qkv = torch.cat([key.flatten(1), value.flatten(1), key.flatten(1)[:, :5]], dim=1)
    key_v = qkv[:, :kv_heads * head_dim].view(n, kv_heads, head_dim)
    value_v = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]

    pool = poisoned_pool(dtype, num_blocks, block_size, kv_heads, head_dim)
    got, want = clone_pool(pool), clone_pool(pool)
    write_kv_triton(key_v, value_v, got[0], got[1], slots, got[2], got[3])
    write_kv_ref(key_v, value_v, want[0], want[1], slots, want[2], want[3])

    msg = f"{dtype} from {src_dtype}, block size {block_size} {where(seed)}"
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, want, strict=True):
        if a is None:
            continue
        same = bits(a) == bits(b)
        assert bool(same.all()), f"{name} differs at {int((~same).sum())} elements: {msg}"
        written = torch.zeros(a.shape[:2], dtype=torch.bool).view(-1)
        written[slots] = True
        still = poisoned(a).view(num_blocks * block_size, -1)
        assert not bool(still[written].any()), f"{name}: a written slot is poisoned: {msg}"
        assert bool(still[~written].all()), f"{name}: an unwritten slot changed: {msg}"


def test_kv_write_skips_negative_slots():
    pool = poisoned_pool(torch.int8, 4, 4, 2, 16)
    key = torch.randn(3, 2, 16)
    write_kv_triton(key, key, pool[0], pool[1], torch.tensor([5, -1, 2]), pool[2], pool[3])
    written = ~poisoned(pool[0]).view(16, -1).all(dim=1)
    assert written.nonzero().flatten().tolist() == [2, 5]


def test_quantized_write_needs_scales():
    pool = poisoned_pool(FP8, 2, 4, 1, 16)
    with pytest.raises(ValueError, match="scale"):
        write_kv_triton(torch.randn(1, 1, 16), torch.randn(1, 1, 16), pool[0], pool[1],
                        torch.tensor([0]))


# -- attention -------------------------------------------------------------------------------
def random_batch(rng: random.Random, max_ctx: int, long_ctx: int | None):
    """(q_lens, ctx_lens): a decode row, a prefill without cached context, a prefill chunk
    after cached context, and a few random ones, in random order."""
    def prefill_chunk():
        ctx = rng.randint(3, max_ctx)
        return rng.randint(2, ctx - 1), ctx

    whole = rng.randint(2, max_ctx)
    seqs = [(1, rng.randint(1, max_ctx)), (whole, whole), prefill_chunk()]
    for _ in range(rng.randint(1, 2)):
        seqs.append(rng.choice([(1, rng.randint(1, max_ctx)), prefill_chunk()]))
    if long_ctx:
        seqs.append((1, long_ctx))
    rng.shuffle(seqs)
    return [q for q, _ in seqs], [c for _, c in seqs]


def build(kv_dtype, q_dtype, block_size, heads, kv_heads, head_dim, seed, max_ctx=40,
          long_ctx=None):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = random_batch(rng, max_ctx, long_ctx)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    free = list(range(1, num_blocks))  # block 0 stays poisoned: the table's padding
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    bt = torch.zeros(len(tables), max(need), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)

    pool = poisoned_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim)
    for table, ctx in zip(tables, ctx_lens, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])
        # Scores stay O(1): with huge keys a reduced-precision reference (which rounds the
        # dequantized K to bf16) would be the less accurate side of the comparison.
        write_kv_ref(random_rows(g, ctx, kv_heads, head_dim, spread=0.5, spike=4.0),
                     torch.randn(ctx, kv_heads, head_dim, generator=g), *pool[:2], slots,
                     *pool[2:])
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = (torch.randn(starts[-1], heads, head_dim, generator=g) * 0.5).to(q_dtype)
    meta = AttentionMetadata(
        query_start_loc=starts, context_lens=ctx_lens, block_tables=bt,
        slot_mapping=torch.zeros(0, dtype=torch.long),
        decode_groups=group_decode_rows(starts, ctx_lens, max_group=2),
        prefill_seqs=[i for i, n in enumerate(q_lens) if n > 1])
    return query, pool, meta


def check_attention(kv_dtype, q_dtype, block_size, heads, kv_heads, head_dim, seed,
                    num_splits=1, block_n=None, **kw):
    query, pool, meta = build(kv_dtype, q_dtype, block_size, heads, kv_heads, head_dim, seed,
                              **kw)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    got = paged_attention_triton(query, *pool[:2], meta, scale, *pool[2:], out=out,
                                 num_splits=num_splits, block_n=block_n)
    assert got is out
    want = paged_attention_ref(query, *sanitized(pool)[:2], meta, scale, *sanitized(pool)[2:])
    msg = (f"{kv_dtype} pool, {q_dtype} query, block size {block_size}, heads {heads}/"
           f"{kv_heads}, head_dim {head_dim}, splits {num_splits}, q_lens "
           f"{[b - a for a, b in itertools.pairwise(meta.query_start_loc)]}, "
           f"ctx {meta.context_lens} {where(seed)}")
    assert not bool(torch.isnan(got).any()), f"unwritten or NaN output: {msg}"
    tol = TOL[q_dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{m}\n{msg}")


@pytest.mark.parametrize("kv_dtype,q_dtype", ATTN_CASES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_attention_matches_reference(kv_dtype, q_dtype, block_size):
    i = ATTN_CASES.index((kv_dtype, q_dtype)) + block_size
    heads, kv_heads = GQA[i % len(GQA)]
    seed = case_seed("attn", kv_dtype, q_dtype, block_size)
    if block_size == 256:  # tiny other dims; one sequence spans two blocks
        check_attention(kv_dtype, q_dtype, 256, heads // 2, 1, 16, seed,
                        num_splits=1 + 2 * (i % 2), max_ctx=24, long_ctx=260 + seed % 40)
    else:
        check_attention(kv_dtype, q_dtype, block_size, heads, kv_heads, 16, seed,
                        num_splits=1 + 2 * (i % 2), block_n=16)


@pytest.mark.parametrize("block_size", [2, 4, 8, 32, 64, 128])
def test_attention_every_block_size(block_size):
    """The block-per-position gather (block_size < BLOCK_N) and one-block tiles (>=)."""
    seed = case_seed("bs", block_size)
    heads, kv_heads = GQA[block_size % len(GQA)]
    check_attention(torch.float32, torch.float32, block_size, heads, kv_heads, 8, seed,
                    block_n=16 if block_size < 64 else 32)


@pytest.mark.parametrize("head_dim", [8, 24])
def test_attention_odd_head_dims(head_dim):
    seed = case_seed("hd", head_dim)
    check_attention(torch.int8, torch.float32, 4, 6, 2, head_dim, seed, num_splits=2)


def test_fp8_hardware_decode_path(monkeypatch):
    """sm_89+ GPUs convert fp8 in hardware instead of the bit trick; both must agree."""
    monkeypatch.setattr(triton_attention, "_fp8_native", lambda device: True)
    seed = case_seed("fp8native")
    check_attention(FP8, torch.float32, 8, 4, 2, 16, seed, block_n=16)


def test_decode_only_batch_with_splits():
    """The flash-decoding shape: single queries over longer contexts, merged splits."""
    seed = case_seed("decode")
    rng = random.Random(seed)
    ctx = [rng.randint(1, 90) for _ in range(3)]
    starts = list(range(len(ctx) + 1))
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // 16) for c in ctx) + 1
    pool = poisoned_pool(torch.float16, num_blocks, 16, 2, 16)
    tables, nxt = [], 1
    for c in ctx:
        n = -(-c // 16)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    for t, c in zip(tables, ctx, strict=True):
        slots = torch.tensor([t[p // 16] * 16 + p % 16 for p in range(c)])
        write_kv_ref(torch.randn(c, 2, 16, generator=g), torch.randn(c, 2, 16, generator=g),
                     *pool[:2], slots)
    bt = torch.zeros(len(ctx), max(map(len, tables)), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    meta = AttentionMetadata(starts, ctx, bt, torch.zeros(0, dtype=torch.long),
                             group_decode_rows(starts, ctx), [])
    query = torch.randn(len(ctx), 6, 16, generator=g).to(torch.float16)
    want = paged_attention_ref(query, *sanitized(pool)[:2], meta, 0.25)
    for splits in (1, 4):
        got = paged_attention_triton(query, *pool[:2], meta, 0.25, num_splits=splits,
                                     block_n=16)
        info = f"splits {splits}, ctx {ctx} {where(seed)}"
        torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3,
                                   msg=lambda m, info=info: f"{m}\n{info}")


def test_attention_rejects_bad_shapes():
    query, pool, meta = build(torch.float32, torch.float32, 4, 4, 2, 16, case_seed("bad"))
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_triton(query[:, :3], *pool[:2], meta, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(query[:-1], *pool[:2], meta, 1.0)


# -- dispatch --------------------------------------------------------------------------------
def test_ops_dispatch(monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)
    assert ops.backend("cpu") == "cpu"  # the native decode attention (it builds here)
    assert ops.backend("cuda") == "triton"
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS", "off")
    assert ops.backend("cpu") == "ref"
    monkeypatch.delenv("KVSCOPE_CPU_KERNELS")
    monkeypatch.setenv(ops.ENV, "ref")
    assert ops.backend("cuda") == "ref"
    monkeypatch.setenv(ops.ENV, "triton")
    assert ops.backend("cpu") == "triton"  # TRITON_INTERPRET=1: tests/conftest.py
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.backend("cpu")
    monkeypatch.setenv(ops.ENV, "cuda-please")
    with pytest.raises(ValueError, match="KVSCOPE_KERNELS"):
        ops.backend("cpu")


@pytest.mark.parametrize("backend", ["ref", "triton", "auto"])
def test_ops_run_either_backend(monkeypatch, backend):
    monkeypatch.setenv(ops.ENV, backend)  # auto on CPU tensors: the native decode kernel
    seed = case_seed("ops", backend)
    query, pool, meta = build(torch.int8, torch.float32, 4, 4, 2, 16, seed)
    clean = sanitized(pool)
    got = ops.paged_attention(query, *clean[:2], meta, 0.25, *clean[2:])
    want = paged_attention_ref(query, *clean[:2], meta, 0.25, *clean[2:])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    key = torch.randn(2, 2, 16)
    fresh = poisoned_pool(torch.int8, 2, 4, 2, 16)
    ops.write_kv(key, key, fresh[0], fresh[1], torch.tensor([1, 6]), fresh[2], fresh[3])
    assert int((~poisoned(fresh[0])).sum()) == 2 * 2 * 16
