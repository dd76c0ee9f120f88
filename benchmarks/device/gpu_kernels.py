"""Every Triton kernel against its torch reference, on the GPU or under the interpreter.

The KV write per KV dtype must equal the reference bit for bit (codes, scales, rows); paged
attention per KV dtype, block sizes 1/16/64/256, GQA, batches mixing decode rows, multi-token
decode rows (speculative verifies: a few queries over a long context) and prefill chunks
with and without cached context, with poisoned pools and output (tolerances as in
tests/kernels/test_triton_kernels.py); rotation, K balance and anchors on the 1-byte pools;
the same with a sliding window (blocks before it freed) and logit soft-capping. Used by
gpu_check (on CUDA: real shapes; without: small shapes under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math
import random

KV_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8")


def torch_dtype(name: str):
    import torch

    return torch.float8_e4m3fn if name == "fp8" else getattr(torch, name)



# -- pools and batches (poisoned like the tests: kvscope.testing.pools) -----------------------
def make_batch(kv_dtype, q_dtype, block_size, heads, kv_heads, head_dim, seqs, seed, device):
    """seqs: [(q_len, ctx_len)]. Returns (query, poisoned pool with every context written
    through the reference write, metadata). Block 0 is never allocated (the table padding)."""
    import torch

    from kvscope.kernels.attention_ref import AttentionMetadata, group_decode_rows
    from kvscope.kernels.kv_write_ref import write_kv_ref
    from kvscope.testing.pools import poisoned_pool

    rng = random.Random(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-c // block_size) for _, c in seqs]
    num_blocks = sum(need) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    bt = torch.zeros(len(seqs), max(need), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    pool = poisoned_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim, device)
    slots, keys, values = [], [], []
    for table, (_, ctx) in zip(tables, seqs, strict=True):
        pos = torch.arange(ctx)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
        k = torch.randn(ctx, kv_heads, head_dim, generator=g)
        k *= torch.exp(torch.randn(ctx, kv_heads, 1, generator=g) * 0.5)
        keys.append(k)
        values.append(torch.randn(ctx, kv_heads, head_dim, generator=g))
    write_kv_ref(torch.cat(keys).to(device), torch.cat(values).to(device), pool[0], pool[1],
                 torch.cat(slots).to(device), pool[2], pool[3])
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    ctx_lens = [c for _, c in seqs]
    query = (torch.randn(starts[-1], heads, head_dim, generator=g) * 0.5).to(device, q_dtype)
    meta = AttentionMetadata(
        query_start_loc=starts, context_lens=ctx_lens, block_tables=bt.to(device),
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        decode_groups=group_decode_rows(starts, ctx_lens),
        prefill_seqs=[i for i, (q, _) in enumerate(seqs) if q > 1])
    return query, pool, meta


# -- correctness -----------------------------------------------------------------------------
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}  # by query dtype (see the tests)
ATTN_CASES = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
              ("int8", "float32"), ("int8", "bfloat16"), ("fp8", "float32"),
              ("fp8", "float16")]


def check_write(kv_name, block_size, kv_heads, head_dim, n, device, seed) -> dict:
    import torch

    from kvscope.kernels.kv_write_ref import write_kv_ref
    from kvscope.kernels.triton_kv_write import write_kv_triton
    from kvscope.testing.pools import bits, poisoned, poisoned_pool

    dtype = torch_dtype(kv_name)
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(2, -(-2 * n // block_size))
    key = torch.randn(n, kv_heads, head_dim, generator=g)
    key *= torch.exp(torch.randn(n, kv_heads, 1, generator=g) * 2)
    key[0, 0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])  # int8 ties
    key[1, 0, :8] = torch.tensor([448.0, 17.0, -124.0, 2.0**-10, 3 * 2.0**-10, 0.49999997,
                                  1e-3, -19.0])  # fp8 ties, carry, subnormals
    value = torch.randn(n, kv_heads, head_dim, generator=g)
    src = torch.bfloat16 if dtype == torch.float16 else torch.float32
    key, value = key.to(device, src), value.to(device, src)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(device)
    pool = poisoned_pool(dtype, num_blocks, block_size, kv_heads, head_dim, device)
    got = tuple(None if t is None else t.clone() for t in pool)
    want = tuple(None if t is None else t.clone() for t in pool)
    write_kv_triton(key, value, got[0], got[1], slots, got[2], got[3])
    write_kv_ref(key, value, want[0], want[1], slots, want[2], want[3])
    mismatches = 0
    for a, b in zip(got, want, strict=True):
        if a is not None:
            mismatches += int((bits(a) != bits(b)).sum())
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots] = True
    still = poisoned(got[0]).view(num_blocks * block_size, -1)
    touched_wrong = int(still[written].any(dim=1).sum() + (~still[~written]).any(dim=1).sum())
    return {"kernel": "kv_write", "kv_dtype": kv_name, "src_dtype": str(src)[6:],
            "block_size": block_size, "tokens": n, "mismatched_elements": mismatches,
            "wrongly_touched_slots": touched_wrong, "tolerance": "exact",
            "ok": mismatches == 0 and touched_wrong == 0}


def check_attention(kv_name, q_name, block_size, heads, kv_heads, head_dim, seqs, device,
                    seed, num_splits=None, block_n=None, rotated: bool = False,
                    balanced: bool = False, anchored: bool = False, window: int = 0,
                    softcap: float = 0.0, label: str = "") -> dict:
    """With `rotated`, the kernel's fused q / output rotation against torch's rotate ->
    reference -> unrotate (kernels.rotation), same tolerance; with `balanced` also the fused
    q / g of a random K balance (kernels.k_balance) against torch's balance_q; with
    `anchored`, anchor rows (kernels.anchors) for two of every three sequences; with a
    `window` (sliding window) and/or `softcap` (logit soft-capping) both sides take them, and
    the blocks wholly before each sequence's window are freed (free_before_window)."""
    import torch

    from kvscope.kernels.attention_ref import paged_attention_ref
    from kvscope.kernels.k_balance import KBalanceLayer, balance_q
    from kvscope.kernels.rotation import rotate, rotation_matrix, unrotate
    from kvscope.kernels.triton_attention import paged_attention_triton
    from kvscope.testing.pools import sanitized

    q_dtype = torch_dtype(q_name)
    query, pool, meta = make_batch(torch_dtype(kv_name), q_dtype, block_size, heads, kv_heads,
                                   head_dim, seqs, seed, device)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    r = rotation_matrix("hadamard", head_dim, device) if rotated else None
    kb = None
    if balanced:
        g = torch.Generator().manual_seed(seed)
        kb = KBalanceLayer.of(torch.randn(kv_heads, head_dim, generator=g),
                              torch.rand(kv_heads, head_dim, generator=g) + 0.5).to(device)
    anchors = None
    if anchored:
        g = torch.Generator().manual_seed(seed + 1)
        anchors = tuple(torch.randn(2, 4, kv_heads, head_dim, generator=g).to(device)
                        for _ in range(2))
        meta.anchor_index = torch.tensor([i % 3 - 1 for i in range(len(seqs))])
    freed = free_before_window(pool, meta, window) if window else 0
    paged_attention_triton(query, pool[0], pool[1], meta, scale, pool[2], pool[3], out=out,
                           num_splits=num_splits, block_n=block_n, rotation=r, k_balance=kb,
                           anchors=anchors, window=window, softcap=softcap)
    clean = sanitized(pool)
    q_ref = rotate(balance_q(query, kb), r).to(q_dtype)
    want = unrotate(paged_attention_ref(q_ref, clean[0], clean[1], meta, scale, clean[2],
                                        clean[3], anchors, window=window, softcap=softcap),
                    r).to(q_dtype)
    tol = TOL[q_name]
    diff = (out.float() - want.float()).abs()
    nan = int(torch.isnan(out).sum())
    ratio = float((diff / (tol + tol * want.float().abs())).nan_to_num(float("inf")).max())
    return {"kernel": "paged_attention" + label + (" rotated" if rotated else "")
            + (" balanced" if balanced else "") + (" anchored" if anchored else "")
            + (f" window {window}" if window else "")
            + (f" softcap {softcap:g}" if softcap else ""),
            "kv_dtype": kv_name, "q_dtype": q_name, "freed_blocks": freed,
            "block_size": block_size, "heads": f"{heads}/{kv_heads}x{head_dim}",
            "q_lens": [q for q, _ in seqs], "ctx_lens": [c for _, c in seqs],
            "num_splits": num_splits or "auto", "max_abs_err": float(diff.max()),
            "tolerance": tol, "err_over_tol": ratio, "nan_outputs": nan,
            "ok": nan == 0 and ratio <= 1.0}


def free_before_window(pool, meta, window: int) -> int:
    """As the block manager leaves a windowed sequence (docs: contracts, windowed memory):
    the blocks wholly before its first query's window poisoned again and dropped from its
    table. The entries point at block 0 (never allocated, still poisoned) rather than -1, so
    that a kernel reading one shows up as NaN outputs instead of faulting the device (the
    CPU tests, tests/kernels/test_window_softcap.py, use -1). Returns how many were freed."""
    import torch

    from kvscope.testing.pools import poisoned_pool

    block_size = pool[0].shape[1]
    poison = poisoned_pool(pool[0].dtype, 1, block_size, *pool[0].shape[2:],
                           device=pool[0].device)
    tables = meta.block_tables
    freed = []
    for i, ctx in enumerate(meta.context_lens):
        q_len = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        first = max(0, ctx - q_len - window + 1) // block_size
        freed += tables[i, :first].tolist()
        tables[i, :first] = 0
    if freed:
        idx = torch.tensor(freed, dtype=torch.long, device=tables.device)
        for t, p in zip(pool, poison, strict=True):
            if t is not None:  # as bytes: index_copy_ has no fp8 kernel on the CPU
                raw = t.view(torch.uint8) if t.element_size() == 1 else t
                src = p.view(torch.uint8) if p.element_size() == 1 else p
                raw.index_copy_(0, idx, src.expand(len(freed), *src.shape[1:]).contiguous())
    return len(freed)


def correctness(device, small: bool, seed: int, log=None, rows: list | None = None
                ) -> list[dict]:
    """Every case's row, appended to `rows` as it finishes; a case that raises (out of
    resources, a compile error) is a failed row naming the error, and the others still run."""
    rows = [] if rows is None else rows
    rng = random.Random(seed)
    for i, kv in enumerate(KV_DTYPE_NAMES):
        for bs in (1, 16, 256):
            kvh, hd = (3, 64) if not small else (2, 24)
            if small and bs == 256:
                kvh, hd = 1, 16
            rows.append(guarded(check_write, "kv_write", kv, "-", bs, f"{kvh}x{hd}",
                                kv, bs, kvh, hd, 9 if small else 300, device, seed + 7 * i + bs))
    if log:
        log(f"{len(rows)} KV-write cases done; attention ...")
    for i, (kv, qd) in enumerate(ATTN_CASES):
        for bs in (1, 16, 64, 256):
            if small:
                heads, kvh, hd = [(2, 2, 16), (4, 2, 16), (6, 2, 16), (8, 2, 16)][(i + bs) % 4]
                m = 24
                seqs = [(1, rng.randint(1, m)), (n := rng.randint(2, m), n),
                        (rng.randint(2, 8), rng.randint(9, m + 8)), (1, rng.randint(1, m))]
                if bs == 256:
                    heads, kvh = heads // kvh, 1
                    seqs.append((1, 257 + rng.randint(0, 30)))
                splits, block_n = 1 + 2 * ((i + bs) % 2), 16
            else:
                heads, kvh, hd = [(9, 3, 64), (8, 8, 128), (32, 8, 128), (12, 2, 64)][(i + bs) % 4]
                seqs = [(1, rng.randint(1, 4000)), (n := rng.randint(100, 700), n),
                        (rng.randint(2, 300), rng.randint(1000, 3000)),
                        (1, rng.randint(1, 300)), (1, rng.randint(3000, 9000))]
                splits, block_n = (None if (i + bs) % 2 else 1), None
            rows.append(guarded(check_attention, "paged_attention", kv, qd, bs,
                                f"{heads}/{kvh}x{hd}", kv, qd, bs, heads, kvh, hd, seqs,
                                device, seed + 13 * i + bs, splits, block_n,
                                rotated=kv in ("int8", "fp8") and bs == 16,
                                balanced=kv == "fp8" and bs == 16,
                                anchored=kv in ("int8", "fp8") and bs != 16))
    if log:
        log(f"{len(rows)} cases done; speculative verify rows ...")
    rows.extend(verify_cases(device, small, seed))
    if log:
        log(f"{len(rows)} cases done; sliding window and soft-capping ...")
    rows.extend(windowed_cases(device, small, seed))
    return rows


def verify_cases(device, small: bool, seed: int) -> list[dict]:
    """Speculative decoding's verify rows (engine/spec_decode/verify.py): sequences with 2 to 1 + K
    queries (K up to 8) over a long context, beside plain decode rows, per KV dtype and
    block size 1/16, with KV splits forced on half of them."""
    rows = []
    rng = random.Random(seed + 2)
    for i, (kv, qd) in enumerate(ATTN_CASES):
        for bs in (1, 16):
            if small:
                heads, kvh, hd = (4, 2, 16)
                seqs = [(rng.randint(2, 5), rng.randint(10, 40)), (1, rng.randint(5, 40)),
                        (rng.randint(2, 5), rng.randint(10, 40))]
                splits, block_n = 1 + 2 * ((i + bs) % 2), 16
            else:
                heads, kvh, hd = [(9, 3, 64), (32, 8, 128)][(i + bs) % 2]
                seqs = [(rng.randint(2, 9), rng.randint(500, 6000)), (1, rng.randint(1, 3000)),
                        (5, rng.randint(6000, 9000)), (rng.randint(2, 9), rng.randint(9, 200))]
                splits, block_n = (None if (i + bs) % 2 else 4), None
            rows.append(guarded(check_attention, "paged_attention verify", kv, qd, bs,
                                f"{heads}/{kvh}x{hd}", kv, qd, bs, heads, kvh, hd, seqs,
                                device, seed + 19 * i + bs, splits, block_n,
                                rotated=kv in ("int8", "fp8"), anchored=kv == "int8",
                                label=" verify"))
    return rows


def guarded(check, kernel: str, kv: str, q: str, bs: int, heads: str, *args, **kwargs) -> dict:
    try:
        return check(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        return {"kernel": kernel, "kv_dtype": kv, "q_dtype": q, "block_size": bs,
                "heads": heads, "error": f"{type(e).__name__}: {e}"[:300], "ok": False}


def windowed_cases(device, small: bool, seed: int) -> list[dict]:
    """Sliding window (shorter than most contexts: blocks freed) with logit soft-capping
    (gemma2-style; small enough a cap to bend the scores), per KV dtype and block size 1/16,
    decode rows with prefill chunks, split KV, anchors on the 1-byte pools."""
    rows = []
    rng = random.Random(seed + 1)
    for i, (kv, qd) in enumerate(ATTN_CASES):
        for bs in (1, 16):
            if small:
                heads, kvh, hd = [(4, 2, 16), (6, 2, 16)][(i + bs) % 2]
                window, m = 7, 40
                seqs = [(1, rng.randint(1, m)), (n := rng.randint(2, 12), n),
                        (rng.randint(2, 8), rng.randint(20, m)), (1, rng.randint(20, m))]
                splits, block_n = 1 + (i + bs) % 2, 16
            else:
                heads, kvh, hd = [(9, 3, 64), (16, 8, 256)][(i + bs) % 2]
                window = 1024
                seqs = [(1, rng.randint(1, 4000)), (n := rng.randint(100, 700), n),
                        (rng.randint(2, 300), rng.randint(1000, 3000)),
                        (1, rng.randint(1, 300)), (1, rng.randint(3000, 9000))]
                splits, block_n = (None if (i + bs) % 2 else 1), None
            rows.append(guarded(check_attention, f"paged_attention window {window} softcap 1.5",
                                kv, qd, bs, f"{heads}/{kvh}x{hd}", kv, qd, bs, heads, kvh, hd,
                                seqs, device, seed + 17 * i + bs, splits, block_n,
                                anchored=kv in ("int8", "fp8"), window=window, softcap=1.5))
    return rows
