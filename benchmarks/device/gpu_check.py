"""Check every Triton kernel against its torch reference and time them, on a GPU if there is one.

    python -m kvscope.benchmarks.device.gpu_check [--json] [--skip-e2e] [--quick]

With CUDA (under 5 minutes on one GPU):
1. correctness on the GPU: the KV write per KV dtype (must equal the reference bit for bit:
   codes, scales, rows) and paged attention per KV dtype, block sizes 1/16/256, GQA, a
   batch mixing decode rows and prefill chunks with and without cached context, with
   poisoned pools and output (tolerances as in tests/kernels/test_triton_kernels.py), and
   the same with a sliding window (blocks before it freed) and logit soft-capping;
2. paged decode attention at long context (batch 32 x 32k tokens, block size 16) for a
   SmolLM2-like head layout (9 heads / 3 kv heads / head_dim 64) and a Llama-3-8B-like one
   (32 / 8 / 128), per KV dtype: time, the KV bytes it must read (codes + scales + block
   table), the achieved bandwidth, and that as a share of a device-to-device copy's
   bandwidth (read + write) measured in the same run; the torch reference's time too for
   the small layout;
3. end to end: engine generated tokens/s (`LLM.generate`, greedy, ignore_eos) per KV dtype
   against Hugging Face `generate` (one static batch) on the same random-token workload,
   with the share of requests whose greedy output equals HF's.
Without CUDA it runs the CPU part (the same correctness checks on small shapes, Triton under
TRITON_INTERPRET=1) and says that the GPU part was skipped. --json prints one JSON object on
stdout (the table goes to stderr). The exit status is 1 when a correctness check fails.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Callable

from kvscope.benchmarks.timing import (
    add_json_flag,
    is_cuda,
    median_of,
    print_result,
    progress_logger,
    sync_device,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KV_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8")
DECODE_CONFIGS = {  # name: (heads, kv_heads, head_dim)
    "smollm2-like 9/3x64": (9, 3, 64),
    "llama3-8b-like 32/8x128": (32, 8, 128),
}


log = progress_logger("gpu_check")


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
                    softcap: float = 0.0) -> dict:
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
    return {"kernel": "paged_attention" + (" rotated" if rotated else "")
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


def correctness(device, small: bool, seed: int) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    for i, kv in enumerate(KV_DTYPE_NAMES):
        for bs in (1, 16, 256):
            kvh, hd = (3, 64) if not small else (2, 24)
            if small and bs == 256:
                kvh, hd = 1, 16
            rows.append(check_write(kv, bs, kvh, hd, 9 if small else 300, device,
                                    seed + 7 * i + bs))
    for i, (kv, qd) in enumerate(ATTN_CASES):
        for bs in (1, 16, 256):
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
            rows.append(check_attention(kv, qd, bs, heads, kvh, hd, seqs, device,
                                        seed + 13 * i + bs, splits, block_n,
                                        rotated=kv in ("int8", "fp8") and bs == 16,
                                        balanced=kv == "fp8" and bs == 16,
                                        anchored=kv in ("int8", "fp8") and bs != 16))
    rows += windowed_cases(device, small, seed)
    return rows


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
            try:
                rows.append(check_attention(kv, qd, bs, heads, kvh, hd, seqs, device,
                                            seed + 17 * i + bs, splits, block_n,
                                            anchored=kv in ("int8", "fp8"), window=window,
                                            softcap=1.5))
            except Exception as e:  # noqa: BLE001 - e.g. head_dim 256 out of resources
                rows.append({"kernel": f"paged_attention window {window} softcap 1.5",
                             "kv_dtype": kv, "q_dtype": qd, "block_size": bs,
                             "heads": f"{heads}/{kvh}x{hd}",
                             "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
    return rows


# -- timing ----------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], object], device: object = "cuda") -> float:
    """Median milliseconds: on CUDA triton.testing.do_bench (warm-up, L2 flushed between
    runs); elsewhere (dry runs of this script's code) a plain wall-clock median of 3."""
    if is_cuda(device):
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    return median_of(fn, 3, device=device) * 1e3


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    import torch

    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * n / (ms * 1e-3)


def decode_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim, device):
    """A filled pool (random codes/values, positive scales) without the poison pass."""
    import torch

    from kvscope.kernels.quant import is_quantized

    shape = (num_blocks, block_size, kv_heads, head_dim)

    def cache():
        if kv_dtype == torch.int8:
            return torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        if kv_dtype == torch.float8_e4m3fn:
            b = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)  # no NaN byte
            b |= torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
            return b.view(kv_dtype)
        return torch.randn(shape, dtype=kv_dtype, device=device)

    def scales():
        if not is_quantized(kv_dtype):
            return None
        return torch.rand(shape[:3], device=device) * 0.02 + 1e-3

    return cache(), cache(), scales(), scales()


def time_decode(name, heads, kv_heads, head_dim, kv_name, batch, ctx, block_size, device,
                copy_bw, with_ref: bool) -> dict:
    import torch

    from kvscope.kernels.attention_ref import (
        AttentionMetadata,
        group_decode_rows,
        paged_attention_ref,
    )
    from kvscope.kernels.quant import is_quantized
    from kvscope.kernels.triton_attention import _choose_splits, paged_attention_triton

    kv_dtype = torch_dtype(kv_name)
    per_seq = ctx // block_size
    num_blocks = batch * per_seq + 1
    pool = decode_pool(kv_dtype, num_blocks, block_size, kv_heads, head_dim, device)
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, per_seq)
    starts = list(range(batch + 1))
    ctx_lens = [ctx] * batch
    meta = AttentionMetadata(starts, ctx_lens, tables, torch.zeros(0, dtype=torch.long,
                                                                   device=device),
                             group_decode_rows(starts, ctx_lens), [])
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(head_dim)
    ms = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta, scale, pool[2],
                                                 pool[3], out=out), device)
    ms_rotated = ms_balanced = None
    if kv_name == "int8":  # the fused q / output rotation (kernels/rotation.py), same pool
        from kvscope.kernels.rotation import rotation_matrix

        r = rotation_matrix("hadamard", head_dim, device)
        ms_rotated = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta, scale,
                                                             pool[2], pool[3], out=out,
                                                             rotation=r), device)
        from kvscope.kernels.k_balance import KBalanceLayer

        kb = KBalanceLayer.of(torch.zeros(kv_heads, head_dim),
                              torch.ones(kv_heads, head_dim)).to(device)
        ms_balanced = bench_ms(lambda: paged_attention_triton(q, pool[0], pool[1], meta,
                                                              scale, pool[2], pool[3], out=out,
                                                              rotation=r, k_balance=kb), device)
    elem = pool[0].element_size()
    kv_bytes = batch * ctx * kv_heads * head_dim * elem * 2
    scale_bytes = batch * ctx * kv_heads * 4 * 2 if is_quantized(kv_dtype) else 0
    total = kv_bytes + scale_bytes + tables.numel() * 8 + 2 * q.numel() * q.element_size()
    bw = total / (ms * 1e-3)
    row = {"config": name, "kv_dtype": kv_name, "batch": batch, "context": ctx,
           "block_size": block_size, "num_splits": _choose_splits(q.device, batch * kv_heads,
                                                                  ctx),
           "ms": ms, "bytes_read": total, "gb_per_s": bw / 1e9, "share_of_copy_bw": bw / copy_bw,
           "ref_ms": None, "ms_rotated": ms_rotated, "ms_calibrated": ms_balanced}
    if with_ref:
        try:
            row["ref_ms"] = bench_ms(lambda: paged_attention_ref(q, pool[0], pool[1], meta,
                                                                 scale, pool[2], pool[3]),
                                     device)
        except torch.OutOfMemoryError:
            row["ref_ms"] = "out of memory"
    return row


# -- end to end ------------------------------------------------------------------------------
def end_to_end(seed: int, quick: bool, device: str = "cuda") -> dict:
    import torch

    from kvscope.benchmarks.bench import (
        build_workload,
        hf_generate_batch,
        load_hf,
        special_token_ids,
    )
    from kvscope.engine import LLM, EngineConfig, SamplingParams
    from kvscope.engine.config import resolve_device, resolve_dtype
    from kvscope.engine.loader import load_model

    n, prompt_range, out_len = (8, (32, 128), 32) if quick else (16, (64, 256), 64)
    result = {"requests": n, "prompt_range": list(prompt_range), "output_tokens": out_len,
              "engine": {}, "hf": None}
    base = loaded = None
    try:
        import kvscope.engine.model as model_mod
        from kvscope.kernels import ops

        result["engine_calls_kernels_ops"] = \
            getattr(model_mod, "paged_attention", None) is ops.paged_attention
        result["ops_backend_cuda"] = ops.backend("cuda")
    except Exception as e:  # noqa: BLE001 - report, never abort the check
        result["engine_calls_kernels_ops"] = f"unknown ({e})"
    for kv in ("auto", "int8", "fp8"):
        try:
            t0 = time.perf_counter()
            if loaded is None:  # load once; an engine that loads itself drops the tensors
                cfg = EngineConfig(device=device)
                loaded = load_model(cfg.model, resolve_dtype(cfg.dtype, resolve_device(device)))
            llm = LLM(EngineConfig(device=device, kv_dtype=kv), loaded=loaded)
            load_s = time.perf_counter() - t0
            eng = llm.engine
            if base is None:
                base = eng
                tok = llm.tokenizer
                reqs = build_workload(seed, n, prompt_range, (out_len, out_len),
                                      eng.model.shape.vocab_size, special_token_ids(tok))
            warm = [[100 + i for i in range(24)]] * 2
            llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
            sync_device(device)
            t0 = time.perf_counter()
            outs = llm.generate([r.prompt for r in reqs],
                                SamplingParams(max_tokens=out_len, ignore_eos=True))
            sync_device(device)
            s = time.perf_counter() - t0
            result["engine"][kv] = {
                "seconds": s, "tokens_per_s": n * out_len / s, "load_seconds": load_s,
                "kv_dtype": str(getattr(eng, "kv_dtype", "?")).removeprefix("torch."),
                "outputs": [list(o.token_ids) for o in outs]}
            del llm
        except Exception as e:  # noqa: BLE001 - e.g. a KV dtype the engine does not take yet
            result["engine"][kv] = {"error": f"{type(e).__name__}: {e}"}
    if base is not None:
        try:
            hf_model = load_hf(base.loaded.checkpoint, device, base.dtype)
            pad = base.tokenizer.eos_token_id if base.tokenizer.eos_token_id is not None else 0
            with torch.inference_mode():
                hf_generate_batch(hf_model, reqs[:2], pad, device)
                sync_device(device)
                t0 = time.perf_counter()
                hf_out = hf_generate_batch(hf_model, reqs, pad, device)
                sync_device(device)
                s = time.perf_counter() - t0
            result["hf"] = {"seconds": s, "tokens_per_s": n * out_len / s, "batch_size": n}
            for r in result["engine"].values():
                if "outputs" in r:
                    r["speedup_vs_hf"] = result["hf"]["seconds"] / r["seconds"]
                    r["requests_equal_to_hf"] = sum(
                        a == b for a, b in zip(r["outputs"], hf_out, strict=True)) / n
                    r["tokens_equal_to_hf"] = sum(
                        x == y for a, b in zip(r["outputs"], hf_out, strict=True)
                        for x, y in zip(a, b, strict=False)) / (n * out_len)
            del hf_model
        except Exception as e:  # noqa: BLE001
            result["hf"] = {"error": f"{type(e).__name__}: {e}"}
    for r in result["engine"].values():
        r.pop("outputs", None)
    return result


# -- report ----------------------------------------------------------------------------------
def format_report(r: dict) -> str:
    lines = [f"device: {r['device']}", ""]
    lines.append("correctness (Triton vs torch reference)")
    for c in r["checks"]:
        status = "ok  " if c["ok"] else "FAIL"
        if c["kernel"] == "kv_write":
            lines.append(f"  {status} kv_write   {c['kv_dtype']:>8} <- {c['src_dtype']:<8} "
                         f"block {c['block_size']:>3}: {c['mismatched_elements']} mismatched "
                         f"elements, {c['wrongly_touched_slots']} wrong slots (exact)")
        elif "error" in c:
            lines.append(f"  FAIL {c['kernel']} {c['kv_dtype']} q {c['q_dtype']} block "
                         f"{c['block_size']} heads {c['heads']}: {c['error']}")
        else:
            name = {"paged_attention rotated": "attn+rot ",
                    "paged_attention rotated balanced": "attn+bal "}.get(c["kernel"],
                                                                         "attention")
            if " window" in c["kernel"] or " softcap" in c["kernel"]:
                name = "attn+win "
            lines.append(f"  {status} {name}  {c['kv_dtype']:>8} q {c['q_dtype']:<8} "
                         f"block {c['block_size']:>3} heads {c['heads']:<9} splits "
                         f"{c['num_splits']!s:>4}: max err {c['max_abs_err']:.2e} "
                         f"(tol {c['tolerance']:.0e}, {c['err_over_tol']:.2f} of it), "
                         f"NaN {c['nan_outputs']}")
    if r.get("gpu_skipped"):
        lines += ["", f"GPU part skipped: {r['gpu_skipped']}"]
        return "\n".join(lines)
    lines += ["", f"device-to-device copy bandwidth: {r['copy_gb_per_s']:.0f} GB/s (read + write)",
              "", "paged decode attention (batch x context, block size 16, bf16 queries)",
              (f"  {'config':<26} {'kv':>8} {'splits':>6} {'ms':>8} {'GB read':>8} "
               f"{'GB/s':>7} {'of copy':>8} {'ref ms':>8}")]
    for d in r["decode"]:
        ref = d["ref_ms"]
        ref = f"{ref:8.2f}" if isinstance(ref, float) else f"{ref or '-':>8}"
        lines.append(f"  {d['config']:<26} {d['kv_dtype']:>8} {d['num_splits']:>6} "
                     f"{d['ms']:8.3f} {d['bytes_read'] / 1e9:8.2f} {d['gb_per_s']:7.0f} "
                     f"{d['share_of_copy_bw'] * 100:7.0f}% {ref}"
                     + (f"  rotated {d['ms_rotated']:.3f} ms" if d.get("ms_rotated") else "")
                     + (f"  calibrated {d['ms_calibrated']:.3f} ms"
                        if d.get("ms_calibrated") else ""))
    e = r.get("e2e")
    if e:
        lines += ["", (f"end to end: {e['requests']} requests, prompts {e['prompt_range']}, "
                       f"{e['output_tokens']} output tokens each (engine calls kernels.ops: "
                       f"{e.get('engine_calls_kernels_ops')})")]
        hf = e.get("hf") or {}
        if "tokens_per_s" in hf:
            lines.append(f"  HF generate (one static batch): {hf['tokens_per_s']:8.1f} tok/s")
        elif hf:
            lines.append(f"  HF generate: {hf.get('error')}")
        for kv, x in e["engine"].items():
            if "error" in x:
                lines.append(f"  engine kv {kv:<6}: {x['error']}")
            else:
                extra = ""
                if "speedup_vs_hf" in x:
                    extra = (f", {x['speedup_vs_hf']:.2f}x HF, outputs equal to HF: "
                             f"{x['requests_equal_to_hf'] * 100:.0f}% of requests, "
                             f"{x['tokens_equal_to_hf'] * 100:.0f}% of tokens")
                lines.append(f"  engine kv {kv:<6} ({x['kv_dtype']}): "
                             f"{x['tokens_per_s']:8.1f} tok/s{extra}")
    return "\n".join(lines)


def format_with_verdict(r: dict) -> str:
    verdict = "all checks passed" if r["ok"] else "CHECKS FAILED"
    return f"{format_report(r)}\n\n{verdict} (seed {r['seed']}, {r['seconds']:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    add_json_flag(p, "one JSON object on stdout")
    p.add_argument("--skip-e2e", action="store_true", help="no engine / HF generate part")
    p.add_argument("--quick", action="store_true", help="smaller end-to-end workload")
    p.add_argument("--seed", type=int, default=None, help="default: random, reported")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)

    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        # Must precede the first import of a kernel module (triton.jit reads it then).
        os.environ["TRITON_INTERPRET"] = "1"
    report: dict = {"seed": seed, "torch": torch.__version__}
    t_start = time.perf_counter()
    if has_cuda:
        props = torch.cuda.get_device_properties(0)
        report["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                            f"{props.total_memory / 2**30:.0f} GiB)")
        log(f"{report['device']}: correctness checks ...")
        report["checks"] = correctness("cuda", small=False, seed=seed)
        log("copy bandwidth ...")
        copy_bw = copy_bandwidth("cuda")
        report["copy_gb_per_s"] = copy_bw / 1e9
        report["decode"] = []
        for name, (h, kvh, hd) in DECODE_CONFIGS.items():
            for kv in KV_DTYPE_NAMES:
                log(f"decode {name} {kv} ...")
                report["decode"].append(time_decode(name, h, kvh, hd, kv, 32, 32768, 16,
                                                    "cuda", copy_bw,
                                                    with_ref=name.startswith("smol")))
                torch.cuda.empty_cache()
        if not args.skip_e2e:
            log("end to end ...")
            report["e2e"] = end_to_end(seed, args.quick)
    else:
        report["device"] = "cpu (Triton interpreter, TRITON_INTERPRET=1)"
        log("no CUDA device: interpreter checks on small shapes ...")
        report["checks"] = correctness("cpu", small=True, seed=seed)
        report["gpu_skipped"] = "no CUDA device (torch.cuda.is_available() is False)"
    report["ok"] = all(c["ok"] for c in report["checks"])
    report["seconds"] = time.perf_counter() - t_start
    print_result(report, format_with_verdict, args.json, table_to_stderr=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
